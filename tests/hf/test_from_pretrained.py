"""``zerocore.hf_pretrained``: a Hugging Face directory (``save_pretrained``'s, one file or
several, fp32 or bf16) loaded into a meta-built model that ``shard_model`` shards as each rank
reads its own bytes, at world sizes 1, 2 and 3, against ``transformers``' ``from_pretrained``.

- every parameter (``full_state_dict``) and buffer is bitwise ``from_pretrained``'s, through
  both doors (``from_pretrained`` and ``pretrained_on_meta`` + ``shard_model(read=)``);
- across the ranks every element of every parameter is read exactly once (a rank reading a
  whole tensor whose shard is a slice reads elements another rank reads too), and the bytes read
  on a node are the weights' bytes in the files, once;
- PEFT LoRA (with ``modules_to_save``) on the meta model: the same adapters on every rank, and
  training matches the unsharded ``from_pretrained`` model with those adapters;
- keys missing from or added to a checkpoint are treated as ``from_pretrained`` treats them;
- bad directories: one error on every rank before anything is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import zerocore
from tests.support.dist_utils import global_mean
from tests.support.hf_models import batch, build, decoder_layers
from zerocore.hf_pretrained import PretrainedError, from_pretrained, pretrained_on_meta

WORLD_SIZES = [1, 2, 3]
ARCHS = ["neox", "llama", "qwen2", "gpt2"]
# (layout, stored dtype, dtype asked for): one file of fp32 read as bf16 (from_pretrained's
# rounding), several small files of bf16 read in from_pretrained's default dtype (None: the
# config's, bf16). test_each_element_is_read_once_across_ranks reads bf16 as fp32.
LAYOUTS = {"one-fp32": ("one", torch.float32, torch.bfloat16),
           "sharded-bf16": ("sharded", torch.bfloat16, None)}
EAGER = dict(attn_implementation="eager")
LR = 1e-2
# As tests/hf/test_shard_model.py, for the same reasons (said there): the sharded model
# computes the same fp32 operations in another order, so losses agree to a few ulps and
# parameters within 2e-3·lr; Adam's eps 1e-6 keeps near-cancelling gradients from moving by lr.
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
PARAM_TOL = dict(rtol=1e-5, atol=2e-3 * LR)
EPS = 1e-6


def lora_config(arch: str) -> LoraConfig:
    targets = {"neox": ["query_key_value", "dense_4h_to_h"], "gpt2": ["c_attn"],
               }.get(arch, ["q_proj", "v_proj", "down_proj"])
    head = {"neox": "embed_out"}.get(arch, "lm_head")
    # modules_to_save: the head, a full trainable copy (read from the checkpoint like the head)
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                      modules_to_save=[head], fan_in_fan_out=arch == "gpt2",
                      init_lora_weights="gaussian")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[tuple[str, str], str]:
    """Every architecture saved in every layout, once for the module."""
    out = {}
    for arch in ARCHS:
        for layout, (files, stored, _) in LAYOUTS.items():
            path = tmp_path_factory.mktemp(f"{arch}-{layout}")
            model = build(arch).to(stored)
            model.save_pretrained(path, max_shard_size="20KB" if files == "sharded" else "1GB")
            assert (path / "model.safetensors.index.json").exists() == (files == "sharded")
            out[(arch, layout)] = str(path)
    return out


def _compare_to_transformers(model, path: str, dtype: torch.dtype) -> list[str]:
    """Names whose value differs from from_pretrained's (parameters through full_state_dict,
    buffers as this rank holds them)."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **EAGER)
    full = model.zerocore_sharding.full_state_dict(to_rank=None)
    ref_state = dict(ref.named_parameters())
    differ = [n for n, p in ref_state.items() if not torch.equal(p.detach().float(), full[n])]
    differ += [f"buffer {n}" for n, b in ref.named_buffers()
               if not torch.equal(b, model.get_buffer(n))]
    if set(full) != set(ref_state):
        differ.append(f"names {sorted(set(full) ^ set(ref_state))}")
    return differ


def load_and_compare(rank: int, world_size: int, path: str, dtype: torch.dtype,
                     door: str) -> dict:
    reads: list[tuple[str, int, int]] = []
    if door == "from_pretrained":
        model = from_pretrained(AutoModelForCausalLM, path, dtype=dtype, model_kwargs=EAGER)
        bytes_read = None
    else:
        pretrained = pretrained_on_meta(AutoModelForCausalLM, path, dtype=dtype, **EAGER)
        model = pretrained.model

        def read(name, start, stop):
            reads.append((name, start, stop))
            return pretrained.read(name, start, stop)
        zerocore.shard_model(model, decoder_layers(model), read=read)
        bytes_read = pretrained.files.bytes_read
        pretrained.close()
    return {"differ": _compare_to_transformers(model, path, dtype), "reads": reads,
            "bytes_read": bytes_read,
            "numel": {n: p.numel() for n, p in AutoModelForCausalLM.from_pretrained(
                path, **EAGER).named_parameters()}}


