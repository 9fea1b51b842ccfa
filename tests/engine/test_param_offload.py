"""Parameter offload (``zerocore.Offload(params=True)``, alone and with ``optimizer=True``): the
parameter shards live in host memory (the host arena) and the device holds a layer's shard only
for the window of its all-gather.

On the CPU the device is a stand-in: each window is a buffer of its own, copied from the host
shard when its gather starts and dropped once the gather is waited for, so what is "on the
device" can be counted (each group's ``window_bytes``, ``memory_report().device_shard_bytes``).
The copies change where values are, never the values: training is bitwise the same as without
offload, through both front doors, at world sizes 1-3. (The CUDA branches, on stand-in streams:
tests/engine/test_offload.py.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest
import torch
from torch import nn

import zerocore
from zerocore.plan import FROZEN, TRAINABLE
from tests.support.offload_stack import (BATCH, DOORS, SEQ, layer_stack, measured_peaks,
                                         stack_loss)
from tests.support.offload_stack import build as build_stack
from tests.support.toy_stack import (LR, WEIGHT_DECAY, Spec, digest_step, global_batch, loss_fn,
                                     model_input)

WORLD_SIZES = [1, 2, 3]
# Every offload combination; "none" is the reference each is compared with.
OFFLOADS = {"none": zerocore.Offload(), "optimizer": zerocore.Offload(optimizer=True),
            "params": zerocore.Offload(params=True),
            "all": zerocore.Offload(params=True, optimizer=True)}


@dataclasses.dataclass(frozen=True)
class Case:
    spec: Spec
    policies: dict = dataclasses.field(default_factory=dict)


# fp32 with accumulation and clipping (gradients accumulate in place, on the device or the host;
# the clip reads them all); bf16 with a frozen embedding (a frozen first layer, windows of bf16
# copies; with the optimizer on the device, rounded from the masters); bf16 recomputation (the
# backward's gather uploads again before the forward runs again); int8 frozen weights (windows of
# int8 values and scales); a keep-gathered budget (some layers' trainable groups stay gathered
# from forward to backward, their frozen groups resident from step to step: no window after the
# first gather).
CASES = {
    "mlp-fp32-micro2-clip": Case(Spec(model="mlp", steps=3, micro=2, max_norm=0.05)),
    "transformer-bf16-frozen-embedding": Case(Spec(model="transformer", steps=3,
                                                   train="no_embedding",
                                                   param_dtype=torch.bfloat16)),
    "transformer-bf16-recompute": Case(Spec(model="transformer", steps=3,
                                            param_dtype=torch.bfloat16),
                                       {"recompute": zerocore.Recompute()}),
    "transformer-int8-biases": Case(Spec(model="transformer", steps=3, train="biases",
                                         param_dtype=torch.bfloat16),
                                    {"frozen_weights": zerocore.FrozenWeights("int8")}),
    # NF4 and fp8 frozen weights: windows of their codes and scales, as int8's.
    "transformer-nf4-biases": Case(Spec(model="transformer", steps=3, train="biases",
                                        param_dtype=torch.bfloat16),
                                   {"frozen_weights": zerocore.FrozenWeights("nf4")}),
    "transformer-fp8-biases": Case(Spec(model="transformer", steps=3, train="biases"),
                                   {"frozen_weights": zerocore.FrozenWeights("fp8")}),
    # 40 kB keeps some layers and not others (the blocks are about 33 kB gathered in fp32, the
    # embedding and readout about 8 kB each: tests/engine/test_front_doors.py).
    "transformer-keep-gathered-budget": Case(Spec(model="transformer", steps=3, train="biases"),
                                             {"prefetch": zerocore.Prefetch(
                                                 keep_gathered=40_000)}),
}


def build(door: str, case: Case, offload: zerocore.Offload):
    """(the callable model, its sharding) (tests/support/offload_stack.py)."""
    return build_stack(door, case.spec, case.policies, offload)


def groups(sharding) -> list:
    return [g for layer in sharding.layers for g in layer.groups]


def windows_now(sharding) -> int:
    return sum(g.window_bytes for g in groups(sharding))


def windowed(g, sharding, offload: zerocore.Offload) -> bool:
    """Whether parameter offload gathers the group through windows: every frozen group, and
    every trainable one but the optimizer's own fp32 master on the device."""
    fp32 = sharding.mixed_precision.param_dtype == torch.float32
    return offload.params and (not g.trainable or offload.optimizer or not fp32)


