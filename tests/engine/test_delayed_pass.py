"""The one-step-delayed optimizer pass (``Offload(overlap="delayed")``, docs/decisions.md, "The
one-step-delayed optimizer pass"): step t's update runs on the host worker beside step t+1's
whole forward and backward, which gather the weights published by step t's ``step()``, the
state from before update t. So the gradients of step t+1 are computed on W_{t-1} and applied
on top of W_t; steps 1 and 2 both compute with W_0; an overflow-skipped step publishes nothing;
a load (a resume) publishes what it loaded, and the delay starts again from there.

The reference is zerocore's synchronous pass (``overlap="off"``), which the offload tests hold
against torch's AdamW, driven by hand with the stale weights: before each forward the test
writes the weights the delayed rule says that forward sees into the masters (the engine's load
path, ``set_master``), and puts the true masters back before the step. It uses nothing of the
delayed mode (no published copy, no worker). Delayed training equals it bit for bit, at world
sizes 1-3, through both front doors, in fp32 with accumulation and clipping, bf16 with
clipping, and fp16 with a dynamic scale and an overflow on one rank, on host-memory and NVMe
homes, with the parameters on the device or on the host, and with a worker that lags behind
the forward. Each test also holds the delayed run apart from the exact one, so that with the
delay switched off (the gathers reading the model copy) it fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

import zerocore
from zerocore.engine.sharded_param import master_values, set_master
from zerocore.engine.sharding import pass_line
from tests.support.dist_utils import inject_overflow
from tests.support.hybrid_runs import mesh_of
from tests.support.offload_stack import (BATCH, DOORS, SEQ, Case, layer_stack, measured_peaks,
                                         pass_cases, pass_offload, stack_loss)
from tests.support.offload_stack import build as build_stack
from tests.support.toy_stack import (LR, WEIGHT_DECAY, global_batch, loss_fn,
                                     model_input)

WORLD_SIZES = [1, 2, 3]
# The lagging worker's sleep before each layer: longer than a toy layer's forward on a loaded
# CPU, so that the pass is still running while the next forward and backward run.
LAG_S = 0.05
# fp16 with a dynamic loss scale: a moderate start keeps these toy models' scaled gradients far
# from fp16's 65504, so that the only overflow is the injected one.
FP16_SCALE = 2.0**10
# How long the gated worker waits to be let go before it goes on by itself: far longer than a
# toy step, so that a forward or backward that waited for it shows as a pass no longer held.
GATE_S = 20.0


CASES = pass_cases(steps=4)
# The homes each case runs on (all four over the three cases).
LABELS = {"mlp-fp32-micro2-clip": ["cpu", "nvme+params"],
          "transformer-bf16-clip": ["cpu+params", "nvme"],
          "mlp-fp16-overflow": ["cpu", "nvme"]}


def lagging(index: int) -> None:
    """``pass_hook``: a worker slower than the forward."""
    time.sleep(LAG_S)


class Run:
    """One rank's training: the model, its sharding, optimizer and scaler, and (``stale``)
    whether the forward's weights are swapped in by hand (the reference)."""

    def __init__(self, door: str, case: Case, offload: zerocore.Offload, stale: bool,
                 hook=None, policies: dict | None = None):
        self.case = case
        self.model, self.sharding = build_stack(door, case.spec, policies or {}, offload)
        self.opt = zerocore.optim.AdamW(self.sharding.trainable_shards(), lr=LR,
                                        weight_decay=WEIGHT_DECAY, pass_hook=hook)
        fp16 = case.spec.param_dtype == torch.float16
        self.scaler = zerocore.LossScaler(self.sharding.group, dynamic=fp16,
                                          policy=zerocore.LossScaling(init_scale=FP16_SCALE))
        # The reference's weights for the next forward: those of the last step that ran,
        # taken before it stepped (the initial ones until then).
        self.seen = self.masters() if stale else None

    def masters(self) -> list[torch.Tensor]:
        return [master_values(s).clone() for s in self.sharding.trainable_shards()]

    def write(self, values: list[torch.Tensor]) -> None:
        for shard, v in zip(self.sharding.trainable_shards(), values):
            set_master(shard, v)

    def step(self, step: int, rank: int, world_size: int, h: "hashlib._Hash") -> None:
        """Forward and backward of each micro-batch (losses hashed exactly), the gradient
        shards hashed, the step through the scaler (norm and skip hashed), gradients dropped.
        The reference computes with ``seen`` and steps from the true masters."""
        spec, sharding = self.case.spec, self.sharding
        if self.seen is not None:
            true = self.masters()
            self.write(self.seen)
        for m in range(spec.micro):
            x, y = global_batch(spec, step, m, world_size)
            xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            loss = loss_fn(spec, self.model(model_input(spec, xr)), yr) / spec.micro
            self.scaler.scale(loss).backward()
            h.update(struct.pack("<d", loss.item()))
        if step in self.case.overflow_steps and rank == world_size - 1:
            inject_overflow(sharding.layers[:1], sharding.rank)
        for shard in sharding.trainable_shards():
            h.update(shard.grad.numpy().tobytes())
        if self.seen is not None:
            self.write(true)
        result = self.scaler.step(self.opt, max_norm=spec.max_norm)
        h.update(struct.pack("<d?", result.grad_norm, result.skipped))
        if self.seen is not None and not result.skipped:
            self.seen = true   # the next forward sees the state this step started from
        self.opt.zero_grad()

    def digest(self, h: "hashlib._Hash") -> str:
        """The state: every parameter gathered (trainable ones from the fp32 masters), this
        rank's moments and step counts."""
        for i, state in self.sharding.iter_full_states():
            for name, t in sorted(state.items()):
                h.update(f"{i}.{name}".encode())
                h.update(t.float().numpy().tobytes())
        for shard in self.sharding.trainable_shards():
            for key in ("exp_avg", "exp_avg_sq"):
                t = (shard.nvme.read(key) if shard.nvme is not None
                     else self.opt.state[shard][key])
                h.update(t.numpy().tobytes())
            h.update(struct.pack("<d", float(self.opt.state[shard]["step"])))
        return h.hexdigest()


