"""Sharded checkpoints: exact resume, resharding, crash safety, consolidation, corruption.

- Exact resume (gloo, world size 2): 20 uninterrupted steps against 10 steps, save, a fresh model
  and optimizer (other initial weights, other RNG state) that loads the checkpoint, and 10 more:
  the losses, the samples each rank saw, every rank's shards and Adam moments and the full
  parameters are bitwise identical. fp32 with dropout (each rank's RNG stream must come back),
  bf16, fp16 with a dynamic loss scale that changes during the run, and bf16 with CPU offload.
- Resharding: saved by 2 ranks and resumed by 1 and by 3, and saved by 3 and resumed by 2: the
  losses match the uninterrupted run within fp32 tolerance.
- The CLI: ``python -m neox.finetune`` resumed from step 3 of 6 writes the same losses for steps
  4..6 as the uninterrupted run, and resumes with another ``--nproc``.
- Crash safety: a process saving in a loop is SIGKILLed in each phase of a save and at random
  moments; every time, the latest checkpoint is complete and resumes; ``keep_last`` keeps
  exactly K; leftovers of killed saves are cleaned up by the next save.
- Consolidation (``python -m zerocore.consolidate``): full weights equal the unsharded model's;
  ``--trainable-only`` holds exactly the trainable names and is < 1% of the full output for bias
  fine-tuning of an 8-block GPT-NeoX; clear errors without frozen weights or onto an existing OUT.
- Corruption and mismatch: each is reported on every rank, naming the file and the problem,
  before anything is modified.

The ranks of each world size are started once for the module (dist_utils.World); the CLI,
consolidation and the crash test run real subprocesses.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerocore
from zerocore import consolidate
from tests.support.dist_utils import global_mean
from neox.config import PRESETS
from neox.data import WindowSampler
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import build_layers
from safetensors.torch import load_file
from zerocore.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints,
                                 read_manifest, verify_files)
from zerocore.checkpoint.manifest import commit_record

REPO = Path(__file__).resolve().parents[2]

LR = 1e-2
WEIGHT_DECAY = 0.1
CLIP = 1.0            # the global-norm clip is part of every step, so it is resumed too
D_IN, HIDDEN, D_OUT = 13, 31, 7   # odd sizes: padding inside and at the end of every group
N_SAMPLES = 84        # 7 steps per epoch: the 20-step runs cross two epoch boundaries and the
GLOBAL_BATCH = 12     # save at step 10 falls inside epoch 1; 12 divides by 1, 2 and 3 ranks
DATA_SEED = 7
# fp16 runs: a start high enough that the first steps overflow and are skipped, and a short
# window so the scale also grows during the run: the scaler's whole state matters at step 10.
FP16_SCALING = zerocore.LossScaling(init_scale=2.0**20, window=3, hysteresis=2)

# Resharding changes how the global batch is split and how gradients are summed across ranks
# (and the reduce-scatter's order of additions), so losses after a resume at another world size
# agree to fp32 rounding, not bitwise. Measured: relative difference <= 1.7e-7 over the 20
# steps for 2->1, 2->3 and 3->2 (the same as between uninterrupted runs at different
# world sizes: tests/engine/test_shard.py measures <= 4.3e-7). 1e-5 relative is generous,
# while a shard
# restored at a wrong offset or a lost Adam moment changes the next loss by far more than that.
RESHARD_LOSS_TOL = dict(rtol=1e-5, atol=0.0)
# Parameters after the 10 resumed steps: Adam turns a few ulps of gradient noise into a
# difference in units of lr (see PARAM_TOL in tests/engine/test_shard.py); measured <= 1.2e-7 here,
# 80x below 1e-3·lr, which still catches a skipped update (~lr) or a missing weight decay.
RESHARD_PARAM_TOL = dict(rtol=1e-5, atol=1e-3 * LR)

CLI_LR = 1e-2  # large, so that each step visibly moves the losses the CLI test compares
# The CLI's biases after a resume with another --nproc. The biases start at zero and some of
# their gradients nearly cancel, so Adam turns rounding noise into updates of a visible fraction
# of lr (measured: 9.6e-6 = 1e-3·lr). 1e-2·lr leaves a 10x margin; a lost or repeated step moves
# a bias by ~lr, 100x more.
CLI_PARAM_TOL = dict(rtol=1e-5, atol=1e-2 * CLI_LR)


# -- the model and its training, on every rank ---------------------------------------------------


class FrozenWeight(nn.Module):
    """A linear layer whose weight is frozen and whose bias trains (bias fine-tuning)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fc.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


def make_layers(dropout: float, hidden: int = HIDDEN) -> list[nn.Module]:
    """The base model: trainable, frozen-weight/trainable-bias, fully frozen and trainable
    layers; the same weights on every rank and in every run."""
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
    frozen.requires_grad_(False)
    return [nn.Sequential(nn.Linear(D_IN, hidden), nn.GELU(), nn.Dropout(dropout)),
            FrozenWeight(hidden),
            frozen,
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, D_OUT))]


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(N_SAMPLES, D_IN, generator=g), torch.randn(N_SAMPLES, D_OUT, generator=g)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Job:
    steps: int                     # train until this global step
    save_dir: str | None = None    # then save a checkpoint under this root
    resume: str | None = None      # load this checkpoint first
    precision: str = "fp32"
    offload: bool = False          # Offload(optimizer=True)
    offload_params: bool = False   # Offload(params=True)
    dropout: float = 0.0
    init_seed: int = 0             # != 0: the trainable weights start elsewhere (re-drawn
    perturb_frozen: bool = False   # from this seed), and the frozen ones too if asked; a load
    hidden: int = HIDDEN           # must replace them
    include_frozen: bool = False   # save the frozen shards too
    keep_last: int = 3