def window_of_one_layer(sharding, offload: zerocore.Offload) -> int:
    """The most bytes one layer's windows take: its gathers' inputs (the param dtype's, or int8
    values and scales)."""
    p_bytes = sharding.mixed_precision.param_dtype.itemsize
    return max(sum(g.layout.shard_numel * p_bytes if g.trainable
                   else g.shard.numel() * g.shard.element_size()
                   for g in layer.groups if windowed(g, sharding, offload))
               for layer in sharding.layers)


def staying_on_device(sharding, offload: zerocore.Offload) -> int:
    """What may stay on the device between steps with parameter offload: nothing, except the
    optimizer's own fp32 master when it is on the device and is what the layers compute with
    (fp32)."""
    if offload.optimizer or sharding.mixed_precision.param_dtype != torch.float32:
        return 0
    return sum(g.layout.shard_numel * 4 for g in groups(sharding) if g.trainable)


def train(rank: int, world_size: int, door: str, name: str, label: str) -> dict:
    """Trains the case with one offload; a digest of every loss, every gradient shard before
    every step, the gradient norms and the final parameters (frozen ones too), and what stayed
    on the device: windows seen at every tensor saved or unpacked for backward (forward and
    backward), and after every backward and every step."""
    case, offload = CASES[name], OFFLOADS[label]
    spec = case.spec
    model, sharding = build(door, case, offload)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = zerocore.LossScaler(sharding.group, dynamic=False)
    seen: list[int] = []

    def observed(t: torch.Tensor) -> torch.Tensor:
        seen.append(windows_now(sharding))
        return t

    h = hashlib.sha256()
    after_backward, after_step, left_gathered = [], [], []
    for step in range(spec.steps):
        for m in range(spec.micro):
            x, y = global_batch(spec, step, m, world_size)
            xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            with torch.autograd.graph.saved_tensors_hooks(observed, observed):
                loss = loss_fn(spec, model(model_input(spec, xr)), yr) / spec.micro
                loss.backward()
            h.update(struct.pack("<d", loss.item()))
            after_backward.append(sharding.memory_report().device_shard_bytes)
            # Nothing of a layer stays gathered after its backward, but a resident frozen group
            # (the keep-gathered budget's).
            left_gathered += [g.gathered_bytes for g in groups(sharding)
                              if g.trainable or not g.resident]
        digest_step(h, sharding, opt, scaler, spec)
        after_step.append(sharding.memory_report().device_shard_bytes)
    for index, state in sharding.iter_full_states():
        for n, t in sorted(state.items()):
            h.update(f"{index}.{n}".encode())
            h.update(t.float().numpy().tobytes())
    arena = sharding.ctx.arena
    on_host = [g.shard for g in groups(sharding) if offload.params and not g.trainable]
    on_host += [g.shard for g in groups(sharding) if offload.optimizer and g.trainable]
    base = arena._bytes.data_ptr() if arena is not None else 0
    in_arena = [arena is not None and base <= s.data_ptr() < base + arena.used for s in on_host]
    return dict(digest=h.hexdigest(), after_backward=after_backward, after_step=after_step,
                left_gathered=left_gathered, windows_max=max(seen), windows_seen=sum(seen),
                one_layer=window_of_one_layer(sharding, offload),
                staying=staying_on_device(sharding, offload), in_arena=in_arena,
                prefetched=len(sharding.runtime.units) > 2)


def train_every_offload(rank: int, world_size: int, door: str, name: str) -> dict:
    return {label: train(rank, world_size, door, name, label) for label in OFFLOADS}


# The base case (fp32 with accumulation and clipping) through both doors at 1, 2 and 3 ranks;
# the other cases through both doors at 3 only: their paths (dtypes, frozen and quantized
# windows, recomputation, the budget) do not depend on the count, which the base case covers
# at 1, 2 and 3 (CI time).
BASE = "mlp-fp32-micro2-clip"


