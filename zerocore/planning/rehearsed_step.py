"""The step ``zerocore.plan`` measures: the engine's own. A sharding is built by the front door's
own class over a planned world (comm/fake.py: ``world_size`` ranks, this one of them) on fake
tensors (``FakeTensorMode``: shapes and dtypes, no memory, torch's own kernels' choices), with a
transport that moves nothing and holds what each way says it holds (engine/rehearsal.py); then
zerocore's AdamW, a first training step (after it nothing is created lazily: the optimizer's
moments, the resident frozen groups, the order a model's units run in), and the step planned:
its micro-batches' forward and backward, the optimizer step, ``zero_grad``. What its
collectives move (the engine's ``CommCounter``, over the fake groups) is the plan's traffic, and
what torch's ``FlopCounterMode`` counts of its kernels is the plan's floating-point work, when
asked for (``Step.count_flops``: the counter's dispatch costs about a third of a plan).

``LiveBytes`` follows every storage the run keeps alive; whenever their sum passes its peak, what
the engine holds is read off the sharding by category (shards, masters, moments, gradients,
gathered layers, gradient buffers) and the rest is activations. So the plan holds what the step
holds, and no part of it re-tells the engine's walk.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from zerocore.comm import transport
from zerocore.engine.rehearsal import Rehearsal
from zerocore.engine.sharded_param import is_nvme
from zerocore.engine.sharding import Sharding
from zerocore.optim import AdamW
from zerocore.planning.live_bytes import LiveBytes
from zerocore.planning.memory_plan import (ACTIVATIONS, CATEGORIES, CUDA_FIXED_HEADROOM,
                                           CUDA_HEADROOM_FRACTION, FROZEN, GATHERED,
                                           GRAD_BUFFERS, GRADIENTS, MASTERS, MIRRORS,
                                           NVME_POOL, OPTIMIZER, SECONDARY, TRAINABLE,
                                           WINDOWS, Loading, MemoryPlan, ModelState)
from zerocore.policies import Comm, Offload


@dataclasses.dataclass(frozen=True)
class Step:
    """What the planned step is: the sharding to build, and one micro-batch's loss."""

    build: Callable[[Rehearsal], Sharding]     # the front door's class, over the rehearsal
    loss: Callable[[], torch.Tensor]           # the model run on its fake input, and the loss
    world_size: int
    device: str                                # "cuda" or "cpu": the device planned for
    comm: Comm
    offload: Offload
    micro_batches: int
    mesh: tuple[int, int] | None = None        # HSDP's (replicas, shards); None: flat
    nodes: int = 1                             # the nodes a flat layout spans
    buffers: int = 0                           # the model's buffers (every rank's, whole)
    # Whether the plan counts its FLOPs (``MemoryPlan.flops``). Off by default: torch's
    # counter dispatches every kernel of the first step through Python, about a third of a
    # plan's time here (1.05 s against 0.78 s for one small layout), and only a step-time
    # estimate (neox.plan --link) reads the count.
    count_flops: bool = False

    @property
    def shards(self) -> int:
        """The ranks each parameter is sharded over (the shard group's size)."""
        return self.world_size if self.mesh is None else self.mesh[1]


class _Peak:
    """The step's peak as it is found: the engine's holdings by category, and where."""

    def __init__(self) -> None:
        self.total = -1
        self.parts: dict[str, int] = {}
        self.phase = ""
        self.gathered = 0          # most gathered-layer bytes at any point observed
        self.activations = 0       # most activation bytes at any point observed
        self.windows = 0           # most parameter-window bytes at any point observed
        self.secondary = 0         # most secondary-shard bytes at any point observed (hpZ)


