"""``zerocore.shard_model``: shards a whole model in place — a Hugging Face causal LM as it is,
PEFT-wrapped or not — by units the caller names (its decoder layers); every parameter no single
unit owns belongs to the root unit. The model keeps its class, ``forward``, ``generate`` and
module tree; only where its parameters live changes.

How a unit runs (docs/decisions.md, "shard_model"):
- forward: a forward pre-hook on the unit's module gathers its flat groups (the next unit in
  the previous forward's order is prefetched) and installs unsharded views as the modules'
  attributes; a forward hook frees them after it ran. The forward itself is the module's own,
  with any arguments and any nesting of outputs.
- the trainable views are the outputs of one autograd node per call (``UnitParams``), whose
  input is the trainable shard: autograd hands it every parameter's gradient once all of them
  are computed, and it packs them and starts their reduce-scatter (``BackwardCoordinator``, the
  same as ``zerocore.shard``'s).
- backward: a gradient hook on the unit's outputs re-gathers the unit before the first of its
  operations runs backward (and prefetches the unit that ran before it); the unit is freed once
  its parameters' node and the gradient of its inputs (a hook on them) are both done: only then
  has every operation that saved a view of its weights, frozen ones included, run.
- the root unit (embeddings, final norm, head, and every parameter tied across units) is
  gathered by a pre-hook on the model (or on a module owning root parameters, when something
  calls an inner module directly, as PEFT's generate does) and stays gathered through the
  forward and, when a graph was built, through the backward: a first design, the root being
  needed at both ends of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from zerocore.comm.device import Platform
from zerocore.engine.compiled import plain_name, refuse_compiled_call
from zerocore.engine.flat_group import GroupState
from zerocore.engine.sharded_layer import Params, ShardedLayer
from zerocore.engine.sharding import (Sharding, agree_on_structure, fingerprint, groups_of,
                                      prepare_device, process_group)
from zerocore.policies import (Comm, Compile, FrozenWeights, MixedPrecision, Offload, Prefetch,
                               Recompute)

# Where a unit's shards are registered on its module (the root's: on the model), so that
# ``model.parameters()`` yields exactly what this rank owns, as for ``zerocore.shard``.
TRAINABLE_SHARD = "zerocore_trainable_shard"
FROZEN_SHARD = "zerocore_frozen_shard"
# The attribute of the model holding its ``ShardedModel`` (a plain object, not a submodule).
SHARDING_ATTR = "zerocore_sharding"


@dataclasses.dataclass(eq=False)
class Unit:
    """One unit of a sharded model: its module and its flat groups (``ShardedLayer``)."""

    name: str                 # the module's path in the model; "" for the root
    module: nn.Module         # the unit's module; the model itself for the root
    layer: ShardedLayer
    # The trainable shard's version when its group was last gathered: a group still gathered
    # after the optimizer changed the shard (a prefetch no forward used) is gathered afresh.
    gathered_version: int = -1
    active: int = 0           # calls of this unit whose backward has begun and not ended
    call: "UnitCall | None" = None  # the call in progress (between the two forward hooks)


@dataclasses.dataclass(eq=False)
class UnitCall:
    """One forward call of a unit that built a graph, until its backward is done."""

    unit: Unit
    previous: Unit | None     # the unit that ran before it in this forward: backward's next
    # Parts of the backward still to come before the unit may be freed: its parameters' node
    # and its inputs' gradient; None for the root (freed when the whole backward ends).
    waiting: int | None = 0
    started: bool = False


class UnitParams(torch.autograd.Function):
    """views = the unit's trainable parameters, as views of the gathered buffer. Its input is the
    trainable shard, so autograd calls backward with every parameter's gradient (None for one
    not used) once all are computed; it packs them and starts their reduce-scatter into the
    shard's ``.grad`` (so autograd receives None for the shard)."""

    @staticmethod
    def forward(ctx, sharded: "ShardedModel", call: UnitCall, shard: torch.Tensor):
        ctx.sharded, ctx.call = sharded, call
        ctx.set_materialize_grads(False)
        return tuple(call.unit.layer.trainable.views(requires_grad=False))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        sharded: ShardedModel = ctx.sharded
        call: UnitCall = ctx.call
        group = call.unit.layer.trainable
        coordinator = sharded.coordinator
        coordinator.queue_finish()
        pending = group.start_reduce_scatter(list(grads), coordinator.scratch_for(group))
        coordinator.after_layer_backward(pending)
        sharded.part_done(call)
        return None, None, None


