"""Checkpoints of NVMe-offloaded runs (``Offload(optimizer="nvme")``, with ``params="nvme"``
too): ordinary zerocore checkpoints, written from the scratch (mapped, array by array) and read
back into it; the same tensors as a run in memory saves (the frozen shards included); resumed
exactly, by an NVMe run or a run in memory, at the world size that saved them or another. In
fp32 with the parameters in memory the masters are the model copies there, not in the scratch:
saved and restored from there, the same bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerocore
from zerocore.policies import MIN_POOL_BYTES
from tests.support.toy_stack import (LR, WEIGHT_DECAY, Spec, accumulate_step, make_layers)

SPEC = Spec(model="transformer", steps=4, train="no_embedding", max_norm=0.05,
            param_dtype=torch.bfloat16)
SAVED_AT = 2
# The same in fp32: the masters are the model copies in host memory (none in the scratch).
FP32 = dataclasses.replace(SPEC, param_dtype=torch.float32)


def run(rank: int, world_size: int, nvme: str | None, steps: range, save: str | None = None,
        resume: str | None = None, params: bool = True, spec: Spec = SPEC) -> dict:
    """Trains ``steps`` (from a checkpoint when ``resume``), optimizer on NVMe in ``nvme``
    (and the parameter shards, with ``params``) or in memory (None); this rank's losses and
    the gradient norm of each step, exactly, and the final parameters (every rank the same).
    Saves with the frozen shards."""
    offload = zerocore.Offload()
    if nvme:
        # A pool of two slots at least of the largest shard (the frozen embedding at one rank).
        offload = zerocore.Offload(optimizer="nvme", params="nvme" if params else False,
                                   path=nvme, pool_bytes=256 * 1024 if params
                                   else MIN_POOL_BYTES)
    model = zerocore.shard(make_layers(spec), offload=offload,
                           mixed_precision=zerocore.MixedPrecision(spec.param_dtype))
    opt = zerocore.optim.AdamW(model.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = zerocore.LossScaler(model.group, dynamic=False)
    if resume is not None:
        zerocore.load_checkpoint(resume, model, opt, scaler=scaler)
    per_step = []
    for step in steps:
        losses = accumulate_step(model, spec, step, rank, world_size)
        per_step.append((*losses, scaler.step(opt, max_norm=spec.max_norm).grad_norm))
        opt.zero_grad()
    saved = None
    if save is not None:
        saved = str(zerocore.save_checkpoint(save, steps.stop, model, opt, scaler=scaler,
                                             include_frozen=True))
    full = {f"{i}.{n}": t for i, st in model.iter_full_states() for n, t in st.items()}
    return dict(steps=per_step, full=full, saved=saved)


def rank_file_layers(path: str, rank: int) -> dict:
    return torch.load(f"{path}/rank-{rank:05d}.pt", weights_only=True)["layers"]


@pytest.mark.parametrize("params, spec", [(False, SPEC), (True, SPEC), (False, FP32)],
                         ids=["optimizer", "optimizer-and-params", "optimizer-fp32"])
def test_an_nvme_checkpoint_holds_what_a_run_in_memory_saves(worlds, tmp_path, params, spec):
    world = worlds(2)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    memory = world.run(run, None, range(SAVED_AT), str(tmp_path / "memory"), None, True,
                       spec)[0]["saved"]
    nvme = world.run(run, str(scratch), range(SAVED_AT), str(tmp_path / "nvme"), None,
                     params, spec)[0]["saved"]
    for r in range(2):
        a, b = rank_file_layers(memory, r), rank_file_layers(nvme, r)
        assert a.keys() == b.keys()
        for index in a:
            assert a[index].keys() == b[index].keys()
            for key, value in a[index].items():
                if isinstance(value, torch.Tensor):  # master, moments, frozen: their bytes
                    assert torch.equal(value, b[index][key]), (index, key)
                    assert (b[index][key].untyped_storage().nbytes()
                            == value.numel() * value.element_size())
                else:
                    assert value == b[index][key], (index, key)


def test_an_nvme_run_resumes_exactly_anywhere(worlds, tmp_path):
    """Saved by 2 NVMe ranks (optimizer and parameters) after 2 steps, then: resumed by 2 NVMe
    ranks, bitwise the uninterrupted run; resumed at 3 and 1 ranks, by NVMe and by runs in
    memory, bitwise each other (a checkpoint resumed at another world size continues as one
    of a run in memory: tests/checkpoints/test_checkpoint.py compares that with the
    uninterrupted run)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    whole = worlds(2).run(run, None, range(SPEC.steps))
    first = worlds(2).run(run, str(scratch), range(SAVED_AT), str(tmp_path / "ckpt"))
    ckpt = first[0]["saved"]
    rest = range(SAVED_AT, SPEC.steps)
    again = worlds(2).run(run, str(scratch), rest, None, ckpt)
    for r in range(2):
        assert first[r]["steps"] + again[r]["steps"] == whole[r]["steps"], r
    assert whole[0]["full"].keys() == again[0]["full"].keys()
    for name, t in whole[0]["full"].items():
        assert torch.equal(again[0]["full"][name], t), name
    for world_size in (3, 1):
        by_nvme = worlds(world_size).run(run, str(scratch), rest, None, ckpt)
        in_memory = worlds(world_size).run(run, None, rest, None, ckpt)
        for a, b in zip(by_nvme, in_memory):
            assert a["steps"] == b["steps"], world_size
            for name, t in b["full"].items():
                assert torch.equal(a["full"][name], t), (world_size, name)
    assert list(scratch.iterdir()) == []


def test_an_fp32_nvme_run_resumes_exactly(worlds, tmp_path):
    """fp32, the parameters in memory: the masters are the model copies, the scratch holds the
    moments alone. Saved after 2 steps and resumed, by NVMe runs at 2 ranks: bitwise the
    uninterrupted run in memory (what is saved and restored as the master is the copy)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    whole = worlds(2).run(run, None, range(SPEC.steps), None, None, False, FP32)
    first = worlds(2).run(run, str(scratch), range(SAVED_AT), str(tmp_path / "ckpt"), None,
                          False, FP32)
    again = worlds(2).run(run, str(scratch), range(SAVED_AT, SPEC.steps), None,
                          first[0]["saved"], False, FP32)
    for r in range(2):
        assert first[r]["steps"] + again[r]["steps"] == whole[r]["steps"], r
    for name, t in whole[0]["full"].items():
        assert torch.equal(again[0]["full"][name], t), name
    assert list(scratch.iterdir()) == []