@pytest.mark.parametrize("size,name,door", [
    pytest.param(size, name, door, id=f"ws{size}-{name}-{door}")
    for name in sorted(CASES) for door in DOORS
    for size in (WORLD_SIZES if name == BASE else [3])])
def test_every_offload_trains_bitwise_as_without_and_leaves_only_the_window(worlds, size, name,
                                                                            door):
    for r in worlds(size).run(train_every_offload, door, name):
        plain = r["none"]["digest"]
        for label in ("optimizer", "params", "all"):
            got = r[label]
            assert got["digest"] == plain, label
            assert all(got["in_arena"]), (label, got["in_arena"])
        for label in ("params", "all"):
            got = r[label]
            # After every backward and every step no shard bytes are on the device (but the
            # optimizer's fp32 master, when the optimizer is there and computes in fp32).
            assert set(got["after_backward"]) == {got["staying"]}, (label, got)
            assert set(got["after_step"]) == {got["staying"]}, (label, got)
            assert set(got["left_gathered"]) == {0}, (label, got["left_gathered"])
            # During the step the windows come and go: one layer's at most (the one whose
            # gather is in flight while another layer computes). Some are seen whenever a
            # gather is prefetched (two units or more besides the root; none when every group
            # is an fp32 master on the device: the optimizer's, gathered from where it is).
            assert got["windows_max"] <= got["one_layer"], (label, got)
            assert (got["windows_seen"] > 0) == (got["one_layer"] > 0 and got["prefetched"]), \
                (label, got)
        # Without parameter offload no window ever exists.
        assert r["none"]["windows_seen"] == 0 and r["optimizer"]["windows_seen"] == 0


# -- memory_report and the plan ---------------------------------------------------------------

