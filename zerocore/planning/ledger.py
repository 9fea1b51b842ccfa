"""The bookkeeping of ``zerocore.plan``'s simulated step: every tensor a fake run creates and
frees (``LiveBytes``), and the engine's own buffers where the engine allocates and frees them
(``Ledger``); the peak is the largest sum at any point."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from zerocore.comm.transport import REDUCES
from zerocore.engine.schedule import Schedule
from zerocore.planning.memory_plan import (ACTIVATIONS, CATEGORIES, GATHERED, GRAD_BUFFERS,
                                           GRADIENTS, Group, Layer, ModelState, Options)


class LiveBytes(TorchDispatchMode):
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


class Ledger:
    """One optimizer step on fake tensors, recording the largest sum of the engine's buffers (a
    ledger, changed where the engine allocates and frees) and the tensors the layers and the
    loss create (followed by ``LiveBytes``). What both front doors' steps share: gathering,
    freeing, installing views, packing and handing over gradients; each simulation
    (``planning.stack``, ``planning.model``) says in which order."""

    def __init__(self, layers: list[Layer], state: ModelState, opt: Options,
                 schedule: Schedule, fake: FakeTensorMode):
        self.layers, self.opt, self.schedule, self.fake = layers, opt, schedule, fake
        self.state = state
        static = state.bytes_of()
        static[GRADIENTS] = 0   # shards appear in backward (and go with zero_grad)
        self.ledger = {c: static.get(c, 0) for c in CATEGORIES if c != ACTIVATIONS}
        self.grad_shard_bytes = {l.index: l.trainable.layout.shard_numel * 4
                                 for l in layers if l.trainable is not None}
        self.has_grad: set[int] = set()
        # The transport says what it holds (comm/transport.py): beside each reduction in
        # flight, and from step to step. What it keeps grows to the largest shard reduced in
        # the first step, so every later step, the one planned here, starts with it whole.
        self.way = REDUCES[opt.reduce_way]
        largest = max((l.trainable.layout.shard_numel * opt.reduce_bytes
                       for l in layers if l.trainable is not None), default=0)
        self.ledger[GRAD_BUFFERS] += self.way.kept_nbytes(largest)
        self.pending: tuple[Layer, int] | None = None  # the reduction in flight, its buffer
        self.spare: list[int] = []                     # CPU: packed buffers kept for reuse
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
        self.tracker = LiveBytes(excluded.__contains__)
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

    def _int8(self, g: Group) -> int:
        """Bytes of an int8 frozen group's gathered int8 parts (0 for other groups)."""
        int8 = self.opt.frozen_weights.int8_block is not None and not g.trainable
        return self.opt.gather_bytes(g) if int8 else 0

    def gather(self, layer: Layer) -> None:
        for g in layer.groups:
            key = (layer.index, g.trainable)
            if key not in self.gathered:
                self.gathered.add(key)
                self.ledger[GATHERED] += g.layout.padded_numel * self.opt.param_bytes
                if self._int8(g):   # received as int8, dequantized into the buffer
                    self.int8_held.add(key)
                    self.ledger[GATHERED] += self._int8(g)

    def free(self, layer: Layer) -> None:
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

    @staticmethod
    def views(g: Group) -> list[torch.Tensor]:
        """The group's parameters as views of its gathered buffer, in layout order."""
        assert g.buffer is not None
        return [g.buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
                for slot in g.layout.slots]

    def install(self, layer: Layer, with_grad_leaves: bool,
                trainable_views: tuple[torch.Tensor, ...] | None = None) -> list[torch.Tensor]:
        """Installs the layer's views in their owners' places; the trainable ones as leaves
        that take gradients (``with_grad_leaves``), or as given (``trainable_views``: the
        outputs of an autograd node, as ``shard_model``'s are). Returns the trainable views."""
        leaves: list[torch.Tensor] = []
        for g in layer.groups:
            views = self.views(g)
            if g.trainable and trainable_views is not None:
                views = list(trainable_views)
            elif g.trainable and with_grad_leaves:
                views = [v.detach().requires_grad_() for v in views]
            for view, owners in zip(views, g.owners):
                for mod, attr in owners:
                    setattr(mod, attr, view)
            if g.trainable:
                leaves = views
        return leaves

    @contextlib.contextmanager
    def event(self, phase: str) -> Iterator[None]:
        """The engine changes its buffers while fake work runs on around it (a hook): what the
        work held up to here is observed with the buffers as they were, then the change."""
        self._observe(phase, self.tracker.region_peak)
        yield
        self.tracker.start_region()
        self.point(phase)

    # the gradients' way (BackwardCoordinator)
    def pack(self, layer: Layer, label: str) -> int:
        """The layer's gradients packed for their reduction: the bytes of the packed buffer (0
        without a trainable group). On the CPU, BackwardCoordinator.scratch_for: a spare big
        enough, else a new one (the popped spare that is too small is dropped)."""
        group = layer.trainable
        if group is None:
            return 0
        need = group.layout.padded_numel * self.opt.reduce_bytes
        if self.opt.device == "cpu" and self.spare:
            reused = self.spare.pop()
            self.ledger[GRAD_BUFFERS] -= reused
            need = max(need, reused)
        self.ledger[GRAD_BUFFERS] += need + self._in_flight(layer)
        self.point(f"{label}backward of layer {layer.index}: gradients packed")
        return need

    def hand_over(self, layer: Layer, packed: int) -> None:
        """The reduction in flight completes (after_layer_backward: one at a time); this
        layer's, if it has one, takes its place."""
        if self.pending is not None:
            self._deliver(*self.pending)
        self.pending = (layer, packed) if layer.trainable is not None else None

    def end_backward(self, label: str) -> None:
        """BackwardCoordinator.finish: the last reduction delivered, every layer freed (but the
        resident), the spare buffers released."""
        if self.pending is not None:
            self._deliver(*self.pending)
            self.pending = None
        for layer in self.layers:
            self.free(layer)
        self.ledger[GRAD_BUFFERS] -= sum(self.spare)
        self.spare = []
        self.point(f"{label}end of backward")

    def _in_flight(self, layer: Layer) -> int:
        """What the transport holds beside the packed buffer while the layer's reduction is in
        flight (NCCL's reduce-scatter output, the exchange's received half)."""
        shard = layer.trainable.layout.shard_numel * self.opt.reduce_bytes
        return self.way.in_flight_nbytes(shard, gloo=self.opt.device == "cpu")

    def _deliver(self, layer: Layer, packed: int) -> None:
        """A reduce completes: the layer's gradient shard is created (first micro-batch) or
        added to; the transport's buffer in flight goes; the CPU keeps the packed buffer as a
        spare, a GPU frees it."""
        if layer.index not in self.has_grad:
            self.has_grad.add(layer.index)
            self.ledger[GRADIENTS] += self.grad_shard_bytes[layer.index]
            self.point(f"gradient shard of layer {layer.index} created")
        self.ledger[GRAD_BUFFERS] -= self._in_flight(layer)
        if self.opt.device == "cpu":
            self.spare.append(packed)
        else:
            self.ledger[GRAD_BUFFERS] -= packed


