"""Checkpoints and exports of models sharded by ``zerocore.shard_model``: a GPT-NeoX with PEFT
LoRA adapters (tests/support/hf_models.py).

- Exact resume: 2 ranks train 2 steps, save, train 2 more; a fresh model (other adapter
  values) on 2 ranks loads the checkpoint and trains the same 2 steps: bitwise the same losses
  and adapters. On 3 ranks (resharding 2 -> 3): the same within fp32 tolerance.
- ``python -m zerocore.consolidate --trainable-only --model-names``: the adapters alone, under
  the model's names, which PEFT saves as an adapter directory and loads back onto a fresh base.
- The live export: ``full_state_dict`` gathered onto rank 0, written by ``save_pretrained``
  (PEFT's adapter directory; transformers' safetensors for a fully trained model) and loaded
  back by PEFT / transformers with the trained values.
- Rank files swapped between ranks or taken from another run of the same shape (saved without
  run ids; checksums recomputed) are refused on every rank, nothing loaded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import zerocore
from tests.support.dist_utils import global_mean
from tests.support.hf_models import batch, build, decoder_layers, prepare
from zerocore import consolidate

LR = 1e-2
GLOBAL_ROWS = 6  # divisible by 2 and 3: the same global batch at both world sizes
# Resharding changes the order of the fp32 sums (tests/engine/test_shard.py, LOSS_TOL: why 1e-5).
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


def try_load(rank: int, world_size: int, path: str) -> dict:
    """Loads ``path`` into a fresh (perturbed) model: the refusal, and whether the model's
    trainable values stayed as they were."""
    model, sharded, opt = _sharded_lora(perturb=True)
    before = sharded.full_state_dict(trainable_only=True, to_rank=None)
    try:
        zerocore.load_checkpoint(path, model, opt)
    except zerocore.CheckpointError as e:
        after = sharded.full_state_dict(trainable_only=True, to_rank=None)
        return {"message": str(e), "unchanged": all(torch.equal(after[k], v)
                                                    for k, v in before.items())}
    return {"message": None}


def _fix_checksum(path: Path, name: str) -> None:
    """What anyone copying files can do: the manifest's checksum and its COMMIT recomputed."""
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    raw = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(raw)
    (path / "COMMIT").write_text(json.dumps({"format": manifest["format"],
                                             "manifest_sha256": hashlib.sha256(raw).hexdigest(),
                                             "manifest_bytes": len(raw)}))


def test_rank_files_of_another_rank_or_save_are_refused(worlds, tmp_path):
    """shard_model's checkpoint path: two runs of the same shape saved without run ids; a rank
    file swapped or taken from the other run, checksums recomputed, is refused on every rank
    before anything is loaded."""
    a = Path(worlds(2).run(save_and_continue, str(tmp_path / "a"))[0]["path"])
    b = Path(worlds(2).run(save_and_continue, str(tmp_path / "b"))[0]["path"])
    swapped = Path(shutil.copytree(a, tmp_path / "swapped" / a.name))
    (swapped / "rank-00000.pt").rename(swapped / "tmp")
    (swapped / "rank-00001.pt").rename(swapped / "rank-00000.pt")
    (swapped / "tmp").rename(swapped / "rank-00001.pt")
    _fix_checksum(swapped, "rank-00000.pt")
    _fix_checksum(swapped, "rank-00001.pt")
    foreign = Path(shutil.copytree(a, tmp_path / "foreign" / a.name))
    shutil.copyfile(b / "rank-00001.pt", foreign / "rank-00001.pt")
    _fix_checksum(foreign, "rank-00001.pt")
    for path, text in ((swapped, f"{swapped}/rank-00000.pt: is rank 1's file of 2, not rank "
                                 f"0's"),
                       (foreign, f"{foreign}/rank-00001.pt: belongs to another save")):
        results = worlds(2).run(try_load, str(path))
        assert {r["message"] for r in results} == {results[0]["message"]}
        assert results[0]["message"].startswith(text) and "\n" not in results[0]["message"]
        assert all(r["unchanged"] for r in results)
    assert worlds(2).run(try_load, str(b))[0]["message"] is None