def mode(overlap: str) -> tuple[str, bool]:
    """A run's offload overlap and whether its forward's weights are swapped by hand: the
    reference is ``"stale"``, the synchronous pass with the delayed rule applied by the test."""
    return ("off", True) if overlap == "stale" else (overlap, False)


def train(rank: int, world_size: int, door: str, name: str, label: str, path: str,
          overlap: str, lag: bool, layout: str = "flat") -> str:
    offload, stale = mode(overlap)
    policies = {}
    if layout != "flat":  # 2 x 2: two replicas (HSDP) or two nodes (hpZ) of two ranks
        policies["mesh"] = mesh_of((2, 2))
        if layout == "hpz":
            policies["hybrid"] = zerocore.Hybrid("hpz")
    run = Run(door, CASES[name], pass_offload(label, path, offload), stale,
              lagging if lag else None, policies)
    h = hashlib.sha256()
    for step in range(run.case.spec.steps):
        run.step(step, rank, world_size, h)
    return run.digest(h)


# The base case (fp32, its homes host memory with the parameters on the device and NVMe with
# them on the host: both optimizer homes, both parameter homes) through both doors at 1, 2 and
# 3 ranks; bf16 and fp16 (its overflow on the last rank, agreed) through both doors at 3 only:
# their paths do not depend on the count, which the base case covers at 1, 2 and 3 (CI time).
BASE = "mlp-fp32-micro2-clip"
PAIRS = [pytest.param(size, name, door, id=f"ws{size}-{name}-{door}")
         for name in sorted(CASES) for door in DOORS
         for size in (WORLD_SIZES if name == BASE else [3])]


@pytest.mark.parametrize("size,name,door", PAIRS)
def test_delayed_pass_trains_as_the_stale_reference(worlds, tmp_path, size, name, door):
    """Losses, gradient shards, norms, skips, final weights and moments: the same bits as the
    synchronous pass driven with the stale weights by hand, also with a lagging worker; and
    not those of the exact pass (else the delay was not applied)."""
    world = worlds(size)
    for label in LABELS[name]:
        runs = {}
        for overlap, lag in (("stale", False), ("delayed", False), ("delayed", True),
                             ("exact", False)):
            scratch = tmp_path / f"{label}-{overlap}-{lag}"
            scratch.mkdir()
            runs[overlap, lag] = world.run(train, door, name, label, str(scratch), overlap,
                                           lag)
        assert runs["delayed", False] == runs["stale", False], (label, runs)
        assert runs["delayed", True] == runs["stale", False], (label, runs)
        assert runs["delayed", False] != runs["exact", False], (label, runs)