def tensor_bytes(path: str) -> int:
    """The bytes of the tensors in a saved directory's files (their headers excluded)."""
    total = 0
    for file in Path(path).glob("*.safetensors"):
        total += sum(t.numel() * t.element_size() for t in load_file(file).values())
    return total


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_as_transformers_does(world, saved, arch, layout):
    """Through zerocore's from_pretrained: bitwise from_pretrained's, on every rank."""
    path, dtype = saved[(arch, layout)], LAYOUTS[layout][2]
    for r, res in enumerate(world.run(load_and_compare, path, dtype, "from_pretrained")):
        assert not res["differ"], f"rank {r}: differ from from_pretrained: {res['differ']}"


@pytest.mark.parametrize("arch", ARCHS)
def test_each_element_is_read_once_across_ranks(world, saved, arch):
    """Through shard_model(read=): every element of every parameter is read by exactly one
    rank (disjoint ranges covering it), and the node reads the files' tensor bytes once."""
    path = saved[(arch, "sharded-bf16")]
    results = world.run(load_and_compare, path, torch.float32, "shard_model")
    assert not results[0]["differ"], results[0]["differ"]
    numel = results[0]["numel"]
    by_name: dict[str, list[tuple[int, int]]] = {}
    for res in results:
        for name, start, stop in res["reads"]:
            by_name.setdefault(name, []).append((start, stop))
    assert set(by_name) == set(numel), sorted(set(by_name) ^ set(numel))
    for name, ranges in by_name.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == numel[name], (name, ranges)
        for (_, stop), (start, _) in zip(ranges, ranges[1:]):
            assert stop == start, f"{name}: ranges {ranges} overlap or leave a gap"
    assert sum(r["bytes_read"] for r in results) == tensor_bytes(path)


def lora_run(rank: int, world_size: int, path: str, arch: str, steps: int) -> dict:
    """LoRA (and modules_to_save) on the meta model, sharded through shard_model(read=), then
    trained; rank 0 also trains from_pretrained's model with the same adapter values."""
    pretrained = pretrained_on_meta(AutoModelForCausalLM, path, dtype=torch.float32,
                                    peft_config=lora_config(arch), seed=3, **EAGER)
    model = pretrained.model
    # As each rank created them, before sharding: they must be the same everywhere.
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    sharding = zerocore.shard_model(model, decoder_layers(model), read=pretrained.read)
    pretrained.close()
    initial = sharding.full_state_dict()
    ref = None
    if rank == 0:
        ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  **EAGER), lora_config(arch))
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if not p.requires_grad:  # the base weights: from_pretrained's own
                    assert torch.equal(p, initial[n]), f"{n} differs from from_pretrained's"
                p.copy_(initial[n])
        ref.train()
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                                    eps=EPS)
    model.train()
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, ref_losses = [], []
    for step in range(steps):
        ids = batch(step, 2 * world_size)
        loss = model(input_ids=ids.chunk(world_size)[rank], labels=ids.chunk(world_size)[rank],
                     use_cache=False).loss
        loss.backward()
        losses.append(global_mean(loss))
        opt.step()
        opt.zero_grad()
        if ref is not None:
            ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
            ref_opt.step()
            ref_opt.zero_grad()
    final = sharding.full_state_dict(to_rank=0)
    out = {"adapters": adapters, "losses": losses}
    if ref is not None:
        out.update(ref_losses=ref_losses, final=final, initial=initial,
                   ref_final={n: p.detach() for n, p in ref.named_parameters()},
                   trainable={n for n, p in ref.named_parameters() if p.requires_grad})
    return out


@pytest.mark.parametrize("arch", ["neox", "llama", "gpt2"])
def test_lora_on_the_meta_model_trains_as_from_pretrained(world, saved, arch):
    results = world.run(lora_run, saved[(arch, "sharded-bf16")], arch, 3)
    r0 = results[0]
    assert r0["adapters"], "no adapter parameters"
    for r, res in enumerate(results[1:], 1):
        for n, t in r0["adapters"].items():
            assert torch.equal(res["adapters"][n], t), f"rank {r}: adapter {n} differs"
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(r0["ref_losses"]),
                               **LOSS_TOL)
    assert r0["final"].keys() == r0["ref_final"].keys()
    for n, want in r0["ref_final"].items():
        if n in r0["trainable"]:
            torch.testing.assert_close(r0["final"][n], want, **PARAM_TOL, msg=n)
            assert not torch.equal(r0["final"][n], r0["initial"][n]), f"{n} was not trained"
        else:
            assert torch.equal(r0["final"][n], r0["initial"][n]), f"frozen {n} changed"