def recomputing(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` keeping only its inputs when it builds a graph, run again in backward
    (``torch.utils.checkpoint``, non-reentrant: any arguments, the random-number state of the
    first run restored so dropout draws the same masks)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def assign_params(model: nn.Module, units: list[nn.Module]) -> tuple[list[Params], Params]:
    """Each unit's parameters, and the root's: a parameter reached only through one unit is that
    unit's; one also reached outside every unit, or through two units (tied weights), is the
    root's, once. Names are the model's (as ``named_parameters`` gives them); every (module,
    attribute) holding the parameter is kept, to install its views there."""
    unit_index = {id(u): i for i, u in enumerate(units)}
    places: dict[int, set[int]] = {}
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    seen: set[tuple[int, str]] = set()
    # Every path to every module: a module shared by a unit and the rest of the model appears
    # on a path through the unit and on one outside it, which makes its parameters the root's.
    stack: list[tuple[str, nn.Module, int]] = [("", model, -1)]
    while stack:  # depth first, children in order: the order of ``named_parameters``
        path, mod, where = stack.pop()
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            places.setdefault(id(p), set()).add(where)
            if (id(mod), attr) not in seen:
                seen.add((id(mod), attr))
                name = plain_name(f"{path}.{attr}" if path else attr)
                found.setdefault(id(p), (name, p, []))[2].append((mod, attr))
        for child_name, child in reversed(mod._modules.items()):
            if child is not None:
                child_path = f"{path}.{child_name}" if path else child_name
                stack.append((child_path, child, unit_index.get(id(child), where)))
    per_unit: list[Params] = [[] for _ in units]
    root: Params = []
    for key, entry in found.items():
        where = places[key]
        if len(where) == 1 and -1 not in where:
            per_unit[next(iter(where))].append(entry)
        else:
            root.append(entry)
    return per_unit, root


class ShardedModel(Sharding):
    """The sharding of a model by ``zerocore.shard_model``: its units, their flat groups and
    the hooks that gather and free them. ``model.zerocore_sharding`` holds it; the model keeps
    working as before (``forward``, ``generate``) with 1/N of its parameters per rank.

    ``layers`` (the units in the order given, then the root) is what checkpoints index:
    ``save_checkpoint``/``load_checkpoint`` take the model or this object. What it shares with
    ``zerocore.shard``'s model (reports, full states, release, the units kept gathered) is
    ``Sharding``'s.
    """

    front_door = "zerocore.shard_model"

    def __init__(self, model: nn.Module, units: list[nn.Module], *, group: dist.ProcessGroup,
                 device: torch.device, mixed_precision: MixedPrecision, prefetch: Prefetch,
                 offload: Offload, frozen_weights: FrozenWeights, comm: Comm = Comm(),
                 recompute: Recompute | None = None, compile: Compile | None = None,
                 host_threads: int | None = None):
        super().__init__(group, device, mixed_precision=mixed_precision, prefetch=prefetch,
                         offload=offload, recompute=recompute, frozen_weights=frozen_weights,
                         comm=comm, compile=compile, host_threads=host_threads)
        self.model = model
        targets = _parametrized_each_forward(model)  # before the parameters are taken out
        per_unit, root_params = assign_params(model, units)
        names = {id(m): n for n, m in model.named_modules()}
        agree_on_structure(0, len(units), group, device,
                           what="zerocore.shard_model: the number of units")
        self.units: list[Unit] = []
        for i, (module, params) in enumerate(zip(units + [model], per_unit + [root_params])):
            what = "the root unit" if module is model else f"unit {i} ({names[id(module)]})"
            agree_on_structure(i, fingerprint((n, p) for n, p, _ in params), group, device,
                               what=f"zerocore.shard_model: {what}")
            if module is not model:
                refuse_compiled_call(module, what)  # it would compile the hooks below
            # Compile: each unit's forward (the hooks stay eager); the root is the model.
            layer = self.new_layer(module, i, params=params, compiled=module is not model)
            self.units.append(Unit("" if module is model else names[id(module)], module, layer))
        self.root = self.units[-1]
        self.layers: list[ShardedLayer] = [u.layer for u in self.units]
        if not any(l.groups for l in self.layers):
            raise ValueError("zerocore.shard_model: the model has no parameters to shard")
        # Parameters that PEFT parametrizes around every forward (``LoraConfig(
        # target_parameters=...)``, e.g. 3-D MoE expert weights): torch.nn.utils.parametrize
        # needs the name registered on the module, as a parameter or a buffer, each time. Their
        # views are installed as non-persistent buffers, so it finds them (and state_dict does
        # not hold them); every other view stays a plain attribute.
        for mod, attr in targets:
            mod.register_buffer(attr, None, persistent=False)
        for layer in self.layers:
            layer.own_versions.update((id(mod), attr) for mod, attr in targets)
        # Registered only now: the root's ``module.to(device)`` above must not move them.
        for unit in self.units:
            for attr, shard in ((TRAINABLE_SHARD, unit.layer.trainable_shard),
                                (FROZEN_SHARD, unit.layer.frozen_shard)):
                if shard is not None:
                    unit.module.register_parameter(attr, shard)
        # Recompute's positions are the units' (the root, needed at both ends, never is).
        self.coordinator = self.seal(self.layers, on_finish=self._backward_ended,
                                     recomputable=len(units))
        # Recomputed units run their own forward under torch's non-reentrant activation
        # checkpointing, inside the unit's hooks (as transformers' gradient checkpointing does):
        # the recomputation runs in backward after the unit's backward hook gathered it again.
        self._recomputed: list[nn.Module] = []
        for unit in self.units[:-1]:
            if unit.layer.recompute:
                if "forward" in vars(unit.module) and compile is None:
                    raise ValueError(f"zerocore.shard_model: unit {unit.name} has a forward "
                                     f"of its own set on the instance; Recompute wraps the "
                                     f"module's forward, so it cannot recompute this unit")
                unit.module.forward = recomputing(unit.module.forward)
                self._recomputed.append(unit.module)
        # Forward prefetch: the order units ran in the previous forward (the order given
        # before the first), and the order of the one in progress.
        self._order_before: list[Unit] = self.units[:-1]
        self._order_now: list[Unit] = []
        self._depth = 0           # model forwards in progress (its pre-hook ran, not its hook)
        self._kept: list[Unit] = []  # kept gathered by the last forward for its backward
        # Units that stay gathered until a ``gathered()`` block ends (None: outside one).
        self._held: set[int] | None = None
        self._handles = []
        for unit in self.units[:-1]:
            self._handles.append(unit.module.register_forward_pre_hook(
                self._unit_hook_pre(unit), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                self._unit_hook_post(unit), with_kwargs=True))
        self._handles.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._root_post, with_kwargs=True))
        owners = {id(m): m for _, _, os in root_params for m, _ in os if m is not model}
        for mod in owners.values():
            self._handles.append(mod.register_forward_pre_hook(self._root_owner_pre))

    # -- gathering ---------------------------------------------------------------------------

    def _start(self, unit: Unit) -> None:
        trainable = unit.layer.trainable
        if trainable is not None and trainable.state is GroupState.SHARDED:
            unit.gathered_version = trainable.shard._version
        unit.layer.start_gather()

    def _ready(self, unit: Unit) -> None:
        """Gathers the unit (waiting for a prefetch in flight); values gathered before the
        optimizer changed the shard are gathered again."""
        trainable = unit.layer.trainable
        if (trainable is not None and trainable.state is not GroupState.SHARDED
                and unit.gathered_version != trainable.shard._version and unit.active == 0):
            unit.layer.free()
        self._start(unit)
        unit.layer.wait_gather()

    def _install(self, unit: Unit, with_graph: bool) -> UnitCall | None:
        """Installs the unit's views; with a graph, its trainable ones through ``UnitParams``,
        returning the call that tracks its backward."""
        layer = unit.layer
        if not with_graph:
            layer.install(with_grad_leaves=False)
            return None
        call = UnitCall(unit, self._order_now[-2] if len(self._order_now) > 1 else None,
                        waiting=None if unit is self.root else 0)
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
        self._ready(unit)
        before = self._order_before
        if (self.schedule.prefetch_forward and position + 1 < len(before)
                and before[position] is unit
                and before[position + 1] is not unit):
            self._start(before[position + 1])
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        with_graph = torch.is_grad_enabled() and (unit.layer.trainable is not None
                                                  or bool(inputs))
        call = self._install(unit, with_graph)
        unit.call = call
        if call is not None and inputs:
            call.waiting += 1
            register_multi_grad_hook(inputs, lambda grads: self.part_done(call), mode="all")

    def _after_unit(self, unit: Unit, output: Any) -> None:
        call, unit.call = unit.call, None
        outputs = ([t for t in _tensors(output) if t.requires_grad] if call is not None else [])
        if outputs:
            register_multi_grad_hook(outputs, lambda grad: self._backward_begins(call),
                                     mode="any")
            last = self._order_before[-1] if self._order_before else None
            if self.schedule.keeps_for_backward(unit.layer.index, last=unit is last):
                # Kept gathered for its backward (then freed; resident frozen groups stay):
                # the first unit backward needs, and those Prefetch.keep_gathered chose. If no
                # backward comes, the next forward frees it.
                self._kept.append(unit)
                return
        self._free_unless_held(unit)

    def _backward_begins(self, call: UnitCall) -> None:
        """The first gradient reached one of the unit's outputs: gather it again before its
        operations run backward; prefetch the unit that ran before it."""
        call.started = True
        call.unit.active += 1
        previous = call.previous.layer if call.previous is not None else None
        self.coordinator.before_layer_backward(call.unit.layer, previous)

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

    def _new_forward(self) -> None:
        if self._order_now:
            self._order_before = self._order_now
        self._order_now = []
        for unit in self._kept:
            if unit.active == 0:
                unit.layer.free()
        self._kept = []

    def _enter_root(self) -> None:
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
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if outputs:
            # Backward needs the root from its first operation (the head) to its last (the
            # embedding): gathered throughout, freed when it ends (the coordinator's finish).
            root = self.root
            register_multi_grad_hook(
                outputs, lambda grad: self.coordinator.before_layer_backward(root.layer, None),
                mode="any")
        else:
            self._free_unless_held(self.root)

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
        """Within the block, a unit gathered for a forward stays gathered until the block ends,
        so ``model.generate(...)`` gathers each unit once for the whole call instead of once
        per new token (ZeRO-3's known generation slowdown); the tokens are the same, bit for
        bit (the same gathered values). Collective in effect: every rank must run the same
        forwards inside, as always. ``max_bytes`` bounds what is held: the units in their order,
        then the root, while their gathered bytes fit (the rest gather per forward as usual);
        None holds every unit (the whole model's parameters in the param dtype, per rank).
        Forwards inside must not build a graph (``generate`` runs under ``torch.no_grad``):
        one that would is refused, since its backward would free what the block holds. The
        optimizer must not step inside."""
        if self._held is not None:
            raise RuntimeError("zerocore: ShardedModel.gathered() is already active; nest "
                               "nothing inside it")
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

    def _free_unless_held(self, unit: Unit) -> None:
        if self._held is None or id(unit) not in self._held:
            unit.layer.free()

    def _refuse_graph_while_held(self) -> None:
        if self._held is not None and torch.is_grad_enabled():
            raise RuntimeError("zerocore: a forward with autograd enabled inside "
                               "ShardedModel.gathered(), which holds units gathered for "
                               "generation only; run it under torch.no_grad() (generate() "
                               "does), or outside the block")

    # -- for optimizers, checkpoints and exports ------------------------------------------

    def full_state_dict(self, trainable_only: bool = False, *, to_rank: int | None = 0
                        ) -> dict[str, torch.Tensor]:
        """Collective: the model's parameters under its own names (``named_parameters`` of the
        unsharded model; a tied parameter once, under its first name), gathered unit by unit
        onto ``to_rank`` (default 0; None: every rank). What ``save_pretrained(dir,
        state_dict=...)`` writes, on the rank that writes it."""
        out: dict[str, torch.Tensor] = {}
        for _, state in self.iter_full_states(trainable_only, to_rank=to_rank):
            out.update(state)
        return out

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every shard this rank holds (trainable, then frozen, unit by unit): what
        ``model.parameters()`` yields too."""
        return self.shards()

    def expected_traffic(self) -> tuple[int, int]:
        """(bytes all-gathered, bytes reduce-scattered) one step should move: the units as
        ``zerocore.shard``'s layers (every unit is in backward when the root trains, the
        embedding being its first operation), the root once (``Schedule.traffic``)."""
        root = self.layers[-1]
        return self.schedule.traffic(
            [groups_of(l) for l in self.layers[:-1]],
            reduce_bytes=self.mixed_precision.grad_reduce_dtype.itemsize,
            input_requires_grad=root.trainable is not None, root=groups_of(root))

    def remove(self) -> None:
        """Removes the hooks and the forwards Recompute and Compile gave the units (the model
        can no longer run: its parameters stay sharded)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self._recomputed + ([u.module for u in self.units[:-1]]
                                          if self.compile is not None else []):
            if "forward" in vars(module):
                del module.forward  # the class's own again, neither recomputed nor compiled
        self._recomputed = []


def sharding_of(model: nn.Module | ShardedModel) -> ShardedModel:
    """The ``ShardedModel`` of a model sharded by ``shard_model`` (or the object itself)."""
    if isinstance(model, ShardedModel):
        return model
    sharding = getattr(model, SHARDING_ATTR, None) if isinstance(model, nn.Module) else None
    if not isinstance(sharding, ShardedModel):
        raise TypeError(f"{type(model).__name__} was not sharded by zerocore.shard_model "
                        f"(nor is it a zerocore.shard model)")
    return sharding


def _parametrized_each_forward(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of each parameter a PEFT ``ParamWrapper`` (LoRA on a parameter,
    ``target_parameters``) parametrizes for the duration of every forward: a module naming
    ``parameter_name`` on the base layer it wraps."""
    out = []
    for mod in model.modules():
        name = getattr(mod, "parameter_name", None)
        base = getattr(mod, "get_base_layer", None)
        if isinstance(name, str) and callable(base):
            target = base()
            p = target._parameters.get(name)
            if p is not None and p.requires_grad:
                raise ValueError(f"zerocore.shard_model: {type(target).__name__}.{name} is "
                                 f"parametrized by PEFT (target_parameters) and also trainable; "
                                 f"only frozen parametrized weights can be sharded (PEFT "
                                 f"freezes them unless told otherwise)")
            out.append((target, name))
    return out


def _refuse_parametrized(model: nn.Module) -> None:
    """Parametrizations registered before sharding (torch.nn.utils.parametrize: weight norm,
    orthogonal, a PEFT merge in progress) compute a parameter from originals on every access;
    sharding would replace the originals under them. Refused, in one line, up front."""
    for name, mod in model.named_modules():
        if parametrize.is_parametrized(mod):
            what = ", ".join(sorted(mod.parametrizations.keys()))
            raise ValueError(f"zerocore.shard_model: {name or 'the model'} has parametrized "
                             f"parameters ({what}, torch.nn.utils.parametrize), which cannot be "
                             f"sharded; remove the parametrizations (parametrize."
                             f"remove_parametrizations) before sharding")


def unit_modules(model: nn.Module, units: Any) -> list[nn.Module]:
    if isinstance(units, nn.Module) and not isinstance(units, (nn.ModuleList, nn.Sequential)):
        units = [units]
    try:
        units = list(units)
    except TypeError:
        raise TypeError(f"zerocore.shard_model: units must be an nn.ModuleList or a list of "
                        f"submodules of the model, got {type(units).__name__}") from None
    inside = {id(m) for m in model.modules()}
    seen: set[int] = set()
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"zerocore.shard_model: units[{i}] is a {type(unit).__name__}, not "
                            f"an nn.Module")
        if unit is model:
            raise ValueError("zerocore.shard_model: the model itself cannot be a unit (it is "
                             "the root unit already); name its layers, e.g. "
                             "model.model.layers")
        if id(unit) not in inside:
            raise ValueError(f"zerocore.shard_model: units[{i}] ({type(unit).__name__}) is not "
                             f"a submodule of the model")
        if id(unit) in seen:
            raise ValueError(f"zerocore.shard_model: units[{i}] is given twice")
        seen.add(id(unit))
    for i, unit in enumerate(units):
        nested = [j for j, other in enumerate(units)
                  if other is not unit and any(m is unit for m in other.modules())]
        if nested:
            raise ValueError(f"zerocore.shard_model: units[{i}] lies inside units{nested}; "
                             f"units must not nest")
    return units


def shard_model(model: nn.Module, units: Iterable[nn.Module] | nn.Module = (), *,
                group: dist.ProcessGroup | None = None,
                device: torch.device | str | None = None,
                mixed_precision: MixedPrecision = MixedPrecision(),
                prefetch: Prefetch = Prefetch(), offload: Offload = Offload(),
                frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
                recompute: Recompute | None = None, compile: Compile | None = None,
                platform: Platform | None = None) -> ShardedModel:
    """Shards ``model`` in place across the ranks of a process group (ZeRO-3), unit by unit.

    model: any module, e.g. a ``transformers`` causal LM, or a PEFT model around one; the same
        on every rank (structure, values, which parameters ``requires_grad``). It keeps its
        class, ``forward``, ``generate`` and module tree: each parameter becomes a view of a
        gathered buffer while its unit runs; ``model.parameters()`` yields this rank's flat
        shards (``zerocore_trainable_shard``/``zerocore_frozen_shard`` on each unit's module
        and on the model), for ``zerocore.optim.AdamW``.
    units: the modules gathered and freed one at a time, typically the decoder layers
        (``model.gpt_neox.layers``, ``model.model.layers``, ``peft_model.base_model.model.
        model.layers``): an ``nn.ModuleList`` or a list of submodules, none inside another.
        Their forward may take any arguments and return any nesting of tensors and other
        objects (a KV cache, say), with or without grad. Every parameter not owned by exactly
        one unit (embeddings, final norm, head, weights tied between units or with the root)
        forms the root unit, gathered for the model's whole forward (and backward).
    group, device, mixed_precision, prefetch, offload, frozen_weights, comm, recompute, platform:
        as for ``zerocore.shard``; ``Recompute``'s positions are the units' (the root is never
        recomputed). ``Prefetch.keep_gathered`` chooses from the root first (its frozen
        group, e.g. the embedding, then stays gathered from step to step), then the last units.
    compile: ``zerocore.Compile(...)``: each unit's forward is compiled with torch.compile,
        the engine's hooks around it staying eager (not ``unit.compile()``, refused: it would
        compile the hooks too). ``torch.compile(unit)`` in the unit's place works as well.
    Returns the ``ShardedModel`` (also ``model.zerocore_sharding``): ``.group``,
    ``.full_state_dict()``, ``.memory_report()``; ``save_checkpoint``/``load_checkpoint`` take
    the model or it.
    """
    group = process_group(group, "zerocore.shard_model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"zerocore.shard_model expects an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, SHARDING_ATTR, None), ShardedModel):
        raise ValueError("zerocore.shard_model: this model is sharded already")
    _refuse_parametrized(model)
    unit_list = unit_modules(model, units)
    dev, host_threads = prepare_device(device, group, offload, platform)
    sharding = ShardedModel(model, unit_list, group=group, device=dev,
                            mixed_precision=mixed_precision, prefetch=prefetch, offload=offload,
                            frozen_weights=frozen_weights, comm=comm, recompute=recompute,
                            compile=compile, host_threads=host_threads)
    setattr(model, SHARDING_ATTR, sharding)
    return sharding