@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
def test_delayed_pass_across_replicas_and_nodes_trains_as_the_stale_reference(worlds, tmp_path,
                                                                               layout):
    """The same on a 2 x 2 mesh of four gloo ranks: HSDP's replicas each step their own shard
    (the same values), hpZ's nodes too; the delay is applied alike on every replica. fp32, two
    micro-batches and clipping, the optimizer in host memory and on NVMe (each node's ranks
    with scratches of their own)."""
    world = worlds(4)
    name = "mlp-fp32-micro2-clip"
    for label in ("cpu", "nvme"):
        runs = {}
        for overlap in ("stale", "delayed", "exact"):
            scratch = tmp_path / f"{layout}-{label}-{overlap}"
            scratch.mkdir()
            runs[overlap] = world.run(train, "shard", name, label, str(scratch), overlap,
                                      False, layout)
        assert runs["delayed"] == runs["stale"], (label, runs)
        assert runs["delayed"] != runs["exact"], (label, runs)


def first_steps(rank: int, world_size: int, label: str, path: str, overlap: str) -> list:
    """Two steps on the same batch: the two losses, exactly."""
    case = CASES["transformer-bf16-clip"]
    run = Run("shard", case, pass_offload(label, path, overlap), stale=False)
    losses = []
    for _ in range(2):
        x, y = global_batch(case.spec, 0, 0, world_size)
        loss = loss_fn(case.spec, run.model(x.chunk(world_size)[rank]),
                       y.chunk(world_size)[rank])
        loss.backward()
        losses.append(loss.item())
        run.scaler.step(run.opt, max_norm=case.spec.max_norm)
        run.opt.zero_grad()
    return losses


@pytest.mark.parametrize("label", ["cpu", "nvme"])
def test_the_first_two_steps_compute_with_the_initial_weights(world, tmp_path, label):
    """Nothing to delay at the first step: step 2's forward sees W_0 as step 1's did (the same
    batch, the same loss), where the exact pass's step 2 sees W_1."""
    got = {}
    for overlap in ("delayed", "exact"):
        (tmp_path / overlap).mkdir()
        got[overlap] = world.run(first_steps, label, str(tmp_path / overlap), overlap)
    assert all(a == b for a, b in got["delayed"]), got
    assert all(a != b for a, b in got["exact"]), got


# The resume: SAVED steps, a checkpoint, then the rest of the case's steps.
SAVED = 2


def resumed(rank: int, world_size: int, label: str, path: str, ckpt: str,
            overlap: str) -> dict:
    """``SAVED`` steps and a checkpoint (the delayed run's saved at once, its pass in flight),
    then on in the same process (uninterrupted); then a fresh model and optimizer loaded from
    the checkpoint and trained the same remaining steps (resumed)."""
    case = CASES["transformer-bf16-clip"]
    offload, stale = mode(overlap)
    out = {}
    run = Run("shard", case, pass_offload(label, str(Path(path) / "a"), offload), stale,
              lagging if overlap == "delayed" else None)
    h = hashlib.sha256()
    for step in range(SAVED):
        run.step(step, rank, world_size, h)
    out["in_flight"] = run.opt.pass_in_flight
    saved = zerocore.save_checkpoint(ckpt, SAVED, run.model, run.opt, scaler=run.scaler)
    for step in range(SAVED, case.spec.steps):
        run.step(step, rank, world_size, h)
    out["uninterrupted"] = run.digest(h)
    again = Run("shard", case, pass_offload(label, str(Path(path) / "b"), offload), False)
    zerocore.load_checkpoint(saved, again.model, again.opt, scaler=again.scaler)
    if stale:
        again.seen = again.masters()   # the delay restarts: the loaded weights first
    h = hashlib.sha256()
    for step in range(SAVED, case.spec.steps):
        again.step(step, rank, world_size, h)
    out["resumed"] = again.digest(h)
    return out


# Host memory at 1, 2 and 3 ranks; NVMe at 3 only: its save and load are each rank's own
# scratch, a path that does not depend on the count, which host memory covers (CI time).
@pytest.mark.parametrize("size,label", [pytest.param(size, label, id=f"ws{size}-{label}")
                                        for label in ("cpu", "nvme")
                                        for size in (WORLD_SIZES if label == "cpu" else [3])])
def test_a_resume_restarts_the_delay(worlds, tmp_path, size, label):
    """A checkpoint settles the pass and saves the state (the published copy is not saved);
    a run resumed from it computes its first two steps with the loaded weights, as at a first
    step: it equals the reference resumed the same way, and the uninterrupted run (saving
    changed nothing of it) equals the uninterrupted reference."""
    world = worlds(size)
    got = {}
    for overlap in ("stale", "delayed"):
        for scratch in ("a", "b"):   # (the uninterrupted run's and the resumed run's)
            (tmp_path / overlap / scratch).mkdir(parents=True)
        got[overlap] = world.run(resumed, label, str(tmp_path / overlap),
                                 str(tmp_path / overlap / "ckpt"), overlap)
    assert all(g["in_flight"] for g in got["delayed"]), got  # (else the save settled nothing)
    for key in ("uninterrupted", "resumed"):
        assert [g[key] for g in got["delayed"]] == [g[key] for g in got["stale"]], (key, got)