def rehearse(step: Step, fake: FakeTensorMode, exclude: list[torch.Tensor]) -> MemoryPlan:
    """Builds the sharding, runs a first step and the planned one on fake tensors (``fake``:
    the mode the layers' buffers and the inputs were made in); the peak of the planned step,
    per rank. ``exclude``: the step's inputs, which the caller holds (not counted)."""
    ways = transport.planned(step.comm, device_kind=step.device, world_size=step.shards,
                             nodes=step.nodes if step.mesh is None else 1)
    peak = _Peak()
    held: dict[str, Any] = {}          # the sharding, optimizer and label, once they exist

    def observe(live: int) -> None:
        if "sharding" not in held:  # the build: the loading by range, measured as a whole
            return
        live += held_by_delayed_pass(held["sharding"])
        parts = _by_category(held["sharding"], held["optimizer"], held["kept"])
        parts[ACTIVATIONS] = live - sum(parts.values())
        peak.gathered = max(peak.gathered, parts[GATHERED])
        peak.activations = max(peak.activations, parts[ACTIVATIONS])
        peak.windows = max(peak.windows, parts[WINDOWS])
        peak.secondary = max(peak.secondary, parts[SECONDARY])
        if live > peak.total:
            peak.total, peak.parts, peak.phase = live, parts, _phase(held)

    tracker = LiveBytes(observe)
    for t in exclude:
        tracker.exclude(t)

    class Watch:  # the gathered buffers' resizes: counted, and observed when the window is open
        @staticmethod
        def resized(storage: torch.UntypedStorage) -> None:
            tracker.resized(storage)
            if tracker.peak is not None:
                observe(tracker.live)

    with fake, tracker, tracker.saved_hooks():
        # The build reads every parameter by range (the plan's reader, ``loading_read``): its
        # peak is the loading's, what it holds after it the loading's result.
        tracker.open_window()
        sharding = step.build(Rehearsal(ways, step.device, Watch()))
        loading = Loading(peak=tracker.close_window() + step.buffers,
                          held=tracker.live + step.buffers)
        optimizer = AdamW(sharding.trainable_shards(), lr=1e-3)
        # What the transport keeps from step to step (reading's received buffers, as large as
        # the largest shard reduced so far): here from the start, as in every step after the
        # first; the rank that keeps the most (reading's from rank 2 on: one buffer more).
        largest = max((l.trainable.layout.shard_numel for l in sharding.layers
                       if l.trainable is not None), default=0)
        kept = torch.empty(transport.REDUCES[ways.reduce].kept_nbytes(
            largest * sharding.mixed_precision.grad_reduce_dtype.itemsize,
            rank=step.shards - 1), dtype=torch.uint8)
        held.update(sharding=sharding, optimizer=optimizer, kept=kept, label="", phase=None)
        # The first step, one micro-batch, its floating-point operations counted by torch as
        # its kernels run (forward, backward and recomputation alike). Counted here, outside
        # the planned step: with the counter's dispatch mode active in it, the planned peak of
        # a recomputed stack came out 18% above the measured one (tests/engine/test_plan.py).
        counter = FlopCounterMode(display=False) if step.count_flops else None
        with counter if counter is not None else contextlib.nullcontext():
            _train(step, sharding, optimizer, held, micro_batches=1)
        tracker.open_window()
        sharding.counter.reset()   # the planned step's own collectives, counted as it runs
        micro = min(step.micro_batches, 2)
        _train(step, sharding, optimizer, held, micro_batches=micro)
    per_step = (counter.get_total_flops() * step.micro_batches if counter is not None
                else None)
    return _plan(step, sharding, peak, _traffic(sharding, micro, step.micro_batches), loading,
                 per_step)


@dataclasses.dataclass(frozen=True)
class _Traffic:
    all_gather: int         # bytes per optimizer step, as CommCounter counts them
    reduce_scatter: int
    replica_all_reduce: int
    across_all_gather: int      # hpZ: over the replicate group (between the nodes)
    across_reduce_scatter: int


