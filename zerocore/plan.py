"""``zerocore.plan``: what a sharded training step will hold in memory and move, per rank, from
the layers' shapes alone: before renting the machines.

Model state is counted from the flat layouts ``zerocore.shard`` would build (the same
``FlatLayout``), so it is exact. Everything that comes and goes during a step — gathered
layers, packed gradients, gradient shards, activations — is found by running the step's
schedule once on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes, no
memory, torch's own kernels' choices): the layers' forward and backward, the loss, recomputation,
in the engine's order, while a counter follows every tensor the step creates and frees. The
engine's own buffers are added where the engine allocates and frees them (``ShardedSequential``,
``LayerFunction``, ``BackwardCoordinator``); the peak is the largest sum at any point of the
step. So the plan holds what the step holds, not what a formula hopes: the logits and the
loss's fp32 copies, the parameter gradients of a layer before they are packed, the prefetched
layer, the last layer kept gathered, a second micro-batch's forward with gradients present.

Fake tensors run the CPU's kernel choices (fake tensors are CPU tensors): attention by
``scaled_dot_product_attention`` then keeps what a fused (flash) kernel keeps, q, k, v, the
output and one fp32 value per query, as the flash and memory-efficient CUDA kernels do; the
meta device would have run the math kernel, which keeps the T x T weights.

On a GPU the caching allocator and CUDA itself take memory that no tensor accounts for; the
plan adds a stated ``headroom`` for it (``CUDA_HEADROOM``). On the CPU there is none, and the
CPU has one memory: host and device bytes add up (``MemoryPlan.peak_bytes``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.meta_layer import MetaLayer
from zerocore.policies import FrozenWeights, MixedPrecision, Offload, Prefetch, Recompute
from zerocore.engine.schedule import Schedule
from zerocore.engine.sharded_layer import collect_params

GiB = 2**30

# What a CUDA process holds beyond its tensors, as the plan counts it (not measured here: no
# session had a GPU). The CUDA context with lazily loaded kernels, cuBLAS/cuDNN workspaces and
# NCCL's channel buffers take about 1 GiB on an H100/H200 process; the caching allocator,
# with expandable segments (neox sets them), rounds and fragments a few per cent of what it
# serves: 5% of the peak.
CUDA_FIXED_HEADROOM = 1 * GiB
CUDA_HEADROOM_FRACTION = 0.05

# Where each kind of memory is counted.
TRAINABLE, FROZEN, MASTERS, OPTIMIZER, GRADIENTS, MIRRORS = (
    "parameter shards, trainable", "parameter shards, frozen", "fp32 master shards",
    "optimizer state", "gradient shards", "offload mirrors")
GATHERED, GRAD_BUFFERS, ACTIVATIONS = ("gathered layers", "gradient buffers", "activations")
CATEGORIES = (TRAINABLE, FROZEN, MASTERS, OPTIMIZER, GRADIENTS, MIRRORS, GATHERED,
              GRAD_BUFFERS, ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Bytes of model state one rank holds (every rank holds the same: shards are equal)."""

    trainable_numel: int            # Ψ_trainable, whole model, padding excluded
    frozen_numel: int               # Ψ_frozen
    trainable_params: int           # model copies (param dtype), or fp32 masters in fp32
    frozen_params: int              # frozen shards (param dtype)
    masters: int                    # fp32 masters beside 16-bit model copies
    optimizer: int                  # Adam's two fp32 moments
    gradients: int                  # fp32 gradient shards, from backward to zero_grad
    mirrors: int                    # device mirrors of offloaded model copies
    on_host: frozenset[str]         # categories that live in host memory (CPU offload, GPUs)

    def bytes_of(self) -> dict[str, int]:
        return {TRAINABLE: self.trainable_params, FROZEN: self.frozen_params,
                MASTERS: self.masters, OPTIMIZER: self.optimizer, GRADIENTS: self.gradients,
                MIRRORS: self.mirrors}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one rank holds at the peak of a step, and what it moves per optimizer step."""

    world_size: int
    device: str                        # "cuda" or "cpu"
    state: ModelState
    peak: dict[str, int]               # bytes by category at the step's peak (all memories)
    peak_phase: str                    # where in the step the peak falls
    gathered_peak: int                 # most gathered-layer bytes held at any point
    activations_peak: int              # most activation bytes held at any point
    host_peak: int                     # host memory at the peak (offloaded state; CPU: 0)
    headroom: int                      # beyond tensors: CUDA context, allocator (CPU: 0)
    all_gather_bytes: int              # per optimizer step (all micro-batches)
    reduce_scatter_bytes: int
    recomputed_layers: tuple[int, ...]

    @property
    def device_peak(self) -> int:
        """Bytes of tensors on the compute device at the peak (the host's too on a CPU)."""
        return sum(v for k, v in self.peak.items()
                   if self.device == "cpu" or k not in self.state.on_host)

    @property
    def peak_bytes(self) -> int:
        """What the device needs: its tensors at the peak plus the headroom."""
        return self.device_peak + self.headroom

    def table(self, device_memory: int | None = None) -> str:
        s = self.state
        host = " (host)" if self.device == "cuda" else ""
        rows = [
            (f"parameter shards, trainable{host if TRAINABLE in s.on_host else ''}",
             s.trainable_params),
            ("parameter shards, frozen", s.frozen_params),
            (f"fp32 master shards{host if MASTERS in s.on_host else ''}", s.masters),
            (f"gradient shards (fp32){host if GRADIENTS in s.on_host else ''}", s.gradients),
            (f"optimizer state (Adam){host if OPTIMIZER in s.on_host else ''}", s.optimizer),
            ("offload mirrors", s.mirrors),
            ("gathered layers at the peak", self.peak[GATHERED]),
            ("gradient buffers at the peak", self.peak[GRAD_BUFFERS]),
            ("activations at the peak", self.peak[ACTIVATIONS]),
            ("(activations, most at any point)", self.activations_peak),
            ("(gathered layers, most at any point)", self.gathered_peak),
        ]
        if self.device == "cuda":
            rows.append(("CUDA context and allocator headroom", self.headroom))
        lines = [f"per rank ({self.world_size} ranks, each the same), Ψ_trainable="
                 f"{s.trainable_numel:,} Ψ_frozen={s.frozen_numel:,}"]
        lines += [f"  {name:<42}{value / GiB:10.2f} GiB" for name, value in rows]
        total = f"  {'total on the device at the peak':<42}{self.peak_bytes / GiB:10.2f} GiB"
        if device_memory:
            verdict = "fits" if self.peak_bytes <= device_memory else "does NOT fit"
            total += f"  of {device_memory / GiB:.0f} GiB: {verdict}"
        lines.append(total)
        if self.host_peak:
            lines.append(f"  {'host memory (offloaded state)':<42}"
                         f"{self.host_peak / GiB:10.2f} GiB")
        lines.append(f"  peak: {self.peak_phase}")
        lines.append(f"  per step: all-gathered {self.all_gather_bytes / GiB:.2f} GiB, "
                     f"reduce-scattered {self.reduce_scatter_bytes / GiB:.2f} GiB")
        return "\n".join(lines)


# -- following every tensor of a fake run --------------------------------------------------------

class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that the tensors created under it keep alive. A
    storage lives while a Python tensor viewing it lives (tensors that C++ still holds keep
    their Python object: torch preserves it) or while autograd keeps it for backward (the
    saved-tensor hooks below hold a detached alias and say when autograd lets go)."""

    def __init__(self, excluded: Callable[[int], bool]):
        super().__init__()
        self._excluded = excluded       # storages not counted (gathered layers, inputs)
        self._holders: dict[int, int] = {}   # storage key -> live tensors and saved aliases
        self._nbytes: dict[int, int] = {}
        # The weak references themselves must live for their callbacks to run; keyed by id,
        # as a weakref's hash and equality are its tensor's (elementwise, for a tensor).
        self._refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.region_peak = 0

    def _hold(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        key = storage._cdata
        if self._excluded(key):
            return None
        if key not in self._holders:
            self._holders[key] = 0
            self._nbytes[key] = storage.nbytes()
            self.live += self._nbytes[key]
        self._holders[key] += 1
        return key

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live -= self._nbytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                key = self._hold(t)
                if key is not None:
                    def gone(ref: weakref.ref, key: int = key) -> None:
                        self._refs.pop(id(ref), None)
                        self._release(key)
                    ref = weakref.ref(t, gone)
                    self._refs[id(ref)] = ref
        self.region_peak = max(self.region_peak, self.live)
        return out

    def saved_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        tracker = self

        class Saved:
            def __init__(self, t: torch.Tensor):
                # An alias without autograd history: holding the tensor itself would make a
                # cycle through its grad_fn and delay its release until a garbage collection.
                self.t = t.detach()
                self.key = tracker._hold(t)

            def __del__(self) -> None:
                if self.key is not None:
                    tracker._release(self.key)

        return torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.t)

    def start_region(self) -> None:
        self.region_peak = self.live


# -- the layers as the simulation runs them -------------------------------------------------------

@dataclasses.dataclass
class _Group:
    layout: FlatLayout
    trainable: bool
    owners: list[list[tuple[nn.Module, str]]]
    buffer: torch.Tensor | None = None      # fake gathered buffer, made once


@dataclasses.dataclass
class _Layer:
    index: int
    module: nn.Module                        # a copy: parameters replaced by views when run
    groups: list[_Group]
    recompute: bool

    @property
    def trainable(self) -> _Group | None:
        return next((g for g in self.groups if g.trainable), None)

    def gathered_bytes(self, param_bytes: int) -> int:
        return sum(g.layout.padded_numel for g in self.groups) * param_bytes


def _plan_layer(module: nn.Module, index: int, world_size: int,
                int8_block: int | None) -> _Layer:
    module = copy.deepcopy(module)  # the caller's layer keeps its parameters
    params = collect_params(module)
    groups = []
    for trainable in (True, False):
        chosen = [(n, p, o) for n, p, o in params if p.requires_grad == trainable]
        if chosen:
            multiple = int8_block if int8_block is not None and not trainable else 1
            groups.append(_Group(FlatLayout.build([(n, tuple(p.shape)) for n, p, _ in chosen],
                                                  world_size, block=multiple),
                                 trainable, [o for _, _, o in chosen]))
    for _, _, owners in params:
        for mod, attr in owners:
            del mod._parameters[attr]
    return _Layer(index, module, groups, False)


# -- the step -------------------------------------------------------------------------------------

class _Output(torch.autograd.Function):
    """The stack's output as the loss sees it: like ``LayerFunction``'s, it needs a gradient
    but holds nothing of its own, so the loss alone decides how long the output lives; its
    backward hands the gradient to the simulation (``catch``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, anchor: torch.Tensor, catch: list) -> torch.Tensor:
        ctx.catch = catch
        return y.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.catch.append(grad)
        return None, None, None


@dataclasses.dataclass(frozen=True)
class _Options:
    world_size: int
    device: str
    param_bytes: int
    reduce_bytes: int
    param_dtype: torch.dtype
    prefetch: Prefetch
    offload: bool
    micro_batches: int
    frozen_weights: FrozenWeights = FrozenWeights()

    def gather_bytes(self, g: "_Group") -> int:
        """What one all-gather of the group moves (FlatGroup.gather_bytes)."""
        if g.trainable:
            return g.layout.padded_numel * self.param_bytes
        return self.frozen_weights.frozen_nbytes(g.layout.padded_numel, self.param_bytes)


class _Step:
    """One optimizer step on fake tensors, in the engine's order, recording the largest sum of
    the engine's buffers (a ledger, changed where the engine allocates and frees) and the
    tensors the layers and the loss create (followed by ``_LiveBytes``)."""

    def __init__(self, layers: list[_Layer], state: ModelState, opt: _Options,
                 schedule: Schedule, fake: FakeTensorMode):
        self.layers, self.opt, self.schedule, self.fake = layers, opt, schedule, fake
        static = state.bytes_of()
        static[GRADIENTS] = 0   # shards appear in backward (and go with zero_grad)
        self.ledger = {c: static.get(c, 0) for c in CATEGORIES if c != ACTIVATIONS}
        self.grad_shard_bytes = {l.index: l.trainable.layout.shard_numel * 4
                                 for l in layers if l.trainable is not None}
        self.has_grad: set[int] = set()
        # CPU, two ranks: the buffer the peer's gradient contributions are read into (see
        # _deliver). The engine keeps it from step to step, as large as the largest shard
        # reduced so far, so every step after the first starts with it at its largest: the
        # step planned here (the first one's peak is no higher).
        self.read_buffer = 0
        if opt.device == "cpu" and opt.world_size == 2:
            self.read_buffer = max((l.trainable.layout.shard_numel * opt.reduce_bytes
                                    for l in layers if l.trainable is not None), default=0)
            self.ledger[GRAD_BUFFERS] += self.read_buffer
        self.gathered: set[tuple[int, bool]] = set()   # (layer index, trainable) gathered
        self.int8_held: set[tuple[int, bool]] = set()  # int8 parts still held (FrozenWeights)
        self.peak_total = -1
        self.peak: dict[str, int] = {}
        self.peak_phase = ""
        self.timeline: list[tuple[str, int, int]] = []   # (phase, total, activations)
        self.gathered_peak = 0
        self.activations_peak = 0
        excluded: set[int] = set()
        self.excluded = excluded
        self.tracker = _LiveBytes(excluded.__contains__)
        # The gathered buffers: made here, outside the counter, and never counted as
        # activations (the views autograd keeps of them cost nothing: the engine frees the
        # storage; the ledger counts a layer while it is gathered).
        with fake:
            for layer in layers:
                for g in layer.groups:
                    g.buffer = torch.empty(g.layout.padded_numel, dtype=opt.param_dtype)
                    excluded.add(g.buffer.untyped_storage()._cdata)

    # ledger and observation
    def _observe(self, phase: str, activations: int) -> None:
        self.timeline.append((phase, sum(self.ledger.values()) + activations, activations))
        self.activations_peak = max(self.activations_peak, activations)
        self.gathered_peak = max(self.gathered_peak, self.ledger[GATHERED])
        total = sum(self.ledger.values()) + activations
        if total > self.peak_total:
            self.peak_total, self.peak_phase = total, phase
            self.peak = dict(self.ledger, **{ACTIVATIONS: activations})

    @contextlib.contextmanager
    def region(self, phase: str) -> Iterator[None]:
        """Fake work during which the engine's buffers do not change."""
        self.tracker.start_region()
        yield
        self._observe(phase, self.tracker.region_peak)

    def point(self, phase: str) -> None:
        self._observe(phase, self.tracker.live)

    def _int8(self, g: _Group) -> int:
        """Bytes of an int8 frozen group's gathered int8 parts (0 for other groups)."""
        int8 = self.opt.frozen_weights.int8_block is not None and not g.trainable
        return self.opt.gather_bytes(g) if int8 else 0

    def gather(self, layer: _Layer) -> None:
        for g in layer.groups:
            key = (layer.index, g.trainable)
            if key not in self.gathered:
                self.gathered.add(key)
                self.ledger[GATHERED] += g.layout.padded_numel * self.opt.param_bytes
                if self._int8(g):   # received as int8, dequantized into the buffer
                    self.int8_held.add(key)
                    self.ledger[GATHERED] += self._int8(g)

    def free(self, layer: _Layer) -> None:
        for g in layer.groups:
            key = (layer.index, g.trainable)
            if key in self.int8_held:   # FlatGroup.free gives the int8 parts back first
                self.int8_held.discard(key)
                self.ledger[GATHERED] -= self._int8(g)
            if not g.trainable and self.schedule.resident(layer.index):
                continue   # resident (Prefetch.keep_gathered): FlatGroup.free leaves it
            if key in self.gathered:
                self.gathered.discard(key)
                self.ledger[GATHERED] -= g.layout.padded_numel * self.opt.param_bytes

    def install(self, layer: _Layer, with_grad_leaves: bool) -> list[torch.Tensor]:
        leaves: list[torch.Tensor] = []
        for g in layer.groups:
            assert g.buffer is not None
            views = []
            for slot in g.layout.slots:
                v = g.buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
                views.append(v.detach().requires_grad_() if with_grad_leaves and g.trainable
                             else v)
            for view, owners in zip(views, g.owners):
                for mod, attr in owners:
                    setattr(mod, attr, view)
            if g.trainable:
                leaves = views
        return leaves

    # the schedule
    def run(self, example: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        simulated = min(self.opt.micro_batches, 2)  # the second sees gradients present
        for m in range(simulated):
            label = f"micro-batch {m + 1}, " if simulated > 1 else ""
            passes = self.forward(example, label)
            self.backward(passes, loss, label)   # (takes the output: the loss may free it)
        self.point("optimizer step")   # gradients, moments and masters all present
        self.ledger[GRADIENTS] = 0     # zero_grad(set_to_none=True)

    def forward(self, example: torch.Tensor, label: str):
        layers = self.layers
        nodes = []   # (layer, x_in, leaves, y, previous graph layer)
        previous = None
        self.gather(layers[0])
        x = example
        for i, layer in enumerate(layers):
            if self.schedule.prefetch_forward and i + 1 < len(layers):
                self.gather(layers[i + 1])
            needs_graph = layer.trainable is not None or x.requires_grad
            with self.region(f"{label}forward of layer {i}"), self.fake, self.tracker, \
                    self.tracker.saved_hooks():
                if needs_graph:
                    x_in = x.detach().requires_grad_(x.requires_grad)
                    if layer.recompute:
                        with torch.no_grad():
                            self.install(layer, with_grad_leaves=False)
                            y = layer.module(x_in)
                        nodes.append([layer, x_in, None, None, previous, True])
                    else:
                        with torch.enable_grad():
                            leaves = self.install(layer, with_grad_leaves=True)
                            y = layer.module(x_in)
                        # LayerFunction keeps the output's gradient edge, not the output
                        edge = get_gradient_edge(y) if y.requires_grad else None
                        nodes.append([layer, x_in, leaves, edge, previous, False])
                    previous = layer
                    x = y.detach().requires_grad_(True)
                else:
                    with torch.no_grad():
                        self.install(layer, with_grad_leaves=False)
                        x = layer.module(x)
            last = i + 1 == len(layers)
            if not (needs_graph and self.schedule.keeps_for_backward(i, last=last)):
                self.free(layer)
        return [nodes, x]

    def backward(self, passes: list, loss: Callable[[torch.Tensor], torch.Tensor],
                 label: str) -> None:
        opt = self.opt
        nodes = passes.pop(0)
        caught: list[torch.Tensor] = []
        with self.region(f"{label}loss and its backward"), self.fake, self.tracker, \
                self.tracker.saved_hooks():
            anchor = torch.empty(1, requires_grad=True)
            out = _Output.apply(passes.pop(0).detach(), anchor, caught)
            value = loss(out)
            del out          # what the loss did not keep goes now, as in a training loop
            value.backward()
            del value
            dy = caught.pop()
        cpu = opt.device == "cpu"
        pending = None   # the reduce in flight: (layer, its buffers' bytes)
        spare: list[int] = []                       # CPU: packed buffers kept for reuse
        for node in reversed(nodes):
            layer, x_in, leaves, output, previous, recomputed = node
            node[1:4] = [None, None, None]          # ctx.inner = None
            self.gather(layer)                      # (prefetched by the layer after it)
            if self.schedule.prefetch_backward and previous is not None:
                self.gather(previous)
            with self.region(f"{label}backward of layer {layer.index}"), self.fake, \
                    self.tracker, self.tracker.saved_hooks():
                y = None
                if recomputed:   # the forward again, under autograd
                    with torch.enable_grad():
                        leaves = self.install(layer, with_grad_leaves=True)
                        y = layer.module(x_in)
                    output = y if y.requires_grad else None
                inputs = ([x_in] if x_in.requires_grad else []) + leaves
                grads = (list(torch.autograd.grad(output, inputs, dy, allow_unused=True))
                         if output is not None and inputs else [None] * len(inputs))
                dx = grads.pop(0) if x_in.requires_grad else None
            # LayerFunction.backward holds y, grad_y and the parameters' gradients until it
            # returns, after packing and after delivering the previous layer's reduce.
            group = layer.trainable
            packed = 0
            if group is not None:
                numel = group.layout.padded_numel
                need = numel * opt.reduce_bytes
                if cpu:
                    # BackwardCoordinator.scratch_for: a spare big enough, else a new one (the
                    # popped spare that is too small is dropped); reduced in place (gloo).
                    if spare:
                        reused = spare.pop()
                        self.ledger[GRAD_BUFFERS] -= reused
                        if reused >= need:
                            need = reused
                    packed = need
                else:
                    # a packed buffer and this rank's reduce-scatter output
                    packed = need + group.layout.shard_numel * opt.reduce_bytes
                self.ledger[GRAD_BUFFERS] += packed
                self.point(f"{label}backward of layer {layer.index}: gradients packed")
            self.free(layer)
            if pending is not None:
                self._deliver(*pending, spare)
            pending = (layer, packed) if group is not None else None
            del grads, y, leaves, x_in
            dy = dx
        if pending is not None:
            self._deliver(*pending, spare)
        for layer in self.layers:   # BackwardCoordinator.finish: spares released, layers freed
            self.free(layer)
        self.ledger[GRAD_BUFFERS] -= sum(spare)
        self.point(f"{label}end of backward")

    def _deliver(self, layer: _Layer, packed: int, spare: list[int]) -> None:
        """A reduce completes: the layer's gradient shard is created (first micro-batch) or
        added to; the CPU keeps the packed buffer as a spare, a GPU frees both buffers."""
        if layer.index not in self.has_grad:
            self.has_grad.add(layer.index)
            self.ledger[GRADIENTS] += self.grad_shard_bytes[layer.index]
            self.point(f"gradient shard of layer {layer.index} created")
        if self.opt.device == "cpu":
            spare.append(packed)
            if self.opt.world_size == 2:
                # Two ranks on one host read each other's contribution into one buffer the
                # engine keeps, as large as the largest shard reduced so far
                # (collectives.PeerMemory.received_buffer). Where ranks cannot read each
                # other's memory they exchange halves instead, into a buffer per reduction in
                # flight: one shard more, at most.
                need = layer.trainable.layout.shard_numel * self.opt.reduce_bytes
                if need > self.read_buffer:
                    self.ledger[GRAD_BUFFERS] += need - self.read_buffer
                    self.read_buffer = need
        else:
            self.ledger[GRAD_BUFFERS] -= packed


def _model_state(layers: list[_Layer], opt: _Options) -> ModelState:
    t_numel = f_numel = t_shard = f_shard = 0
    for layer in layers:
        for g in layer.groups:
            if g.trainable:
                t_numel += g.layout.numel
                t_shard += g.layout.shard_numel
            else:
                f_numel += g.layout.numel
                f_shard += g.layout.shard_numel
    sixteen = opt.param_bytes != 4
    # Offload: the trainable model copies go to the host with everything the optimizer
    # touches; the device keeps a mirror of each copy, and the frozen shards.
    on_host = frozenset({TRAINABLE, MASTERS, OPTIMIZER, GRADIENTS} if opt.offload
                        else set())
    return ModelState(
        trainable_numel=t_numel, frozen_numel=f_numel,
        trainable_params=t_shard * (opt.param_bytes if sixteen else 4),
        frozen_params=opt.frozen_weights.frozen_nbytes(f_shard, opt.param_bytes),
        masters=t_shard * 4 if sixteen else 0, optimizer=t_shard * 8, gradients=t_shard * 4,
        mirrors=t_shard * opt.param_bytes if opt.offload else 0, on_host=on_host)


def plan(layers: Iterable[nn.Module | MetaLayer], example: torch.Tensor, *, world_size: int,
         loss: Callable[[torch.Tensor], torch.Tensor] | None = None, device: str = "cuda",
         mixed_precision: MixedPrecision = MixedPrecision(), prefetch: Prefetch = Prefetch(),
         offload: Offload = Offload(), recompute: Recompute | None = None,
         micro_batches: int = 1, frozen_weights: FrozenWeights = FrozenWeights()) -> MemoryPlan:
    """The memory and communication of one training step of ``zerocore.shard(layers, ...)``
    on ``world_size`` ranks, per rank, from shapes alone.

    layers: the stack as it would be given to ``shard`` (parameters' shapes, dtypes and
        ``requires_grad`` are what count: build it on the meta device; ``MetaLayer``s too).
    example: the first layer's input for one micro-batch of one rank (a meta tensor will do).
    loss: maps the last layer's output to the scalar whose backward the step runs, as the
        training loop computes it (default: the output's sum).
    device: "cuda" (NCCL: reduce-scatter buffers, the allocator's headroom) or "cpu" (gloo).
    micro_batches: forward/backward passes per optimizer step (gradient accumulation).
    The policies are ``shard``'s and the optimizer ``zerocore.optim``'s Adam(W), which holds
    its moments from construction; gradients are dropped by ``zero_grad(set_to_none=True)``.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"plan: device must be 'cuda' or 'cpu', got {device!r}")
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    if type(micro_batches) is not int or micro_batches < 1:
        raise ValueError(f"plan: micro_batches must be a positive int, got {micro_batches!r}")
    stack = [_plan_layer(l.module if isinstance(l, MetaLayer) else l, i, world_size,
                         frozen_weights.int8_block)
             for i, l in enumerate(layers)]
    if not stack:
        raise ValueError("plan: got no layers")
    opt = _Options(world_size=world_size, device=device,
                   param_bytes=mixed_precision.param_dtype.itemsize,
                   reduce_bytes=mixed_precision.grad_reduce_dtype.itemsize,
                   param_dtype=mixed_precision.param_dtype, prefetch=prefetch,
                   offload=offload.optimizer, micro_batches=micro_batches,
                   frozen_weights=frozen_weights)
    # The engine's own schedule (what is kept, prefetched, recomputed), from the same sizes.
    schedule = Schedule.of(prefetch, recompute,
                           [l.gathered_bytes(opt.param_bytes) for l in stack])
    for layer in stack:
        layer.recompute = layer.index in schedule.recomputed
    state = _model_state(stack, opt)
    fake = FakeTensorMode()
    with fake:
        for layer in stack:   # buffers as fake CPU tensors (values are never read)
            for name, buf in list(layer.module.named_buffers()):
                owner_name, _, attr = name.rpartition(".")
                owner = layer.module.get_submodule(owner_name) if owner_name else layer.module
                setattr(owner, attr, torch.empty(buf.shape, dtype=buf.dtype))
        fake_example = torch.empty(example.shape, dtype=example.dtype)
    step = _Step(stack, state, opt, schedule, fake)
    step.excluded.add(fake_example.untyped_storage()._cdata)
    step.run(fake_example, loss if loss is not None else (lambda y: y.sum()))
    gather, reduce = schedule.traffic(
        [[(g.layout.padded_numel, g.trainable, opt.gather_bytes(g)) for g in layer.groups]
         for layer in stack], reduce_bytes=opt.reduce_bytes)
    device_tensors = sum(v for k, v in step.peak.items()
                         if device == "cpu" or k not in state.on_host)
    headroom = (CUDA_FIXED_HEADROOM + int(CUDA_HEADROOM_FRACTION * device_tensors)
                if device == "cuda" else 0)
    host = (sum(v for k, v in step.peak.items() if k in state.on_host)
            if device == "cuda" else 0)
    return MemoryPlan(
        world_size=world_size, device=device, state=state, peak=step.peak,
        peak_phase=step.peak_phase, gathered_peak=step.gathered_peak,
        activations_peak=step.activations_peak, host_peak=host, headroom=headroom,
        all_gather_bytes=gather * micro_batches, reduce_scatter_bytes=reduce * micro_batches,
        recomputed_layers=tuple(l.index for l in stack if l.recompute))