def build(job: Job, rank: int, world_size: int):
    dtype = PRECISIONS[job.precision]
    layers = make_layers(job.dropout, job.hidden)
    if job.init_seed:
        g = torch.Generator().manual_seed(job.init_seed)
        with torch.no_grad():
            for layer in layers:
                for p in layer.parameters():
                    if p.requires_grad or job.perturb_frozen:
                        p.normal_(generator=g)
    model = zerocore.shard(layers,
                           mixed_precision=zerocore.MixedPrecision(param_dtype=dtype),
                           offload=zerocore.Offload(optimizer=job.offload,
                                                    params=job.offload_params))
    optimizer = zerocore.optim.AdamW(model.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    # A decaying learning rate: the scheduler's position is part of what must resume.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    scaler = zerocore.LossScaler(model.group, dynamic=dtype == torch.float16,
                                 policy=FP16_SCALING, counter=model.counter)
    sampler = WindowSampler(
        N_SAMPLES, rank=rank, world_size=world_size, batch_size=GLOBAL_BATCH // world_size,
        seed=DATA_SEED)
    return model, optimizer, scheduler, scaler, sampler


def rank_state(model: zerocore.ShardedSequential,
               optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything this rank holds: shards, low-precision copies, moments and step counts."""
    out: dict[str, torch.Tensor] = {}
    for layer in model.layers:
        if layer.trainable is not None:
            shard = layer.trainable.shard
            out[f"{layer.index}.master"] = shard.detach().clone()
            if shard.model_copy is not None:
                out[f"{layer.index}.model_copy"] = shard.model_copy.clone()
            for key, value in optimizer.state[shard].items():
                out[f"{layer.index}.{key}"] = value.detach().clone()
        if layer.frozen is not None:
            out[f"{layer.index}.frozen"] = layer.frozen.shard.detach().clone()
    return out


def full_params(model: zerocore.ShardedSequential) -> dict[str, torch.Tensor]:
    """Collective: every unsharded parameter, trainable ones from the fp32 masters."""
    return {f"layers.{layer.index}.{name}": t for layer in model.layers
            for name, t in layer.full_state().items()}


def train(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    model, optimizer, scheduler, scaler, sampler = build(job, rank, world_size)
    # Each rank's own dropout stream: a load that gave every rank rank 0's RNG state would show.
    torch.manual_seed(100 + rank)
    step = 0
    if job.resume is not None:
        torch.manual_seed(999)  # as in a fresh process: the load must replace this state
        extra = zerocore.load_checkpoint(job.resume, model, optimizer, scaler=scaler)
        step = extra["step"]
        sampler.load_state_dict(extra["sampler"])
        scheduler.load_state_dict(extra["scheduler"])
    x_all, y_all = dataset()
    dtype = PRECISIONS[job.precision]
    losses, rank_losses, seen, scales, skipped = [], [], [], [], []
    while step < job.steps:
        idx = sampler.next_batch()
        loss = F.mse_loss(model(x_all[idx].to(dtype)).float(), y_all[idx])
        scaler.scale(loss).backward()
        result = scaler.step(optimizer, max_norm=CLIP)
        if not result.skipped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(global_mean(loss))
        rank_losses.append(loss.item())
        seen.append(idx.tolist())
        scales.append(result.loss_scale)
        skipped.append(result.skipped)
    if job.save_dir is not None:
        extra = {"step": step, "sampler": sampler.state_dict(),
                 "scheduler": scheduler.state_dict()}
        zerocore.save_checkpoint(job.save_dir, step, model, optimizer, scaler=scaler, extra=extra,
                                 keep_last=job.keep_last, include_frozen=job.include_frozen)
    return {"losses": losses, "rank_losses": rank_losses, "seen": seen, "scales": scales,
            "skipped": skipped, "scaler": scaler.state_dict(), "lr": scheduler.get_last_lr(),
            "state": rank_state(model, optimizer), "full": full_params(model),
            "rng": torch.get_rng_state()}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str,
                        **tol: float) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        if tol:
            torch.testing.assert_close(a[name], b[name], **tol, msg=f"{what}: {name}")
        else:
            assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


# -- exact resume --------------------------------------------------------------------------------


RESUME_CASES = {
    "fp32-dropout": dict(precision="fp32", dropout=0.1),
    "bf16": dict(precision="bf16"),
    "fp16-loss-scale": dict(precision="fp16"),
    "bf16-offload": dict(precision="bf16", offload=True),
    # Parameter shards on the host, the optimizer on the device; the frozen shards saved, and
    # wrong in the resumed model until the load writes them (into the host arena).
    "bf16-offload-params-with-frozen": dict(precision="bf16", offload_params=True,
                                            include_frozen=True, perturb_frozen=True),
    "fp32-offload-params-and-optimizer": dict(precision="fp32", offload=True,
                                              offload_params=True),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_is_bitwise_exact(worlds, tmp_path, case):
    """20 steps in one go == 10 steps, save, fresh model and optimizer, load, 10 steps."""
    world = worlds(2)
    opts = RESUME_CASES[case]
    full = world.run(train, Job(steps=20, **opts))
    first = world.run(train, Job(steps=10, save_dir=str(tmp_path), **opts))
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step-00000010"
    for r in range(2):
        # A rank file holds its shards and moments, not the storage they live in (an offloaded
        # master is a view of the host arena, reserved at the host's memory size; torch.save
        # writes whole storages): at most its state's bytes (the model copies, also counted,
        # are not saved) plus 256 KiB of zip records, pickle and RNG state.
        state_bytes = sum(t.numel() * t.element_size() for t in first[r]["state"].values())
        size = (ckpt / f"rank-{r:05d}.pt").stat().st_size
        assert size <= state_bytes + (256 << 10), (r, size, state_bytes)
    second = world.run(train, Job(steps=20, resume=str(ckpt), init_seed=1, **opts))

    for r in range(2):
        whole, a, b = full[r], first[r], second[r]
        assert a["rank_losses"] + b["rank_losses"] == whole["rank_losses"], f"rank {r} losses"
        # The data order: every rank trains on the same samples at the same steps.
        assert a["seen"] + b["seen"] == whole["seen"], f"rank {r} data order"
        assert a["scales"] + b["scales"] == whole["scales"], f"rank {r} loss scales"
        assert_same_tensors(b["state"], whole["state"], f"rank {r} shards and moments")
        assert torch.equal(b["rng"], whole["rng"]), f"rank {r} RNG state"
        assert b["scaler"] == whole["scaler"] and b["lr"] == whole["lr"]
    assert first[0]["losses"] + second[0]["losses"] == full[0]["losses"]
    assert_same_tensors(second[0]["full"], full[0]["full"], "full parameters")

    if case == "fp16-loss-scale":
        # The scaler's state at the save is one a fresh scaler could not reproduce: steps were
        # skipped and the scale moved both ways before it (measured: 2**20 down to 2**16 over
        # five skipped steps, then up to 2**17).
        scales = full[0]["scales"]
        assert any(full[0]["skipped"][:10]) and not all(full[0]["skipped"])
        moves = list(zip(scales[:10], scales[1:11]))
        assert any(b < a for a, b in moves) and any(b > a for a, b in moves)
    # No sample is seen twice within an epoch, across the resume.
    order = [i for step in zip(*(full[r]["seen"] for r in range(2))) for b in step for i in b]
    per_epoch = (N_SAMPLES // GLOBAL_BATCH) * GLOBAL_BATCH
    for e in range(0, len(order), per_epoch):
        assert len(set(order[e:e + per_epoch])) == len(order[e:e + per_epoch])


# -- resharding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("saved_by,resumed_by,include_frozen",
                         [(2, 1, False), (2, 3, False), (3, 2, True)],
                         ids=["2to1", "2to3", "3to2-with-frozen"])
def test_resume_at_another_world_size(worlds, tmp_path, saved_by, resumed_by, include_frozen):
    """Saved by N ranks, resumed by M: losses and parameters within fp32 tolerance of the
    uninterrupted run. With include_frozen the resumed model's frozen weights start wrong too."""
    full = worlds(2).run(train, Job(steps=20))
    first = worlds(saved_by).run(train, Job(steps=10, save_dir=str(tmp_path),
                                            include_frozen=include_frozen))
    ckpt = latest_checkpoint(tmp_path)
    assert read_manifest(ckpt)["world_size"] == saved_by
    second = worlds(resumed_by).run(train, Job(steps=20, resume=str(ckpt), init_seed=1,
                                               perturb_frozen=include_frozen))
    losses = first[0]["losses"] + second[0]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, full[0]["losses"]))
    print(f"{saved_by}->{resumed_by}: largest relative loss difference {rel:.2e}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full[0]["losses"]),
                               **RESHARD_LOSS_TOL)
    # The same samples at each step, now split over another number of ranks.
    for step in range(10):
        got = sorted(i for r in range(resumed_by) for i in second[r]["seen"][step])
        want = sorted(i for r in range(2) for i in full[r]["seen"][10 + step])
        assert got == want, f"step {11 + step}: other samples than the uninterrupted run"
    worst = max((second[0]["full"][k] - v).abs().max().item() for k, v in full[0]["full"].items())
    print(f"{saved_by}->{resumed_by}: largest parameter difference {worst:.2e}")
    assert_same_tensors(second[0]["full"], full[0]["full"], "parameters", **RESHARD_PARAM_TOL)


