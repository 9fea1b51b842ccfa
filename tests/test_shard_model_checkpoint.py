"""Checkpoints and exports of models sharded by ``zerocore.shard_model``: a GPT-NeoX with PEFT
LoRA adapters (tests/hf_models.py).

- Exact resume: 2 ranks train 2 steps, save, train 2 more; a fresh model (other adapter
  values) on 2 ranks loads the checkpoint and trains the same 2 steps: bitwise the same losses
  and adapters. On 3 ranks (resharding 2 -> 3): the same within fp32 tolerance.
- ``python -m zerocore.consolidate --trainable-only --model-names``: the adapters alone, under
  the model's names, which PEFT saves as an adapter directory and loads back onto a fresh base.
- The live export: ``full_state_dict`` gathered onto rank 0, written by ``save_pretrained``
  (PEFT's adapter directory; transformers' safetensors for a fully trained model) and loaded
  back by PEFT / transformers with the trained values.
"""

from __future__ import annotations

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import zerocore
from dist_utils import global_mean
from hf_models import batch, build, decoder_layers, prepare
from zerocore import consolidate

LR = 1e-2
GLOBAL_ROWS = 6  # divisible by 2 and 3: the same global batch at both world sizes
# Resharding changes the order of the fp32 sums (tests/test_shard.py, LOSS_TOL: why 1e-5).
LOSS_TOL = dict(rtol=1e-5, atol=0.0)


def _step(model, opt, rank: int, world_size: int, step: int) -> float:
    ids = batch(step, GLOBAL_ROWS).chunk(world_size)[rank]
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return global_mean(loss)


def _sharded_lora(perturb: bool):
    model = prepare(build("neox"), "lora")
    if perturb:  # other adapter values: the checkpoint must overwrite them
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.5)
    sharded = zerocore.shard_model(model, decoder_layers(model))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, sharded, opt


def save_and_continue(rank: int, world_size: int, root: str) -> dict:
    model, sharded, opt = _sharded_lora(perturb=False)
    for step in range(2):
        _step(model, opt, rank, world_size, step)
    path = zerocore.save_checkpoint(root, 2, model, opt)
    saved = sharded.full_state_dict(trainable_only=True, to_rank=None)
    losses = [_step(model, opt, rank, world_size, step) for step in (2, 3)]
    return {"path": str(path), "losses": losses, "saved": saved,
            "final": sharded.full_state_dict(trainable_only=True, to_rank=None)}


def load_and_continue(rank: int, world_size: int, path: str) -> dict:
    model, sharded, opt = _sharded_lora(perturb=True)
    zerocore.load_checkpoint(path, model, opt)
    loaded = sharded.full_state_dict(trainable_only=True, to_rank=None)
    losses = [_step(model, opt, rank, world_size, step) for step in (2, 3)]
    return {"losses": losses, "loaded": loaded,
            "final": sharded.full_state_dict(trainable_only=True, to_rank=None)}


def test_resume_exact_and_reshard(worlds, tmp_path, capsys):
    first = worlds(2).run(save_and_continue, str(tmp_path / "ckpt"))[0]
    same = worlds(2).run(load_and_continue, first["path"])[0]
    for name, want in first["saved"].items():
        assert torch.equal(same["loaded"][name], want), name
    assert same["losses"] == first["losses"]  # bitwise: exact resume
    for name, want in first["final"].items():
        assert torch.equal(same["final"][name], want), name
    more = worlds(3).run(load_and_continue, first["path"])[0]
    for name, want in first["saved"].items():
        assert torch.equal(more["loaded"][name], want), name
    torch.testing.assert_close(torch.tensor(more["losses"]), torch.tensor(first["losses"]),
                               **LOSS_TOL)

    # The adapters alone, by the model's names, from the checkpoint; PEFT writes them as an
    # adapter directory and loads that onto a fresh base model.
    out = tmp_path / "adapter-tensors"
    assert consolidate.main([first["path"], str(out), "--trainable-only",
                             "--model-names"]) == 0
    tensors = load_file(str(out / consolidate.TRAINABLE_FILE))
    assert tensors.keys() == first["saved"].keys()
    assert all("lora_" in name for name in tensors)
    fresh = prepare(build("neox"), "lora")
    fresh.save_pretrained(str(tmp_path / "adapter"), state_dict=tensors)
    reloaded = PeftModel.from_pretrained(build("neox"), str(tmp_path / "adapter"))
    got = dict(reloaded.named_parameters())
    for name, want in first["saved"].items():
        assert torch.equal(got[name].detach(), want), name
    capsys.readouterr()


def export_run(rank: int, world_size: int, out: str, mode: str) -> dict:
    model = prepare(build("llama"), mode)
    sharded = zerocore.shard_model(model, decoder_layers(model))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        _step(model, opt, rank, world_size, step)
    state = sharded.full_state_dict(trainable_only=(mode == "lora"), to_rank=0)
    if rank == 0:
        model.save_pretrained(out, state_dict=state)
    ids = batch(9, 2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"logits": logits, "state": state}


def test_export_reloads(worlds, tmp_path):
    for mode in ("lora", "full"):
        out = tmp_path / mode
        r0 = worlds(2).run(export_run, str(out), mode)[0]
        if mode == "lora":
            reloaded = PeftModel.from_pretrained(build("llama"), str(out))
        else:
            reloaded = AutoModelForCausalLM.from_pretrained(str(out))
            # tie_word_embeddings: the head is the embedding, saved once
            assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
        got = dict(reloaded.named_parameters())
        for name, want in r0["state"].items():
            assert torch.equal(got[name].detach(), want), name
        with torch.no_grad():
            logits = reloaded(input_ids=batch(9, 2)).logits
        # The same weights (checked bitwise above); the ranks compute with one thread and
        # this process with several, which sum matmuls in another order: a few ulps.
        torch.testing.assert_close(logits, r0["logits"], rtol=1e-5, atol=1e-6)