def _traffic(sharding: Sharding, ran: int, micro_batches: int) -> _Traffic:
    """What the rehearsed step's collectives moved (``ran`` micro-batches), per optimizer step
    of ``micro_batches``: every micro-batch gathers and reduce-scatters alike (hpZ's across
    the nodes too); HSDP's all-reduce across the replicas runs once per step, on the last
    micro-batch."""
    c = sharding.counter
    per_pass = (c.all_gather_bytes, c.reduce_scatter_bytes, c.replicate_all_gather_bytes,
                c.replicate_reduce_scatter_bytes)
    assert all(n % ran == 0 for n in per_pass), "micro-batches of one step moved different bytes"
    gather, reduce, across_gather, across_reduce = (n // ran * micro_batches for n in per_pass)
    return _Traffic(gather, reduce, c.replica_all_reduce_bytes, across_gather, across_reduce)


def _train(step: Step, sharding: Sharding, optimizer: AdamW, held: dict,
           micro_batches: int) -> None:
    """Forward and backward of each micro-batch (the second sees gradients present: more
    would hold nothing more), the optimizer's step, ``zero_grad(set_to_none=True)``."""
    for m in range(micro_batches):
        held["label"] = f"micro-batch {m + 1}, " if micro_batches > 1 else ""
        # HSDP: the last micro-batch alone all-reduces across the replicas, as a training
        # loop that accumulates asks (the earlier ones' sums are kept meanwhile).
        sharding.set_requires_all_reduce(m == micro_batches - 1)
        value = step.loss()
        value.backward()
        del value
    held["phase"] = "optimizer step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    held["phase"] = None


def _phase(held: dict) -> str:
    """Where the step is, as the runtime last said."""
    if held["phase"] is not None:
        return held["phase"]
    sharding: Sharding = held["sharding"]
    kind, index = sharding.runtime.where
    if not kind:
        return held["label"] + "start"
    root = sharding.runtime.root.layer
    what = "the root" if index == root.index and root.groups else f"layer {index}"
    return f"{held['label']}{kind} of {what}"


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def held_by_delayed_pass(sharding: Sharding) -> int:
    """Bytes of the last step's gradients that a delayed pass holds through this step until
    the next settles it (fp32, a trainable shard each), which the rehearsal, whose pass is not
    overlapped, does not hold: added to what it sees live."""
    return sum(g.shard.numel() * 4 for layer in sharding.layers for g in layer.groups
               if g.trainable and getattr(g.shard, "published", None) is not None)


def _by_category(sharding: Sharding, optimizer: AdamW, kept: torch.Tensor) -> dict[str, int]:
    """What the engine holds now, by category (each storage once)."""
    parts = dict.fromkeys(CATEGORIES[:-1], 0)
    seen: set[int] = set()

    def add(category: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            parts[category] += _nbytes(t)

    sixteen = sharding.mixed_precision.param_dtype != torch.float32
    for layer in (u.layer for u in sharding.runtime.units):
        for g in layer.groups:
            parts[GATHERED] += g.gathered_bytes
            parts[WINDOWS] += g.window_bytes
            parts[SECONDARY] += g.secondary_bytes
            shard = g.shard
            if not g.trainable:
                add(FROZEN, shard)
                continue
            copy = getattr(shard, "model_copy", None)
            if copy is not None:
                add(TRAINABLE, copy)
                if not is_nvme(shard):  # (an NVMe shard's master is in its scratch)
                    add(MASTERS, shard)
            else:  # in 16 bit, Offload(params=True) alone: a master, no copy kept
                add(MASTERS if sixteen else TRAINABLE, shard)
            parts[MIRRORS] += g.mirror_bytes
            add(GRADIENTS, shard.grad)
            add(TRAINABLE, getattr(shard, "published", None))  # (a delayed pass's copy)
            for t in g.reduce.kept_tensors():
                add(GRAD_BUFFERS, t)
            for t in optimizer.state.get(shard, {}).values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    add(OPTIMIZER, t)
    for t in sharding.runtime.coordinator.held_tensors():
        add(GRAD_BUFFERS, t)
    add(GRAD_BUFFERS, kept)
    parts[GRADIENTS] += held_by_delayed_pass(sharding)
    if sharding.ctx.store is not None:
        add(NVME_POOL, sharding.ctx.store.pool)
    return parts


def model_state(sharding: Sharding, on_host: frozenset[str]) -> ModelState:
    """The bytes of model state of one rank, from the layouts the engine built."""
    p_bytes = sharding.mixed_precision.param_dtype.itemsize
    homes = sharding.ctx.homes   # each counts what it holds (zerocore/engine/homes/)
    store = homes.store
    t_numel = f_numel = t_shard = f_held = 0
    for layer in sharding.layers:
        for g in layer.groups:
            if g.trainable:
                t_numel += g.layout.numel
                t_shard += g.layout.shard_numel
            else:
                f_numel += g.layout.numel
                lo, hi = g.held_range   # a replicated base holds every rank's part
                f_held += hi - lo
    trainable = homes.trainable.planned(t_shard, p_bytes)
    gradients = t_shard * 4
    if homes.delayed:
        # The published copy the gathers read, beside the one the pass writes; and the last
        # step's gradients, which the pass holds beside this step's.
        trainable = dataclasses.replace(trainable, params=trainable.params + t_shard * p_bytes)
        gradients *= 2
    return ModelState(
        trainable_numel=t_numel, frozen_numel=f_numel, trainable_params=trainable.params,
        frozen_params=(sharding.frozen_weights.frozen_nbytes(f_held, p_bytes)
                       if homes.frozen.frozen_in_memory else 0),
        masters=trainable.masters, optimizer=trainable.optimizer, gradients=gradients,
        mirrors=trainable.mirrors, on_host=on_host,
        nvme=store.size if store is not None else 0,
        pool=store.pool_bytes if store is not None else 0,
        nvme_masters=store.masters if store is not None else True,
        frozen_layout=(f"{fw.dtype}, {fw.placement}" if (fw := sharding.frozen_weights).dtype
                       else ""))


def _plan(step: Step, sharding: Sharding, peak: _Peak, traffic: _Traffic,
          loading: Loading, flops: int | None) -> MemoryPlan:
    # Optimizer offload: the trainable model copies go to the host with everything the
    # optimizer touches; the device keeps a mirror of each copy (unless parameters are
    # offloaded too). Parameter offload: the frozen shards go to the host, the device holds
    # the windows in flight. (On the CPU host and device are one memory.)
    on_host = frozenset(({TRAINABLE, MASTERS, OPTIMIZER, GRADIENTS} if step.offload.optimizer
                         else set()) | ({FROZEN} if step.offload.params else set())
                        | ({NVME_POOL} if step.offload.nvme else set()))
    state = model_state(sharding, on_host)
    cuda = step.device == "cuda"
    device_tensors = sum(v for k, v in peak.parts.items() if not cuda or k not in on_host)
    headroom = (CUDA_FIXED_HEADROOM + int(CUDA_HEADROOM_FRACTION * device_tensors)
                if cuda else 0)
    host = sum(v for k, v in peak.parts.items() if k in on_host) if cuda else 0
    mesh = sharding.mesh
    return MemoryPlan(
        world_size=step.world_size, device=step.device, state=state, peak=peak.parts,
        peak_phase=peak.phase, gathered_peak=peak.gathered,
        activations_peak=peak.activations, host_peak=host, headroom=headroom,
        all_gather_bytes=traffic.all_gather, reduce_scatter_bytes=traffic.reduce_scatter,
        replica_all_reduce_bytes=traffic.replica_all_reduce, mesh=step.mesh,
        nodes=step.mesh[0] if step.mesh is not None else step.nodes,
        recomputed_layers=tuple(sorted(sharding.schedule.recomputed)),
        windows_peak=peak.windows,
        across_all_gather_bytes=traffic.across_all_gather,
        across_reduce_scatter_bytes=traffic.across_reduce_scatter,
        layout="hpZ" if mesh.hpz else "HSDP" if mesh.hybrid else "",
        secondary_peak=peak.secondary, loading=loading, flops=flops)