# -- corruption and mismatch ---------------------------------------------------------------------

# The checkpoint every corruption case starts from: fp16 (a loss-scaler state to restore), frozen
# shards included (frozen weights would be overwritten too), saved by 2 ranks after 4 steps.
GOOD_JOB = Job(steps=4, precision="fp16", include_frozen=True)


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory) -> dict[str, Path]:
    """A good checkpoint, and one of the same stack with other layer sizes."""
    root = tmp_path_factory.mktemp("good")
    other = tmp_path_factory.mktemp("other")
    worlds(2).run(train, dataclasses.replace(GOOD_JOB, save_dir=str(root)))
    worlds(2).run(train, dataclasses.replace(GOOD_JOB, save_dir=str(other), hidden=HIDDEN + 4))
    return {"good": latest_checkpoint(root), "other": latest_checkpoint(other)}


def try_load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Loads ``path`` into a fresh model whose every value differs from the checkpoint's;
    returns the error message and whether anything (shards, moments, RNG, loss scale, lr)
    changed."""
    job = dataclasses.replace(GOOD_JOB, init_seed=1, perturb_frozen=True)
    model, optimizer, scheduler, scaler, _ = build(job, rank, world_size)
    torch.manual_seed(5)

    def snapshot() -> tuple[Any, ...]:
        return (rank_state(model, optimizer), torch.get_rng_state(), scaler.state_dict(),
                [dict((k, v) for k, v in g.items() if k != "params")
                 for g in optimizer.param_groups])

    optimizer.param_groups[0]["lr"] = 0.123  # differs from the checkpoint's learning rate
    before = snapshot()
    message = None
    try:
        zerocore.load_checkpoint(path, model, optimizer, scaler=scaler)
    except CheckpointError as e:
        message = str(e)
    after = snapshot()
    unchanged = (before[0].keys() == after[0].keys()
                 and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
                 and torch.equal(before[1], after[1]) and before[2:] == after[2:])
    return {"message": message, "unchanged": unchanged}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def make_corrupt(case: str, saved: dict[str, Path], work: Path) -> tuple[Path, list[str]]:
    """A damaged copy of the good checkpoint, and what the error must mention."""
    good = saved["good"]
    if case == "truncated-rank-file":
        path = _copy(good, work / good.name)
        f = path / "rank-00001.pt"
        os.truncate(f, f.stat().st_size // 2)
        return path, [str(f), "truncated"]
    if case == "flipped-byte":
        path = _copy(good, work / good.name)
        f = path / "rank-00000.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
        return path, [str(f), "checksum mismatch", "corrupt"]
    if case == "manifest-of-another-model":
        path = _copy(good, work / good.name)
        for name in ("manifest.json", "COMMIT"):  # a whole, committed manifest
            shutil.copy(saved["other"] / name, path / name)
        return path, [str(path / "manifest.json"), "layer 0", "shape", "another model"]
    if case == "missing-rank-file":
        path = _copy(good, work / good.name)
        (path / "rank-00001.pt").unlink()
        return path, [str(path / "rank-00001.pt"), "missing"]
    if case == "manifest-missing-field":
        path = _copy(good, work / good.name)
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["files"]
        raw = json.dumps(manifest).encode()
        (path / "manifest.json").write_bytes(raw)
        (path / "COMMIT").write_bytes(commit_record(raw))  # as if committed so: the schema
        return path, [str(path / "manifest.json"), "files: missing"]   # check finds it
    if case == "missing-manifest":
        # What a killed save of the next step leaves beside the good checkpoint: its temporary
        # directory, rank files, no manifest.
        _copy(good, work / good.name)
        step = int(good.name[5:])
        path = _copy(good, work / f"step-{step + 1:08d}.tmp-0123abcd")
        (path / "manifest.json").unlink()
        return path, [str(path), "manifest.json", "incomplete"]
    raise AssertionError(case)


CORRUPTIONS = ["truncated-rank-file", "flipped-byte", "manifest-of-another-model",
               "missing-rank-file", "missing-manifest", "manifest-missing-field"]


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda n: f"load-at-ws{n}")
@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupt_checkpoint_is_refused(worlds, saved, tmp_path, case, world_size):
    path, expected = make_corrupt(case, saved, tmp_path)
    results = worlds(world_size).run(try_load, str(path))
    for r, res in enumerate(results):
        assert res["message"] is not None, f"rank {r} loaded a damaged checkpoint ({case})"
        for text in expected:
            assert text in res["message"], f"rank {r}: {text!r} not in {res['message']!r}"
        assert res["unchanged"], f"rank {r}: the failed load modified the model ({case})"
    assert len({res["message"] for res in results}) == 1, "every rank reports the same problem"
    if case == "missing-manifest":
        # A leftover temporary directory is never taken for a checkpoint.
        assert latest_checkpoint(tmp_path) == tmp_path / saved["good"].name
    # The good checkpoint itself loads (the test's damage, not the loader, made it fail).
    assert all(res["message"] is None for res in
               worlds(world_size).run(try_load, str(saved["good"])))


def save_with_bad_extra(rank: int, world_size: int, root: str) -> str | None:
    model, optimizer, _, _, _ = build(Job(steps=0), rank, world_size)
    try:
        zerocore.save_checkpoint(root, 1, model, optimizer, extra={"sampler": object()})
    except TypeError as e:
        return str(e)
    return None


def test_save_refuses_unserialisable_extra(worlds, tmp_path):
    """Raised on every rank before anything is written (not on rank 0 alone, after the others
    went on to wait in a collective)."""
    messages = worlds(2).run(save_with_bad_extra, str(tmp_path / "root"))
    assert all(m is not None and "JSON-serialisable" in m for m in messages), messages
    assert not (tmp_path / "root").exists()


# -- crash safety --------------------------------------------------------------------------------

CRASH_KEEP = 2


def crash_child(root: str, saves: int) -> None:
    """Runs in its own process: resumes from the latest checkpoint under ``root`` (checking that
    every value in it comes from one and the same save), then saves ``saves`` more (0: until
    killed). Save ``s`` holds masters and moments equal to ``s`` and frozen shards equal to -s."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    frozen = nn.Linear(1024, 1024)
    frozen.requires_grad_(False)
    # ~42 MB per checkpoint: a save takes long enough to be killed in each of its phases.
    model = zerocore.shard([nn.Linear(1024, 1024), frozen, nn.Linear(1024, 1024),
                            nn.Linear(1024, 1024)])
    optimizer = zerocore.optim.AdamW(model.trainable_shards(), lr=LR)
    step = 0
    ckpt = latest_checkpoint(root)
    if ckpt is not None:
        step = zerocore.load_checkpoint(ckpt, model, optimizer)["step"]
        assert ckpt.name == f"step-{step:08d}"
        for layer in model.layers:
            if layer.trainable is not None:
                shard = layer.trainable.shard
                for t in (shard, optimizer.state[shard]["exp_avg"],
                          optimizer.state[shard]["exp_avg_sq"]):
                    assert torch.all(t == step), f"{ckpt}: layer {layer.index} mixes saves"
            if layer.frozen is not None:
                assert torch.all(layer.frozen.shard == -step), f"{ckpt}: frozen mixes saves"
        print(f"resumed {step}", flush=True)
        # ... and training goes on from it.
        model(torch.randn(2, 1024)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for _ in range(saves) if saves else iter(int, 1):
        step += 1
        with torch.no_grad():
            for layer in model.layers:
                if layer.trainable is not None:
                    shard = layer.trainable.shard
                    for t in (shard, optimizer.state[shard]["exp_avg"],
                              optimizer.state[shard]["exp_avg_sq"]):
                        t.fill_(step)
                if layer.frozen is not None:
                    layer.frozen.shard.fill_(-step)
        start = time.perf_counter()
        zerocore.save_checkpoint(root, step, model, optimizer, extra={"step": step},
                                 keep_last=CRASH_KEEP, include_frozen=True)
        print(f"saved {step} {time.perf_counter() - start:.4f}", flush=True)
    # The model and optimizer hold the process group: released before it is destroyed, since
    # tearing gloo down under live objects at interpreter exit can abort the process
    # ("terminate called without an active exception"), failing a run that succeeded.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def _start_child(root: Path, saves: int) -> subprocess.Popen:
    # As a module (-m, from the repository root): it imports the tests.support package.
    return subprocess.Popen([sys.executable, "-m", "tests.checkpoints.test_checkpoint",
                             "crash-child", str(root), str(saves)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the saving process stopped or hung (exit code {proc.returncode}):"
                             f"\n{err[-3000:]}")
    return line.strip()


def _check_root(root: Path, max_kept: int) -> Path:
    """Every committed checkpoint is complete; returns the latest."""
    kept = list_checkpoints(root)
    assert 1 <= len(kept) <= max_kept, [p.name for p in kept]
    for path in kept:
        verify_files(path, read_manifest(path))
    latest = latest_checkpoint(root)
    assert latest == kept[-1]
    return latest


LEFTOVER = re.compile(r"\.(tmp|deleting)-")


# Where each round kills a save, after it created its temporary directory: at once; while its
# rank file is being written; once the rank file is complete (hashing, the manifest, the rename,
# the pruning); and at random moments of it.
KILL_POINTS = ["at-once", "rank-file-partial", "rank-file-complete", "random", "random"]


def _kill_point(point: str, tmp: Path, rank_bytes: int, elapsed: float, delay: float) -> bool:
    if point == "at-once":
        return True
    if point == "random":
        return elapsed >= delay
    if not tmp.exists():
        return True  # the save committed before the point was seen: kill during its pruning
    try:
        size = (tmp / "rank-00000.pt").stat().st_size
    except FileNotFoundError:
        return False
    return 0 < size < rank_bytes if point == "rank-file-partial" else size >= rank_bytes


def _landed(point: str, tmp: Path, rank_bytes: int) -> bool:
    """Whether a killed save stopped in the phase ``point`` names, judged from what it left
    (the process may run on for a moment between the decision to kill and the signal)."""
    if point == "random":
        return True
    if not tmp.exists():  # committed before the signal arrived
        return point == "rank-file-complete"
    rank_file = tmp / "rank-00000.pt"
    size = rank_file.stat().st_size if rank_file.exists() else 0
    if point == "at-once":
        return size < rank_bytes
    if point == "rank-file-partial":
        return 0 < size < rank_bytes
    return size >= rank_bytes


# Tries per kill point: on a loaded machine the save can outrun the signal now and then.
KILL_TRIES = 4


@pytest.mark.distributed  # a one-rank gloo process of its own, killed while it saves
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    rnd = random.Random(5)  # fixed: a failure names a reproducible kill delay
    landed = []
    for point in KILL_POINTS:
        for attempt in range(KILL_TRIES):
            before = latest_checkpoint(root)
            proc = _start_child(root, 0)
            try:
                line = _read_line(proc, 120)
                if before is not None:  # the previous round's latest checkpoint, whole, usable
                    assert line == f"resumed {int(before.name[5:])}", line
                    line = _read_line(proc, 60)
                duration = float(line.split()[2])
                committed = latest_checkpoint(root)
                rank_bytes = read_manifest(committed)["files"]["rank-00000.pt"]["bytes"]
                delay = rnd.uniform(0.0, duration)
                deadline = time.monotonic() + 60
                tmp = None
                while tmp is None and time.monotonic() < deadline:
                    # The next save's temporary directory (not a leftover of an earlier kill).
                    tmp = next((p for p in root.iterdir() if ".tmp-" in p.name
                                and int(p.name[5:13]) > int(committed.name[5:])), None)
                assert tmp is not None, "no save started"
                t0 = time.monotonic()
                while not _kill_point(point, tmp, rank_bytes, time.monotonic() - t0, delay):
                    assert time.monotonic() < deadline, f"{point}: never reached"
                    time.sleep(0.0002)
                elapsed = time.monotonic() - t0
            finally:
                proc.kill()
                proc.communicate()
            # Where the kill landed: the files of the unfinished save, or its commit.
            inside = ({p.name: p.stat().st_size for p in tmp.iterdir()} if tmp.exists()
                      else "committed")
            landed.append(f"{point} (try {attempt + 1}): {elapsed * 1e3:.0f} ms into a "
                          f"~{duration * 1e3:.0f} ms save: {inside}")
            _check_root(root, CRASH_KEEP + 1)  # killed between the commit and the pruning: K + 1
            if _landed(point, tmp, rank_bytes):
                break
        else:
            raise AssertionError(f"no kill landed in phase {point!r} in {KILL_TRIES} tries:\n  "
                                 + "\n  ".join(landed))
    print("kills landed:\n  " + "\n  ".join(landed))

    last = latest_checkpoint(root)
    proc = _start_child(root, 2)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[0] == f"resumed {int(last.name[5:])}"
    latest = _check_root(root, CRASH_KEEP)
    assert len(list_checkpoints(root)) == CRASH_KEEP  # exactly K, the newest
    assert latest.name == f"step-{int(last.name[5:]) + 2:08d}"
    assert not [p.name for p in root.iterdir() if LEFTOVER.search(p.name)], \
        "leftovers of killed saves are removed by the next save"


def test_keep_last(worlds, tmp_path):
    """Six saves with keep_last=3 keep exactly the last three."""
    world = worlds(2)
    for step in range(1, 7):
        world.run(train, Job(steps=step, resume=None if step == 1 else
                             str(latest_checkpoint(tmp_path)), save_dir=str(tmp_path)))
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000004", "step-00000005", "step-00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000004", "step-00000005", "step-00000006"]


# -- runs ----------------------------------------------------------------------------------------


def save_steps(rank: int, world_size: int, root: str, steps: list[int], run_id: str | None,
               keep_last: int) -> list[str | None]:
    """Saves each step (``extra`` names run and step); per step, the refusal's message or None.
    After each save, whether the checkpoint just written is still there is checked too."""
    model, optimizer, _, scaler, _ = build(Job(steps=0), rank, world_size)
    out = []
    for step in steps:
        try:
            path = zerocore.save_checkpoint(root, step, model, optimizer, scaler=scaler,
                                            extra={"run": run_id, "step": step},
                                            keep_last=keep_last, run_id=run_id)
        except CheckpointError as e:
            out.append(str(e))
            continue
        assert path in list_checkpoints(root), f"{path}: pruned by its own save"
        out.append(None)
    return out


def _steps(paths: list[Path]) -> list[int]:
    return [int(p.name[5:]) for p in paths]


def test_runs_are_kept_apart(worlds, tmp_path):
    """Two runs and an unnamed one in one root: each prunes only its own checkpoints, never the
    one it just wrote (before run ids, run a's saves were pruned at once: run b's steps are
    higher), a step of another run is never replaced, and the listings filter by run."""
    world = worlds(2)
    root = tmp_path / "checkpoints"
    assert world.run(save_steps, str(root), [10, 11], "b", 3) == [[None, None]] * 2
    assert world.run(save_steps, str(root), [1, 2, 3, 4], "a", 2) == [[None] * 4] * 2
    assert zerocore.checkpoint_runs(root) == {"a": [root / "step-00000003",
                                                    root / "step-00000004"],
                                              "b": [root / "step-00000010",
                                                    root / "step-00000011"]}
    assert _steps(list_checkpoints(root)) == [3, 4, 10, 11]
    assert _steps(list_checkpoints(root, run_id="a")) == [3, 4]
    assert latest_checkpoint(root) == root / "step-00000011"
    assert latest_checkpoint(root, run_id="a") == root / "step-00000004"
    assert latest_checkpoint(root, run_id="c") is None

    # Run a reaching a step of run b: refused on every rank, run b's checkpoint untouched.
    before = {p.name: p.read_bytes() for p in (root / "step-00000010").iterdir()}
    refused = world.run(save_steps, str(root), [10], "a", 2)
    assert refused[0] == refused[1] and refused[0][0] is not None
    assert str(root / "step-00000010") in refused[0][0] and "run 'b'" in refused[0][0]
    assert {p.name: p.read_bytes() for p in (root / "step-00000010").iterdir()} == before
    assert _steps(list_checkpoints(root, run_id="a")) == [3, 4]
    # The same run saving a step again replaces it.
    assert world.run(save_steps, str(root), [11], "b", 3) == [[None]] * 2
    assert read_manifest(root / "step-00000011")["run_id"] == "b"
    # A save without a run id is a run of its own (None): it prunes none of the others.
    assert world.run(save_steps, str(root), [20, 21], None, 1) == [[None, None]] * 2
    runs = zerocore.checkpoint_runs(root)
    assert {k: _steps(v) for k, v in runs.items()} == {"a": [3, 4], "b": [10, 11], None: [21]}
    assert "run_id" not in read_manifest(root / "step-00000021")
    assert not [p for p in root.iterdir() if LEFTOVER.search(p.name)]


# -- public entry points: run_agreed, iter_full_states --------------------------------------------


def _outcome(fn) -> tuple[str, ...]:
    """What ``fn()`` returned or raised, as picklable text."""
    try:
        return ("returned", repr(fn()))
    except zerocore.PeerError as e:
        return ("PeerError", str(e), repr(e.failures), str(e.first_rank), e.first_message)
    except Exception as e:  # noqa: BLE001  (what was raised is what is tested)
        return (type(e).__name__, str(e))


def agree_cases(rank: int, world_size: int) -> dict[str, tuple[str, ...]]:
    def fail_on(ranks: dict[int, Exception]):
        def fn():
            if rank in ranks:
                raise ranks[rank]
            return rank * 10
        return lambda: zerocore.run_agreed(fn)

    def rank0_loads():  # neox's pattern: rank 0 prepares alone, the others wait
        raise FileNotFoundError("no corpus at data.txt")

    cases = {
        "none-fails": fail_on({}),
        "rank-1-fails": fail_on({1: ValueError("bad value on 1")}),
        "every-rank-alike": fail_on({r: ValueError("the same") for r in range(world_size)}),
        "two-differently": fail_on({1: OSError(28, "disk full"), 2: KeyError("k")}),
        "rank-0-alone": lambda: zerocore.run_agreed(rank0_loads if rank == 0 else lambda: None),
        "rank-0-alone-works": lambda: zerocore.run_agreed(lambda: "data" if rank == 0 else None),
    }
    # Each case must leave the group usable: the next one's collectives still match.
    return {name: _outcome(fn) for name, fn in cases.items()}


def test_run_agreed(worlds):
    results = worlds(3).run(agree_cases)
    by_case = {case: [res[case] for res in results] for case in results[0]}
    assert by_case["none-fails"] == [("returned", "0"), ("returned", "10"), ("returned", "20")]

    got = by_case["rank-1-fails"]
    assert got[1] == ("ValueError", "bad value on 1")  # its own exception, unchanged
    for r in (0, 2):
        assert got[r][0] == "PeerError" and got[r][3:] == ("1", "bad value on 1")
        assert "rank(s) 1 failed" in got[r][1] and "bad value on 1" in got[r][1]
        assert got[r][2] == repr({1: "ValueError: bad value on 1"})

    got = by_case["every-rank-alike"]  # reported once: by the lowest rank
    assert got[0] == ("ValueError", "the same")
    assert all(g[0] == "PeerError" and "rank(s) 0, 1, 2 failed" in g[1] for g in got[1:])

    got = by_case["two-differently"]  # each distinct failure raised by its own rank
    assert got[1] == ("OSError", "[Errno 28] disk full") and got[2] == ("KeyError", "'k'")
    assert got[0][0] == "PeerError" and got[0][3:] == ("1", "[Errno 28] disk full")
    assert "rank(s) 1, 2 failed" in got[0][1]

    got = by_case["rank-0-alone"]
    assert got[0] == ("FileNotFoundError", "no corpus at data.txt")
    assert all(g[0] == "PeerError" and g[4] == "no corpus at data.txt" for g in got[1:])
    assert by_case["rank-0-alone-works"] == [("returned", "'data'"), ("returned", "None"),
                                             ("returned", "None")]


def full_states_everywhere(rank: int, world_size: int) -> dict[str, Any]:
    """iter_full_states of a bf16 model (trainable, frozen and mixed layers) against the
    unsharded layers it was built from; to_rank; trainable_only; the offload mirror's bytes."""
    torch.manual_seed(0)
    layers = make_layers(dropout=0.0)
    want = [{n: p.detach().clone() for n, p in layer.named_parameters()} for layer in layers]
    trainable = [{n for n, p in layer.named_parameters() if p.requires_grad} for layer in layers]
    model = zerocore.shard(layers, mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    out: dict[str, Any] = {"layers": [], "to_last": [], "trainable_only": []}
    for (i, state), ref, names in zip(model.iter_full_states(), want, trainable):
        assert i == len(out["layers"])
        # Trainable parameters come from the fp32 masters: bitwise the initial fp32 values;
        # frozen ones are stored in bf16: bitwise the initial values rounded to bf16.
        out["layers"].append(state.keys() == ref.keys() and all(
            torch.equal(t, ref[n] if n in names else ref[n].to(torch.bfloat16))
            and t.device.type == "cpu" for n, t in state.items()))
    last = world_size - 1
    out["to_last"] = [sorted(state) for _, state in model.iter_full_states(to_rank=last)]
    out["trainable_only"] = [sorted(state) for _, state in
                             model.iter_full_states(trainable_only=True)]
    out["trainable_names"] = [sorted(names) for names in trainable]
    out["all_names"] = [sorted(ref) for ref in want]
    try:
        next(model.iter_full_states(to_rank=world_size))
    except ValueError as e:
        out["bad_rank"] = str(e)
    offloaded = zerocore.shard(make_layers(dropout=0.0), offload=zerocore.Offload(optimizer=True),
                               mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    groups = [g for layer in offloaded.layers for g in layer.groups]
    out["mirrors"] = [g.mirror_bytes == (g.layout.shard_numel * 2 if g.trainable else 0)
                      for g in groups]
    out["no_mirrors"] = [g.mirror_bytes == 0 for layer in model.layers for g in layer.groups]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_iter_full_states(worlds, world_size):
    results = worlds(world_size).run(full_states_everywhere)
    for rank, res in enumerate(results):
        assert all(res["layers"]), f"rank {rank}: full states differ from the unsharded layers"
        # Only the receiving rank holds tensors; the others take part with empty dicts.
        assert res["to_last"] == (res["all_names"] if rank == world_size - 1
                                  else [[] for _ in res["all_names"]]), rank
        assert res["trainable_only"] == res["trainable_names"]
        assert "to_rank must be a rank of the group" in res["bad_rank"]
        assert all(res["mirrors"]) and all(res["no_mirrors"])


# -- consolidation -------------------------------------------------------------------------------

# An 8-block GPT-NeoX. Bias fine-tuning trains 8h numbers per block (qkv bias 3h, attention
# output bias h, MLP h->4h bias 4h) where the block's weights hold ~12h^2, so the trained
# fraction is ~0.67/h. At the tiny preset's h = 64 that is 0.88% of the model (measured), close
# enough to 1% that a toy model's safetensors header decides; at h = 128 it is 0.48%, and for
# Pythia-70m (h = 512) ~0.1%. h = 128 keeps the test about the claim (the output is
# proportional to what was trained), not about the header of a toy model.
NEOX_CONFIG = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=8, hidden_size=128,
                                  intermediate_size=512, vocab_size=512)


def train_neox_and_save(rank: int, world_size: int, roots: list[tuple[str, bool]]
                        ) -> dict[str, Any]:
    """Bias fine-tuning of NEOX_CONFIG for 2 steps, then one checkpoint per (root,
    include_frozen). Returns the unsharded model's initial weights, the trained full weights as
    the engine gathers them, and the trainable names."""
    layers = build_layers(NEOX_CONFIG, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(layers):
        prepare_layer(layer, i, FinetuneMode("biases"))
    base = {f"layers.{i}.{n}": p.detach().clone() for i, layer in enumerate(layers)
            for n, p in layer.named_parameters()}
    trainable = sorted(f"layers.{i}.{n}" for i, layer in enumerate(layers)
                       for n, p in layer.named_parameters() if p.requires_grad)
    model = zerocore.shard(layers)
    optimizer = zerocore.optim.AdamW(model.trainable_shards(), lr=LR)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, NEOX_CONFIG.vocab_size, (2, 9), generator=g)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for root, include_frozen in roots:
        zerocore.save_checkpoint(root, 2, model, optimizer, include_frozen=include_frozen)
    return {"base": base, "trained": full_params(model), "trainable": trainable}


def _consolidate(capsys, *args) -> tuple[int, str, str]:
    """``python -m zerocore.consolidate ARGS`` in this process: (exit code, stdout, stderr)."""
    code = consolidate.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _read_safetensors_dir(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / name))
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


def test_consolidate(worlds, tmp_path, capsys):
    with_frozen, without = tmp_path / "with-frozen", tmp_path / "without-frozen"
    # Three ranks: uneven padding, and parameters that straddle rank boundaries.
    ref = worlds(3).run(train_neox_and_save, [(str(with_frozen), True), (str(without), False)])[0]
    ckpt, ckpt_no_frozen = latest_checkpoint(with_frozen), latest_checkpoint(without)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    res = {
        "full": _consolidate(capsys, ckpt, out / "full"),
        "trainable": _consolidate(capsys, ckpt, out / "trainable", "--trainable-only"),
        "trainable-no-frozen": _consolidate(capsys, ckpt_no_frozen, out / "tr2",
                                            "--trainable-only"),
        "full-no-frozen": _consolidate(capsys, ckpt_no_frozen, out / "refused"),
        "existing-out": _consolidate(capsys, ckpt, existing),
    }
    for k in ("full", "trainable", "trainable-no-frozen"):
        assert res[k][0] == 0, f"{k}: {res[k][2][-3000:]}"

    full = _read_safetensors_dir(out / "full")
    assert sorted(full) == sorted(ref["base"])  # every parameter, named layers.<i>.<name>
    for name, t in full.items():
        # Trained parameters as the engine gathers them; frozen ones exactly the unsharded
        # model's weights.
        assert torch.equal(t, ref["trained"][name]), name
        if name not in ref["trainable"]:
            assert torch.equal(t, ref["base"][name]), name
    assert any(not torch.equal(full[n], ref["base"][n]) for n in ref["trainable"])

    trained = load_file(out / "trainable" / "trainable.safetensors")
    assert sorted(trained) == ref["trainable"]
    assert all(torch.equal(t, full[n]) for n, t in trained.items())
    trained_too = load_file(out / "tr2" / "trainable.safetensors")
    assert trained_too.keys() == trained.keys()
    assert all(torch.equal(t, trained[n]) for n, t in trained_too.items())
    full_bytes = sum(f.stat().st_size for f in (out / "full").iterdir())
    small = (out / "trainable" / "trainable.safetensors").stat().st_size
    print(f"trainable-only {small:,} bytes, full {full_bytes:,} bytes: {small / full_bytes:.2%}")
    assert small < 0.01 * full_bytes

    code, _, err = res["full-no-frozen"]
    assert code != 0 and "no frozen weights" in err and "--trainable-only" in err, err
    assert not (out / "refused").exists()
    code, _, err = res["existing-out"]
    assert code != 0 and f"{existing} exists" in err, err
    assert sorted(os.listdir(existing)) == ["keep.txt"]
    assert (existing / "keep.txt").read_text() == "mine"
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# -- the CLI: python -m neox.finetune --resume --------------------------------------------------

GLOBAL_SEQS = 4  # sequences per step over all ranks: --batch-size is GLOBAL_SEQS / --nproc


def _finetune(tmp: Path, out: Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        rnd = random.Random(0)
        words = ("to be or not that is the question whether tis nobler in mind suffer slings and "
                 "arrows of outrageous fortune take arms against a sea troubles").split()
        corpus.write_text("\n".join(" ".join(rnd.choice(words) for _ in range(12))
                                    for _ in range(400)))
    cmd = [sys.executable, "-m", "neox.finetune", "--cpu", "--model", "tiny",
           "--data", str(corpus), "--cache-dir", str(tmp / "cache"), "--seq-len", "16",
           "--batch-size", str(GLOBAL_SEQS // nproc), "--nproc", str(nproc), "--lr", str(CLI_LR),
           "--seed", "3", "--max-steps", "6", "--output-dir", str(out), *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(*procs: subprocess.Popen) -> None:
    """Waits for every run (stopping the others if one fails or hangs); each must succeed."""
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out[-4000:]
    finally:
        for proc in procs:
            proc.kill()


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.e2e
def test_cli_resume(tmp_path):
    """6 steps in one run, saving at 3, against resuming that step-3 checkpoint: the same losses
    for steps 4..6, bitwise with the same --nproc, and within fp32 tolerance with another."""
    whole = tmp_path / "whole"
    _finish(_finetune(tmp_path, whole, "--save-every", "3"))
    assert [p.name for p in list_checkpoints(whole / "checkpoints")] == [
        "step-00000003", "step-00000006"]
    # The state an interrupted run would have left: its checkpoints folder, latest at step 3.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(whole / "checkpoints" / "step-00000003",
                    interrupted / "checkpoints" / "step-00000003")
    same = _finetune(tmp_path, interrupted, "--resume", str(interrupted / "checkpoints"))
    other = _finetune(tmp_path, tmp_path / "one-rank", "--resume",
                      str(interrupted / "checkpoints" / "step-00000003"), nproc=1)
    _finish(same, other)

    want = _losses(whole)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    got = _losses(interrupted)
    assert got == {s: want[s] for s in (4, 5, 6)}  # bitwise: float -> JSON -> float is exact
    a, b = load_file(whole / "trainable.safetensors"), load_file(interrupted /
                                                                 "trainable.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    one = _losses(tmp_path / "one-rank")
    assert sorted(one) == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([one[s] for s in (4, 5, 6)]),
                               torch.tensor([want[s] for s in (4, 5, 6)]), **RESHARD_LOSS_TOL)
    c = load_file(tmp_path / "one-rank" / "trainable.safetensors")
    print("--nproc 1 resume: largest relative loss difference "
          f"{max(abs(one[s] - want[s]) / abs(want[s]) for s in (4, 5, 6)):.2e}, parameter "
          f"difference {max((c[k] - a[k]).abs().max().item() for k in a):.2e}")
    for k in a:
        torch.testing.assert_close(c[k], a[k], **CLI_PARAM_TOL)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "crash-child":
    crash_child(sys.argv[2], int(sys.argv[3]))
