"""``zerocore.shard_model``: shards a whole model in place — a Hugging Face causal LM as it is,
PEFT-wrapped or not — by units the caller names (its decoder layers); every parameter no single
unit owns belongs to the root unit. The model keeps its class, ``forward``, ``generate`` and
module tree; only where its parameters live changes.

Units run in the one runtime (runtime.py), as ``zerocore.shard``'s layers do: hooks on the
units' modules gather and free them, an autograd node per call reduces their gradients, and the
root unit (every parameter no single unit owns: embeddings, final norm, head, weights tied
across units) is gathered for the model's whole forward and backward. A model built on the meta
device is sharded with ``read=``: each rank reads only its shards' elements.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils import parametrize

from zerocore.comm import mesh as meshes
from zerocore.comm.device import Platform
from zerocore.comm.mesh import Mesh
from zerocore.engine.compiled import plain_name, refuse_compiled_call
from zerocore.engine.meta_layer import RangeReader
from zerocore.engine.rehearsal import Rehearsal
from zerocore.engine.runtime import Unit
from zerocore.engine.sharded_layer import Params, ShardedLayer
from zerocore.engine.sharding import (Hosts, Sharding, fingerprint, groups_of,
                                      prepare_device)
from zerocore.engine.synced_generation import (mark_synced_generation,
                                               unmark_synced_generation)
from zerocore.policies import (Comm, Compile, FrozenWeights, Hybrid, MixedPrecision, Offload,
                               Prefetch, Recompute)

# Where a unit's shards are registered on its module (the root's: on the model), so that
# ``model.parameters()`` yields exactly what this rank owns, as for ``zerocore.shard``.
TRAINABLE_SHARD = "zerocore_trainable_shard"
FROZEN_SHARD = "zerocore_frozen_shard"
# The attribute of the model holding its ``ShardedModel`` (a plain object, not a submodule).
SHARDING_ATTR = "zerocore_sharding"


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

    def __init__(self, model: nn.Module, units: list[nn.Module], *, mesh: Mesh,
                 device: torch.device, mixed_precision: MixedPrecision, prefetch: Prefetch,
                 offload: Offload, frozen_weights: FrozenWeights, comm: Comm = Comm(),
                 recompute: Recompute | None = None, compile: Compile | None = None,
                 host_threads: int | None = None, read: RangeReader | None = None,
                 rehearsal: Rehearsal | None = None, hybrid: Hybrid | None = None,
                 hosts: Hosts | None = None):
        """read: where the values of parameters on the meta device come from (``shard_model``'s
        ``read``), by the model's own names. rehearsal, hybrid, hosts: as ``Sharding`` takes
        them."""
        super().__init__(mesh, device, mixed_precision=mixed_precision, prefetch=prefetch,
                         offload=offload, recompute=recompute, frozen_weights=frozen_weights,
                         comm=comm, compile=compile, host_threads=host_threads,
                         rehearsal=rehearsal, hybrid=hybrid, hosts=hosts)
        self.model = model
        targets = _parametrized_each_forward(model)  # before the parameters are taken out
        per_unit, root_params = assign_params(model, units)
        names = {id(m): n for n, m in model.named_modules()}
        self.agree(0, len(units), "zerocore.shard_model: the number of units")
        units_: list[Unit] = []
        # Each unit is a build step every rank agrees on (Sharding.attempt / agree): one that
        # fails on one rank is raised on every rank at the next agreement.
        for i, (module, params) in enumerate(zip(units + [model], per_unit + [root_params])):
            what = "the root unit" if module is model else f"unit {i} ({names[id(module)]})"
            self.agree(i, fingerprint((n, p) for n, p, _ in params),
                       f"zerocore.shard_model: {what}")
            if module is not model:  # it would compile the hooks below (raised on all ranks)
                self.attempt(i, functools.partial(refuse_compiled_call, module, what))
            # Compile: each unit's forward (the hooks stay eager); the root is the model.
            layer = self.attempt(i, lambda: self.new_layer(
                module, i, params=params, compiled=module is not model, read=read))
            if layer is not None:
                units_.append(Unit("" if module is model else names[id(module)], module,
                                   layer))
        self.settle("zerocore.shard_model")
        self.units = units_
        self.root = units_[-1]
        self.layers: list[ShardedLayer] = [u.layer for u in units_]
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
        self.seal(self.layers, recomputable=len(units))
        owners = {id(m): m for _, _, os in root_params for m, _ in os if m is not model}
        self.start(model, self.units, root_owners=list(owners.values()))
        # transformers' generate then keeps a finished rank serving the others' gathers
        # (synced_generation.py): ranks may stop at different lengths.
        self.synced_generation = mark_synced_generation(model, mesh)

    @staticmethod
    def unit_label(name: str) -> str:
        return (f"`{name}`" if name else
                "the root unit (embeddings, head: what no single unit owns)")

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
        with self.runtime.gathered(max_bytes):
            yield

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

    def expected_traffic(self, forward_only: bool = False) -> tuple[int, int]:
        """(bytes all-gathered, bytes reduce-scattered) one step should move: the units as
        ``zerocore.shard``'s layers (every unit is in backward when the root trains, the
        embedding being its first operation), the root once (``Schedule.traffic``)."""
        root = self.layers[-1]
        return self.schedule.traffic(
            [groups_of(l) for l in self.layers[:-1]],
            reduce_bytes=self.mixed_precision.grad_reduce_dtype.itemsize,
            input_requires_grad=root.trainable is not None, root=groups_of(root),
            forward_only=forward_only)

    def remove(self) -> None:
        """Removes the hooks and the forwards Recompute and Compile gave the units (the model
        can no longer run: its parameters stay sharded)."""
        self.runtime.remove()
        unmark_synced_generation(self.synced_generation)
        if self.compile is not None:
            for unit in self.units[:-1]:
                if "forward" in vars(unit.module):
                    del unit.module.forward  # the class's own again


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
                group: dist.ProcessGroup | None = None, mesh: DeviceMesh | None = None,
                device: torch.device | str | None = None,
                mixed_precision: MixedPrecision = MixedPrecision(),
                prefetch: Prefetch = Prefetch(), offload: Offload = Offload(),
                frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
                recompute: Recompute | None = None, compile: Compile | None = None,
                hybrid: Hybrid | None = None, platform: Platform | None = None,
                read: RangeReader | None = None) -> ShardedModel:
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
    group, mesh, device, mixed_precision, prefetch, offload, frozen_weights, comm, recompute,
        hybrid, platform: as for ``zerocore.shard`` (``mesh``: 1-D, or 2-D ``(replicate,
        shard)`` for HSDP, or hpZ with ``hybrid=zerocore.Hybrid("hpz")``); ``Recompute``'s
        positions are the units' (the root is never
        recomputed). ``Prefetch.keep_gathered`` chooses from the root first (its frozen
        group, e.g. the embedding, then stays gathered from step to step), then the last units.
    compile: ``zerocore.Compile(...)``: each unit's forward is compiled with torch.compile,
        the engine's hooks around it staying eager (not ``unit.compile()``, refused: it would
        compile the hooks too). ``torch.compile(unit)`` in the unit's place works as well.
    read: for a model built on the meta device (``with torch.device("meta"): ...``; buffers
        must hold values): ``read(name, start, stop)`` returns elements ``[start, stop)`` of the
        flattened parameter ``name`` (the model's own name, as ``named_parameters`` gives it),
        so that each rank reads only its shards' elements (as ``zerocore.MetaLayer`` for
        ``zerocore.shard``). Called only for meta parameters; the others are taken as they are.
    Returns the ``ShardedModel`` (also ``model.zerocore_sharding``): ``.group``,
    ``.full_state_dict()``, ``.memory_report()``; ``save_checkpoint``/``load_checkpoint`` take
    the model or it.
    """
    ranks = meshes.resolve(group, mesh, "zerocore.shard_model",
                           nodes=meshes.nodes_of(os.environ), hybrid=hybrid)
    if not isinstance(model, nn.Module):
        raise TypeError(f"zerocore.shard_model expects an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, SHARDING_ATTR, None), ShardedModel):
        raise ValueError("zerocore.shard_model: this model is sharded already")
    _refuse_parametrized(model)
    if getattr(model, "is_distributed_loading_by_transformers", False):
        raise ValueError("zerocore.shard_model: this model was sharded by transformers as it "
                         "loaded (from_pretrained(distributed_config=...)); load it without "
                         "distributed_config to shard it with zerocore")
    if read is not None and not callable(read):
        raise TypeError("zerocore.shard_model: read must be a function read(name, start, stop)")
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(f"zerocore.shard_model: buffers {meta_buffers[:3]} are on the meta "
                         f"device; only parameters are read by range: materialise the buffers "
                         f"first")
    unit_list = unit_modules(model, units)
    dev, host_threads, hosts = prepare_device(device, ranks, offload, platform,
                                              "zerocore.shard_model")
    sharding = ShardedModel(model, unit_list, mesh=ranks, device=dev,
                            mixed_precision=mixed_precision, prefetch=prefetch, offload=offload,
                            frozen_weights=frozen_weights, comm=comm, recompute=recompute,
                            compile=compile, host_threads=host_threads, read=read,
                            hybrid=hybrid, hosts=hosts)
    setattr(model, SHARDING_ATTR, sharding)
    return sharding