def gated(rank: int, world_size: int, label: str, path: str) -> dict:
    """A step whose pass is held at its first layer (``pass_hook`` waiting on a gate), then
    the next step's forward and backward: whether that pass was still held when the backward
    ended, i.e. neither the forward nor the backward waited for any layer's update."""
    gate, timed_out = threading.Event(), []

    def hook(index: int) -> None:
        if not gate.wait(GATE_S):
            timed_out.append(index)
    case = CASES["transformer-bf16-clip"]
    run = Run("shard", case, pass_offload(label, path, "delayed"), stale=False, hook=hook)
    spec = case.spec

    def forward_backward(step: int) -> None:
        x, y = global_batch(spec, step, 0, world_size)
        loss_fn(spec, run.model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    forward_backward(0)
    run.scaler.step(run.opt, max_norm=spec.max_norm)   # (its pass waits at the gate)
    run.opt.zero_grad()
    forward_backward(1)
    held = run.opt.pass_in_flight and not timed_out
    gate.set()
    run.scaler.step(run.opt, max_norm=spec.max_norm)
    run.opt.settle()
    return {"held": held, "timed_out": timed_out}


@pytest.mark.parametrize("label", ["cpu", "cpu+params", "nvme"])
def test_the_forward_and_backward_never_wait_for_the_delayed_pass(world, tmp_path, label):
    got = world.run(gated, label, str(tmp_path))
    assert all(g["held"] and not g["timed_out"] for g in got), got


def test_delayed_is_checked():
    with pytest.raises(ValueError, match="delays the offloaded optimizer's update"):
        zerocore.Offload(overlap="delayed")
    with pytest.raises(ValueError, match="params='nvme'.*give params='cpu'"):
        zerocore.Offload(optimizer="nvme", params="nvme", path=".", overlap="delayed")
    offload = zerocore.Offload(optimizer="cpu", overlap="delayed")
    assert offload.overlaps and offload.delayed
    assert not zerocore.Offload(optimizer="cpu").delayed
    # The start-up line says so.
    assert "one step delayed (Offload.overlap 'delayed')" in pass_line(offload)
    assert "(Offload.overlap 'exact')" in pass_line(zerocore.Offload(optimizer="cpu"))


def stack_offload(label: str, path: str) -> zerocore.Offload:
    return {"cpu": zerocore.Offload(optimizer="cpu", overlap="delayed"),
            "nvme": zerocore.Offload(optimizer="nvme", path=path, pool_bytes=1 << 20,
                                     overlap="delayed")}[label]


def measure_stack(rank: int, world_size: int, label: str, path: str) -> int:
    """The step's peak (tests/support/offload_stack.py: the smallest of three)."""
    peaks, _ = measured_peaks(
        lambda: zerocore.shard(layer_stack(), offload=stack_offload(label, path),
                               mixed_precision=zerocore.MixedPrecision(torch.bfloat16)))
    return min(peaks)


# 2%: tests/engine/test_plan.py's bound for a stack (the plan is the engine's own step on fake
# tensors).
PLAN_TOL = 0.02


@pytest.mark.parametrize("label", ["cpu", "nvme"])
def test_the_plan_counts_the_published_copy(worlds, tmp_path, label):
    """The published copies (a second bf16 copy of the trainable shards) are in the plan's
    model state and peak, and the peak is the measured one: step t's gradients, held by the
    pass beside step t+1's, are let go of layer by layer as the new ones arrive."""
    delayed = zerocore.plan.plan(layer_stack("meta"),
                                 torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                                 world_size=2, loss=stack_loss, device="cpu",
                                 offload=stack_offload(label, str(tmp_path)),
                                 mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    exact = zerocore.plan.plan(layer_stack("meta"),
                               torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                               world_size=2, loss=stack_loss, device="cpu",
                               offload=dataclasses.replace(stack_offload(label, str(tmp_path)),
                                                           overlap="exact"),
                               mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    assert delayed.state.trainable_params == 2 * exact.state.trainable_params > 0
    got = min(worlds(2).run(measure_stack, label, str(tmp_path)))
    assert abs(delayed.device_peak / got - 1) < PLAN_TOL, (delayed.device_peak, got,
                                                           delayed.table())
