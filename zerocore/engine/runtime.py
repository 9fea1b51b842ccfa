"""The runtime: how every layer of a sharded model is gathered, run, recomputed, reduced and freed,
the same for both front doors (``zerocore.shard``'s stack and ``zerocore.shard_model``'s units).

It is a set of hooks on the model's own modules (docs/decisions.md, "One runtime"):
- forward: a forward pre-hook on a unit's module gathers its flat groups (and starts the gather of
  the unit that came next in the previous forward: forward prefetch) and installs unsharded views
  as the modules' attributes; a forward hook frees them after it ran, unless the schedule keeps
  the unit for its backward. The forward itself is the module's own, with any arguments and any
  nesting of outputs; a recomputed unit's forward runs under torch's checkpoint (recompute.py).
- the trainable views are the outputs of one autograd node per call (``UnitParams``), whose input
  is the trainable shard: autograd hands it every parameter's gradient once all are computed, and
  it packs them and starts their reduction (``BackwardCoordinator``).
- backward: a gradient hook on the unit's outputs gathers the unit again before the first of its
  operations runs backward (and prefetches the unit that ran before it); the unit is freed once
  its parameters' node and the gradient of its inputs (a hook on them) are both done: only then
  has every operation that saved a view of its weights, frozen ones included, run.
- the root unit (every parameter no single unit owns: embeddings, head, weights tied across
  units) is gathered by a pre-hook on the model (or on a module owning root parameters, when
  something calls an inner module directly, as PEFT's generate does) and stays gathered through
  the forward and, when a graph was built, through the backward: it is needed at both ends.

``Runtime`` holds the state of these hooks; ``Sharding`` (sharding.py) holds what does not depend
on how layers run. ``zerocore.plan`` runs this same runtime on fake tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils import _pytree as pytree

from zerocore.comm.lockstep import Lockstep
from zerocore.engine.backward import BackwardCoordinator
from zerocore.engine.flat_group import GroupState
from zerocore.engine.recompute import recomputing
from zerocore.engine.schedule import Schedule
from zerocore.engine.sharded_layer import ShardedLayer
from zerocore.engine.sharded_param import shard_stamp
from zerocore.engine.tracing import traced


@dataclasses.dataclass(eq=False)
class Unit:
    """One unit of a sharded model: the module its hooks are on and its flat groups."""

    name: str                 # the module's path in the model; "" for the root
    module: nn.Module         # the unit's module; the model itself for the root
    layer: ShardedLayer
    # The trainable shard's version when its group was last gathered: a group still gathered
    # after the optimizer changed the shard (a prefetch no forward used) is gathered afresh.
    gathered_version: tuple[int, int] | None = None  # shard_stamp when gathered
    active: int = 0           # calls of this unit whose backward has begun and not ended
    call: "UnitCall | None" = None  # the call in progress (between the two forward hooks)


class UnitCall:
    """One forward call of a unit that built a graph, until its backward is done.

    Autograd holds it (the parameters' node, gradient hooks), and autograd's nodes are objects
    Python's collector cannot see into: a path from one back to the model would keep the model
    alive for good (the unit's module holds its installed views, whose node is this call's),
    so the call holds its units only weakly; the runtime holds them."""

    def __init__(self, unit: Unit, previous: Unit | None, waiting: int | None,
                 micro_batch: int = 0):
        self._unit = weakref.ref(unit)
        # the unit that built a graph before it in this forward
        self._previous = None if previous is None else weakref.ref(previous)
        # Parts of the backward still to come before the unit may be freed: its parameters'
        # node and its inputs' gradient; None for the root (freed when the whole backward ends).
        self.waiting = waiting
        self.started = False
        self.micro_batch = micro_batch  # of the forward that made it (its backward's)

    @property
    def unit(self) -> Unit:
        return self._unit()

    @property
    def previous(self) -> Unit | None:
        return None if self._previous is None else self._previous()


def _weakly(method: Callable[..., None], *args: Any) -> Callable[..., None]:
    """``method(*args, *more)`` when called with ``more``, while its object lives; nothing once
    it is gone: what autograd keeps (a gradient hook, a node's context) must not keep the
    runtime, hence the model, alive (see ``UnitCall``)."""
    ref = weakref.WeakMethod(method)

    def call(*more: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, *more)
    return call


class UnitParams(torch.autograd.Function):
    """views = the unit's trainable parameters, as views of the gathered buffer. Its input is the
    trainable shard, so autograd calls backward with every parameter's gradient (None for one
    not used) once all are computed; it packs them and starts their reduction into the shard's
    ``.grad`` (so autograd receives None for the shard)."""

    @staticmethod
    def forward(ctx, runtime: "Runtime", call: UnitCall, shard: torch.Tensor):
        # Weakly (see UnitCall): a graph kept after its model was dropped holds no engine.
        ctx.params_done = _weakly(runtime.params_done, call)
        ctx.set_materialize_grads(False)
        return tuple(call.unit.layer.trainable.views(requires_grad=False))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.params_done(list(grads))
        return None, None, None


def _requiring_grad(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` that require grad. A single tensor, the common case (a layer of
    ``zerocore.shard``), is answered without flattening."""
    if isinstance(tree, torch.Tensor):
        return [tree] if tree.requires_grad else []
    return [t for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.requires_grad]


class GradientCalls:
    """Calls made when backward reaches tensors (``on``), for one forward. One tensor, the common
    case, takes a plain tensor hook, which is what the multi-gradient hook amounts to then; and
    a tensor that already has one (a layer's output, which the next layer takes as its input:
    the output's "backward begins" and the input's "gradient done" are one event) gets its
    call added to that hook's list instead of a second hook: a hook costs about 10 µs to
    register, a layer's host budget being a few hundred."""

    def __init__(self) -> None:
        # id of a tensor hooked in this forward -> (a weak reference to it, its calls).
        self._calls: dict[int, tuple[weakref.ref, list[Callable[[], None]]]] = {}

    def on(self, tensors: list[torch.Tensor], fn: Callable[[], None], mode: str) -> None:
        """``fn()`` when the first of the tensors' gradients is computed (``mode="any"``) or
        once all are (``"all"``)."""
        if len(tensors) != 1:
            register_multi_grad_hook(tensors, lambda grads: fn(), mode=mode)
            return
        t = tensors[0]
        known = self._calls.get(id(t))
        if known is not None and known[0]() is t:
            known[1].append(fn)
            return
        calls = [fn]

        def hook(grad: torch.Tensor) -> None:
            for call in calls:
                call()
        t.register_hook(hook)
        self._calls[id(t)] = (weakref.ref(t), calls)

    def new_forward(self) -> None:
        self._calls = {}


class Runtime:
    """The hooks that run a sharded model's units (see the module's docstring), and their state.

    units: the units in the order their layers are indexed, then the root (the model's own
    module; a unit without groups when no parameter is the root's). mirrors: the trainable
    groups keep device mirrors of host model copies (``Offload(optimizer=True)`` alone)."""

    def __init__(self, model: nn.Module, units: list[Unit], schedule: Schedule,
                 lockstep: Lockstep, *,
                 mirrors: bool, root_owners: list[nn.Module],
                 staging: list[torch.Tensor] | None = None):
        self.model = model
        self.units = units
        self.root = units[-1]
        self.schedule = schedule
        # Told where the step is (a forward, with or without autograd; a backward, of which
        # micro-batch), which every gather and reduction then says to the other ranks.
        self.lockstep = lockstep
        # Optimizer offload keeps device mirrors of the host's model copies, all uploaded when
        # a forward starts (parameter offload uploads each gather's own window instead).
        self.mirrors = mirrors
        self.coordinator = BackwardCoordinator([u.layer for u in units],
                                               schedule.prefetch_backward,
                                               on_finish=self._backward_ended,
                                               staging=staging)
        # Forward prefetch: the order units ran in the previous forward (the order given
        # before the first), and the order of the one in progress.
        self._order_before: list[Unit] = units[:-1]
        self._order_now: list[Unit] = []
        self._last_graph: Unit | None = None  # the last unit of this forward to build a graph
        # Where the step is: ("forward" or "backward", the unit's layer index), for a plan's
        # account of when its peak falls (zerocore.plan); the last unit a hook ran for.
        self.where: tuple[str, int] = ("", -1)
        self._depth = 0           # model forwards in progress (its pre-hook ran, not its hook)
        self._kept: list[Unit] = []  # kept gathered by the last forward for its backward
        self._gradients = GradientCalls()  # this forward's calls on tensors' gradients
        # Units that stay gathered until a ``gathered()`` block ends (None: outside one).
        self._held: set[int] | None = None
        # Recomputed units run their forward under torch's checkpoint (recompute.py), inside
        # the hooks: the recomputation runs in backward after the unit's gradient hook gathered
        # it again. The forward they had as an instance attribute (a compiled one, say) is kept
        # to be given back by ``remove``.
        self._recomputed: list[tuple[nn.Module, Any]] = []
        for unit in units[:-1]:
            if unit.layer.recompute:
                own = vars(unit.module).get("forward")
                unit.module.forward = recomputing(unit.module.forward)
                self._recomputed.append((unit.module, own))
        self._handles = []
        for unit in units[:-1]:
            self._handles.append(unit.module.register_forward_pre_hook(
                self._unit_hook_pre(unit), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                self._unit_hook_post(unit), with_kwargs=True))
        self._handles.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._root_post, with_kwargs=True))
        for mod in root_owners:
            self._handles.append(mod.register_forward_pre_hook(self._root_owner_pre))

    # -- gathering ---------------------------------------------------------------------------

    def _start(self, unit: Unit) -> None:
        trainable = unit.layer.trainable
        if trainable is not None and trainable.state is GroupState.SHARDED:
            unit.gathered_version = shard_stamp(trainable.shard)
        unit.layer.start_gather()

    def _ready(self, unit: Unit) -> None:
        """Gathers the unit (waiting for a prefetch in flight); values gathered before the
        optimizer changed the shard are gathered again."""
        trainable = unit.layer.trainable
        if (trainable is not None and trainable.state is not GroupState.SHARDED
                and unit.gathered_version != shard_stamp(trainable.shard)
                and unit.active == 0):
            unit.layer.free()
        self._start(unit)
        unit.layer.wait_gather()

    def _install(self, unit: Unit, with_graph: bool) -> UnitCall | None:
        """Installs the unit's views; with a graph, its trainable ones through ``UnitParams``,
        returning the call that tracks its backward. Without one, the trainable views are
        leaves that require grad all the same: torch chooses some kernels by whether a weight
        requires grad (a Linear on a non-contiguous 3-D input), so views that did not would
        compute other bits than training and than the unsharded model, whose parameters
        require grad whatever the grad mode."""
        layer = unit.layer
        if not with_graph:
            layer.install(with_grad_leaves=True)
            return None
        is_root = unit is self.root
        call = UnitCall(unit, None if is_root else self._last_graph,
                        waiting=None if is_root else 0,
                        micro_batch=self.lockstep.micro_batch)
        views = None
        if layer.trainable is not None:
            views = UnitParams.apply(self, call, layer.trainable_shard)
            if call.waiting is not None:
                call.waiting += 1
        layer.install(with_grad_leaves=False, trainable_views=views)
        return call

    # -- the hooks -----------------------------------------------------------------------------

    def _unit_hook_pre(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._before_unit(unit, args, kwargs)
        return hook

    def _unit_hook_post(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self._after_unit(unit, output)
        return hook

    def _before_unit(self, unit: Unit, args: tuple, kwargs: dict) -> None:
        self._refuse_graph_while_held()
        if self._depth == 0 and self._order_now and unit is self._order_now[0]:
            self._new_forward()  # a forward through an inner module (no model pre-hook)
        position = len(self._order_now)
        self._order_now.append(unit)
        self.where = ("forward", unit.layer.index)
        self._ready(unit)
        before = self._order_before
        if (self.schedule.prefetch_forward and position + 1 < len(before)
                and before[position] is unit
                and before[position + 1] is not unit):
            self._start(before[position + 1])
        inputs = _requiring_grad(args[0] if len(args) == 1 and not kwargs else (args, kwargs))
        with_graph = torch.is_grad_enabled() and (unit.layer.trainable is not None
                                                  or bool(inputs))
        call = self._install(unit, with_graph)
        unit.call = call
        if call is not None:
            self._last_graph = unit
            if inputs:
                call.waiting += 1
                self._gradients.on(inputs, _weakly(self.part_done, call), mode="all")

    def _after_unit(self, unit: Unit, output: Any) -> None:
        call, unit.call = unit.call, None
        outputs = _requiring_grad(output) if call is not None else []
        if outputs:
            self._gradients.on(outputs, _weakly(self._backward_begins, call), mode="any")
            last = self._order_before[-1] if self._order_before else None
            if self.schedule.keeps_for_backward(unit.layer.index, last=unit is last):
                # Kept gathered for its backward (then freed; resident frozen groups stay):
                # the first unit backward needs, and those Prefetch.keep_gathered chose. If no
                # backward comes, the next forward frees it.
                self._kept.append(unit)
                return
            # Backward gathers it again: hpZ keeps its secondary shards for that gather.
            self._free_unless_held(unit, keep_secondary=True)
            return
        self._free_unless_held(unit)

    def _backward_begins(self, call: UnitCall) -> None:
        """The first gradient reached one of the unit's outputs: gather it again before its
        operations run backward; prefetch the unit that built a graph before it."""
        call.started = True
        call.unit.active += 1
        self.where = ("backward", call.unit.layer.index)
        self.lockstep.backward_begins(call.micro_batch)
        previous = call.previous.layer if call.previous is not None else None
        self.coordinator.before_layer_backward(call.unit.layer, previous)

    def params_done(self, call: UnitCall, grads: list[torch.Tensor | None]) -> None:
        """``UnitParams.backward``: every parameter's gradient of the call is there; packed
        and reduced, and one part of the call's backward is done."""
        layer = call.unit.layer
        coordinator = self.coordinator
        coordinator.queue_finish()
        with traced("reduce", layer.index):
            pending = layer.trainable.start_reduce_scatter(
                grads, coordinator.scratch_for(layer.trainable))
        coordinator.after_layer_backward(pending)
        self.part_done(call)

    def part_done(self, call: UnitCall) -> None:
        """One part of a unit call's backward (its parameters' gradients, its inputs'
        gradient) is done; after the last the unit is freed, unless another call of it is
        still running backward."""
        if call.waiting is None:
            return  # the root: freed when the whole backward ends
        call.waiting -= 1
        if call.waiting > 0:
            return
        unit = call.unit
        if call.started:
            call.started = False
            unit.active -= 1
        if unit.active == 0:
            unit.layer.free()

    def _backward_ended(self) -> None:
        # Every unit was freed (the coordinator's finish); calls whose backward did not reach
        # their end (a partial torch.autograd.grad) count no longer.
        for unit in self.units:
            unit.active = 0
        self.lockstep.backward_ended()

    def _new_forward(self) -> None:
        if self._order_now:
            self._order_before = self._order_now
        self._order_now = []
        self._last_graph = None
        self._gradients.new_forward()
        self.lockstep.forward_begins(grad=torch.is_grad_enabled())
        for unit in self._kept:
            # Kept by the previous forward: already freed if its backward ran; if not (and it
            # may never run), freed now and gathered afresh when next used (the trainable
            # weights may have changed since; resident frozen groups stay).
            if unit.active == 0:
                unit.layer.free()
        self._kept = []
        for unit in self.units:
            # hpZ's secondary shards kept by the previous forward for a backward that did not
            # run (and may never): given back (its backward, if it comes, gathers afresh).
            if unit.active == 0:
                unit.layer.drop_secondary()
        if self.mirrors:
            # Every upload the optimizer made necessary, at once: they overlap the first
            # units' gathers and computation, and each unit's all-gather waits for its own.
            for unit in self.units:
                if unit.layer.trainable is not None:
                    unit.layer.trainable.upload()

    def _enter_root(self) -> None:
        self.where = ("forward", self.root.layer.index)
        self._ready(self.root)
        self.root.call = self._install(self.root, torch.is_grad_enabled())

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._depth == 0:
            self._refuse_graph_while_held()  # before _depth counts a forward that never runs
        self._depth += 1
        if self._depth == 1:
            self._new_forward()
            self._enter_root()

    def _root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        self.root.call = None
        outputs = _requiring_grad(output)
        if outputs:
            # Backward needs the root from its first operation (the head) to its last (the
            # embedding): gathered throughout, freed when it ends (the coordinator's finish).
            micro_batch = self.lockstep.micro_batch
            self._gradients.on(outputs, _weakly(self._root_backward_begins, micro_batch),
                               mode="any")
        else:
            self._free_unless_held(self.root)

    def _root_backward_begins(self, micro_batch: int) -> None:
        self.where = ("backward", self.root.layer.index)
        self.lockstep.backward_begins(micro_batch)
        self.coordinator.before_layer_backward(self.root.layer, None)

    def _root_owner_pre(self, module: nn.Module, args: tuple) -> None:
        # A module owning root parameters called outside a forward of the model (an inner
        # model's generate, say): the root is gathered for it and stays so (gathered afresh
        # once the optimizer changed it; freed by the model's next forward or backward).
        if self._depth == 0:
            self._refuse_graph_while_held()
            self._enter_root()

    # -- generation ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, max_bytes: int | None = None) -> Iterator[None]:
        """See ``ShardedModel.gathered``."""
        if self._held is not None:
            raise RuntimeError("zerocore: gathered() is already active; nest nothing inside it")
        held, total = set(), 0
        for unit in self.units:
            size = unit.layer.gathered_size
            if max_bytes is None or total + size <= max_bytes:
                held.add(id(unit))
                total += size
        self._held = held
        try:
            yield
        finally:
            self._held = None
            for unit in self.units:
                if id(unit) in held and unit.active == 0:
                    unit.layer.free()

    def _free_unless_held(self, unit: Unit, keep_secondary: bool = False) -> None:
        if self._held is None or id(unit) not in self._held:
            unit.layer.free(keep_secondary=keep_secondary)

    def _refuse_graph_while_held(self) -> None:
        if self._held is not None and torch.is_grad_enabled():
            raise RuntimeError("zerocore: a forward with autograd enabled inside gathered(), "
                               "which holds units gathered for generation only; run it under "
                               "torch.no_grad() (generate() does), or outside the block")

    # -- the end -------------------------------------------------------------------------------

    def release(self) -> None:
        """Frees every gathered buffer, resident ones included (``Sharding.release_gathered``)."""
        for unit in self.units:
            unit.layer.release()
        self._kept = []

    def remove(self) -> None:
        """Removes the hooks, and gives recomputed units back the forward they had."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for module, own in self._recomputed:
            del module.forward
            if own is not None:
                module.forward = own
        self._recomputed = []