def report_during_and_after(rank: int, world_size: int, label: str) -> dict:
    """memory_report's shards on the device: during the forward (a window in flight), and after
    a step (none), with the table's row; the offload's host arena holding the frozen shards."""
    case = CASES["transformer-bf16-frozen-embedding"]
    offload = OFFLOADS[label]
    model, sharding = build("shard", case, offload)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR)
    during: list[int] = []
    sharding.runtime.units[1].module.register_forward_pre_hook(
        lambda m, a: during.append(sharding.memory_report().device_shard_bytes))
    x, y = global_batch(case.spec, 0, 0, world_size)
    loss_fn(case.spec, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    opt.step()
    report = sharding.memory_report(opt)
    return dict(during=during, after=report.device_shard_bytes, table=report.table(),
                arena=report.host_arena_bytes,
                frozen=sum(g.shard.numel() * g.shard.element_size() for g in groups(sharding)
                           if not g.trainable),
                next_window=sum(g.layout.shard_numel * 2 for g in sharding.layers[2].groups))


def test_memory_report_shows_the_shards_falling_to_the_window(world):
    plain = world.run(report_during_and_after, "none")
    for r, p in zip(world.run(report_during_and_after, "all"), plain):
        # At the pre-hook of layer 1, layer 2's gather is in flight (forward prefetch): its
        # window is all that is on the device; after the step, nothing.
        assert r["during"] == [r["next_window"]] and r["after"] == 0, r
        assert p["after"] > 0 and r["arena"] >= r["frozen"] > 0
        assert "shards on the device now" in r["table"]


def plan_policies(label: str) -> dict:
    """``label``: an OFFLOADS key, the frozen weights int8 sharded; or "params replicated": the
    parameters offloaded with a replicated NF4 base (the whole base in host memory)."""
    offload, placement = label.split()[0], label.split()[1:] or ["sharded"]
    frozen = zerocore.FrozenWeights("int8") if placement == ["sharded"] else \
        zerocore.FrozenWeights("nf4", placement="replicated")
    return dict(mixed_precision=zerocore.MixedPrecision(torch.bfloat16, torch.float32),
                offload=OFFLOADS[offload], frozen_weights=frozen)


def freeze_blocks(layers: list[nn.Module]) -> list[nn.Module]:
    """A LoRA-like split: the blocks' weights frozen (int8), the rest trained."""
    for block in layers[1:-1]:
        for name, p in block.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.requires_grad_(False)
    return layers


def measure_stack(rank: int, world_size: int, label: str) -> list[int]:
    """Three peaks of two steps (tests/support/offload_stack.py: the smallest is the step's)."""
    return measured_peaks(lambda: zerocore.shard(freeze_blocks(layer_stack()),
                                                 **plan_policies(label)))[0]


def planned(label: str, world_size: int, device: str):
    return zerocore.plan.plan(freeze_blocks(layer_stack("meta")),
                              torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=world_size, loss=stack_loss, device=device,
                              **plan_policies(label))


# The plan is the engine's own step on fake tensors: measured 0.9995 at 2 ranks with either
# offload (and without). 2%, tests/engine/test_plan.py's bound for a stack, leaves room for what
# fake tensors never run (kernels' workspaces) and none for a window left out or kept too long
# (a block's int8 shard is 3-6% of these peaks).
PLAN_TOL = 0.02


# Parameter offload at 2 and 3 ranks; with the optimizer, and with a replicated base, at 3
# only: what they add to the plan (the mirrors, the whole base on the host) does not depend on
# the count, which parameter offload covers at 2 and 3 (CI time).
@pytest.mark.parametrize("world_size,label", [
    pytest.param(world_size, label, id=f"{world_size}-{label}")
    for label in ("params", "all", "params replicated")
    for world_size in ([2, 3] if label == "params" else [3])])
def test_plan_matches_the_measured_peak(worlds, label, world_size):
    plan = planned(label, world_size, "cpu")
    smallest = min(min(runs) for runs in worlds(world_size).run(measure_stack, label))
    assert abs(plan.device_peak / smallest - 1) < PLAN_TOL, (plan.device_peak, smallest,
                                                             plan.table())


def test_plan_for_a_gpu_puts_the_shards_on_the_host_and_the_windows_on_the_device():
    plans = {label: planned(label, 2, "cuda") for label in OFFLOADS}
    for label in ("params", "all"):
        p = plans[label]
        assert FROZEN in p.state.on_host and (TRAINABLE in p.state.on_host) == (label == "all")
        # The windows are all the device holds of the shards, and less than the shards.
        assert 0 < p.windows_peak < p.state.frozen_params
        assert "parameter windows at the peak" in p.table()
        # The device holds less than without parameter offload by the shards it no longer
        # keeps there (the frozen ones; the trainable copies without the optimizer, the
        # mirrors with it), less the windows: at any moment of the step the two runs hold the
        # same but for those, so the peaks differ by at most the shards and at least the
        # shards less the most windows ever held.
        before = plans["none" if label == "params" else "optimizer"]
        kept = before.peak[FROZEN] + (before.state.mirrors if label == "all"
                                      else before.peak[TRAINABLE])
        saved = before.device_peak - p.device_peak
        assert kept - p.windows_peak <= saved <= kept, (label, saved, kept, p.table())
    # Without the optimizer, the 16-bit trainable copies are not kept (rounded per window).
    assert plans["params"].state.trainable_params == 0 < plans["all"].state.trainable_params


def test_plan_for_a_gpu_puts_a_replicated_base_on_the_host():
    # Offload(params=True) with a replicated NF4 base: the whole base is counted on the host,
    # each unit's upload as a window on the device, and the device saves the base (and the
    # trainable copies, rounded per window instead) less the windows, as the sharded case.
    host, before = planned("params replicated", 2, "cuda"), planned("none replicated", 2, "cuda")
    assert FROZEN in host.state.on_host and FROZEN not in before.state.on_host
    assert host.state.frozen_params == before.state.frozen_params   # every part, both
    assert 0 < host.windows_peak < host.state.frozen_params
    kept = before.peak[FROZEN] + before.peak[TRAINABLE]
    saved = before.device_peak - host.device_peak
    assert kept - host.windows_peak <= saved <= kept, (saved, kept, host.table())