def test_adapters_follow_the_seed(saved):
    """The seed decides the adapters (the same on every rank for one seed; another seed, others),
    so a test of equal adapters across ranks is not equal by accident."""
    def adapters(seed):
        pretrained = pretrained_on_meta(AutoModelForCausalLM, saved[("llama", "one-fp32")],
                                        peft_config=lora_config("llama"), seed=seed, **EAGER)
        return {n: p.detach().clone() for n, p in pretrained.model.named_parameters()
                if "lora_A" in n}
    a, b = adapters(1), adapters(2)
    assert a.keys() == b.keys() and a
    assert not any(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(x, y) for x, y in zip(adapters(1).values(), a.values()))


def _edited(saved_path: str, dest: Path, edit) -> str:
    """A copy of a one-file directory with its tensors edited by ``edit(dict)``."""
    dest.mkdir()
    for name in ("config.json",):
        (dest / name).write_text((Path(saved_path) / name).read_text())
    tensors = load_file(Path(saved_path) / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return str(dest)


def missing_and_unexpected(rank: int, world_size: int, path: str) -> dict:
    pretrained = pretrained_on_meta(AutoModelForCausalLM, path, dtype=torch.float32, **EAGER)
    model = pretrained.model
    zerocore.shard_model(model, decoder_layers(model), read=pretrained.read)
    return {"missing": pretrained.missing, "unexpected": pretrained.unexpected,
            "differ": _compare_to_transformers(model, path, torch.float32)}


def test_missing_and_unexpected_keys_as_from_pretrained(worlds, saved, tmp_path):
    """A checkpoint without the final norm (initialised to ones, by the model's own init, as
    from_pretrained does) and with a key the model lacks (reported, not read)."""
    def edit(t):
        del t["model.norm.weight"]
        t["model.extra.weight"] = torch.zeros(3)
    path = _edited(saved[("llama", "one-fp32")], tmp_path / "edited", edit)
    for res in worlds(2).run(missing_and_unexpected, path):
        assert res["missing"] == ["model.norm.weight"]
        assert res["unexpected"] == ["model.extra.weight"]
        assert not res["differ"], res["differ"]


def refused(rank: int, world_size: int, path: str) -> str:
    try:
        from_pretrained(AutoModelForCausalLM, path, model_kwargs=EAGER)
    except (PretrainedError, zerocore.PeerError) as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _truncated(src: str, dest: Path) -> str:
    dest.mkdir()
    for f in Path(src).iterdir():
        data = f.read_bytes()
        (dest / f.name).write_bytes(data[:-100] if f.suffix == ".safetensors" else data)
    return str(dest)


def _index_edit(src: str, dest: Path, new_name: str) -> str:
    """A copy of a sharded directory whose index sends one key to ``new_name``."""
    dest.mkdir()
    for f in Path(src).iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = new_name
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dest)


def _other_config(src: str, dest: Path) -> str:
    dest.mkdir()
    for f in Path(src).iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    config = json.loads((dest / "config.json").read_text())
    config["intermediate_size"] = 48
    (dest / "config.json").write_text(json.dumps(config))
    return str(dest)


@pytest.mark.parametrize("case,expect", [
    ("no-directory", "no such directory"),
    ("truncated", "truncated"),
    ("index-names-missing-file", "which is not there"),
    ("index-leads-outside", "leads outside the directory"),
    ("shape-disagrees-with-config", "the config and the weights are of different models"),
])
def test_bad_directories_are_refused_on_every_rank(worlds, saved, tmp_path, case, expect):
    src_one, src_sharded = saved[("llama", "one-fp32")], saved[("llama", "sharded-bf16")]
    (tmp_path / "outside.safetensors").write_bytes(
        (Path(src_one) / "model.safetensors").read_bytes())
    path = {"no-directory": lambda: str(tmp_path / "nothing"),
            "truncated": lambda: _truncated(src_one, tmp_path / "d"),
            "index-names-missing-file": lambda: _index_edit(src_sharded, tmp_path / "d",
                                                            "model-9-of-9.safetensors"),
            "index-leads-outside": lambda: _index_edit(src_sharded, tmp_path / "d",
                                                       "../outside.safetensors"),
            "shape-disagrees-with-config": lambda: _other_config(src_one, tmp_path / "d"),
            }[case]()
    outcomes = worlds(2).run(refused, path)
    assert outcomes[0].startswith("PretrainedError") and expect in outcomes[0], outcomes[0]
    for r, outcome in enumerate(outcomes[1:], 1):
        assert outcome.startswith("PeerError") and expect in outcome, (r, outcome)
