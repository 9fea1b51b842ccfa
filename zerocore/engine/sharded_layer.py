"""``ShardedLayer``: one layer (or ``shard_model`` unit) of a sharded model: the user's module
with its parameters taken out and replaced by flat groups, a trainable and a frozen one, whose
gathered buffers are installed on the module as unsharded views while it runs. How and when a
layer is gathered, run and reduced is the runtime's (runtime.py), the same for both front doors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from zerocore.comm.fake import is_fake
from zerocore.engine.compiled import plain_name
from zerocore.engine.flat_group import FlatGroup, GroupContext, GroupState
from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.meta_layer import READ_PIECE_NUMEL, RangeReader
from zerocore.engine.tracing import traced
from zerocore.kernels import ops


# A layer's parameters: (name, parameter, every (owner module, attribute) that holds it).
Params = list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]


def collect_params(module: nn.Module) -> Params:
    """(name, parameter, every (owner module, attribute) that holds it), in registration order;
    a parameter tied within the layer appears once with several owners."""
    by_id: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    seen: set[tuple[int, str]] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None or (id(mod), attr) in seen:
                continue
            seen.add((id(mod), attr))
            name = plain_name(f"{mod_name}.{attr}" if mod_name else attr)
            by_id.setdefault(id(p), (name, p, []))[2].append((mod, attr))
    return list(by_id.values())


def _held_values(chosen: list[tuple[str, nn.Parameter]], layout: FlatLayout,
                 held: tuple[int, int], dtype: torch.dtype, read: RangeReader | None
                 ) -> torch.Tensor:
    """The group's flat values of the range ``held`` = ``[lo, hi)`` this rank holds (1D,
    ``dtype``, hi - lo; padding zero): what ``FlatGroup`` keeps (its shard, or a replicated
    base's every part), and nothing else. A meta parameter's elements come from ``read``, only
    those in the range, in pieces of at most ``READ_PIECE_NUMEL`` elements (each piece is
    packed and dropped before the next is read): the loading's transient beyond the values is
    one piece, however large the parameter."""
    lo, hi = held
    device = next((p.device for _, p in chosen if not p.is_meta), torch.device("cpu"))
    values = torch.zeros(hi - lo, dtype=dtype, device=device)  # padding, and any gap
    fake = isinstance(values, FakeTensor)
    for (name, p), slot in zip(chosen, layout.slots):
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        step = READ_PIECE_NUMEL if p.is_meta else max(stop - start, 1)  # a view: in one piece
        for a in _read_starts(start, stop, step, fake):
            b = min(stop, a + step)
            piece = _piece(name, p, a - slot.offset, b - slot.offset, read)
            with torch.no_grad():  # pack's dtype conversion
                ops.pack([piece.to(device)], [0], values[a - lo:b - lo])
            del piece
    return values


def _read_starts(start: int, stop: int, step: int, fake: bool) -> list[int]:
    """Where the pieces of ``[start, stop)`` begin. Fake values (only a plan makes them, which
    reads through plan.py's ``_LoadingRead``) skip the full pieces after the second: each full
    piece after the first finds the reader's buffer as large as a piece already and leaves
    the live storages as it found them (the piece and its slice of ``values`` dropped), so
    it allocates and frees exactly what the second did, and the loading's peak (the largest
    sum of live bytes) is the same without them; the first (which may grow the buffer) and
    the last (which may be shorter) are kept. Real values are read in full."""
    starts = range(start, stop, step)
    return [*starts[:2], starts[-1]] if fake and len(starts) > 3 else list(starts)


def _piece(name: str, p: nn.Parameter, a: int, b: int, read: RangeReader | None
           ) -> torch.Tensor:
    """Elements ``[a, b)`` of parameter ``p`` (flattened): read when it is on the meta
    device, a view of it otherwise."""
    if not p.is_meta:
        return p.detach().reshape(-1)[a:b]
    piece = read(name, a, b)
    if piece.shape != (b - a,) or not piece.is_floating_point():
        raise ValueError(f"MetaLayer.read({name!r}, {a}, {b}) returned "
                         f"{piece.dtype} {tuple(piece.shape)}; expected {b - a} "
                         f"floating-point elements")
    return piece


def _own_tensor(view: torch.Tensor) -> torch.Tensor:
    """A tensor on ``view``'s memory with a version counter of its own (not a view)."""
    with torch.no_grad():
        return torch.empty(0, dtype=view.dtype, device=view.device).set_(
            view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class ShardedLayer(nn.Module):
    """A layer whose parameters live in a trainable and a frozen ``FlatGroup``.

    ``trainable_shard`` (a ``ShardParameter``) and ``frozen_shard`` are registered parameters, so
    ``model.parameters()`` yields exactly what this rank owns.
    """

    def __init__(self, module: nn.Module, index: int, ctx: GroupContext, world_size: int,
                 read: RangeReader | None = None,
                 params: list[tuple[str, nn.Parameter,
                                    list[tuple[nn.Module, str]]]] | None = None):
        """read: where the values of meta parameters come from (``zerocore.MetaLayer``).
        params: (name, parameter, its (owner module, attribute) pairs) to shard, when not all of
        ``module``'s (``shard_model``'s root unit: what no other unit owns)."""
        super().__init__()
        self.index = index
        params = collect_params(module) if params is None else params
        for name, p, _ in params:
            if not p.is_floating_point() or p.dtype == torch.float64:
                raise ValueError(f"layer {index}: parameter {name} has dtype {p.dtype}; zerocore "
                                 f"shards float32/float16/bfloat16 parameters")
            if p.is_meta and read is None:
                raise ValueError(f"layer {index}: parameter {name} is on the meta device, without "
                                 f"values; materialise it, or give a reader of each rank's part "
                                 f"(zerocore.shard: the layer as zerocore.MetaLayer(module, "
                                 f"read); zerocore.shard_model: read=)")
        groups: dict[bool, FlatGroup | None] = {}
        self._owners: dict[bool, list[list[tuple[nn.Module, str]]]] = {}
        for trainable in (True, False):
            chosen = [(n, p, o) for n, p, o in params if p.requires_grad == trainable]
            self._owners[trainable] = [o for _, _, o in chosen]
            if not chosen:
                groups[trainable] = None
                continue
            quantized = not trainable and ctx.quantized is not None
            layout = FlatLayout.build([(n, tuple(p.shape)) for n, p, _ in chosen], world_size,
                                      block=ctx.quantized.block if quantized else 1)
            # Trainable masters, and frozen values about to be quantized, from fp32.
            full_dtype = torch.float32 if trainable or quantized else ctx.param_dtype
            # Only what this rank holds is made (its shard; a replicated base's every part):
            # FlatGroup keeps it.
            held = ctx.homes.held_range(trainable, layout, ctx.rank)
            if quantized and not is_fake(ctx.process_group):  # (a plan allocates nothing)
                nbytes = layout.world_size * ctx.quantized.part_nbytes(layout.shard_numel)
                held_bytes = nbytes * (held[1] - held[0]) // layout.padded_numel
                ctx.homes.home_of(trainable).check_room(
                    ctx.device, held_bytes, 4 * (held[1] - held[0]), f"layer {index}")
            values = _held_values([(n, p) for n, p, _ in chosen], layout, held, full_dtype,
                                  read)
            groups[trainable] = FlatGroup(layout, values, trainable, ctx)
            del values
        # The module no longer owns its parameters: their values live in the groups, and
        # unsharded views are installed as plain attributes while the layer runs.
        for _, _, owners in params:
            for mod, attr in owners:
                del mod._parameters[attr]
        self.module = module.to(ctx.device)  # buffers (e.g. rotary tables) only, now
        self.lockstep = ctx.lockstep  # says where this rank is before each gather
        self.device = ctx.device               # where the layer computes
        self.trainable: FlatGroup | None = groups[True]
        self.frozen: FlatGroup | None = groups[False]
        for g in self.groups:
            g.unit_index = index
        self.trainable_shard = self.trainable.shard if self.trainable else None
        if self.trainable_shard is not None:
            self.trainable_shard.layer_index = index  # the optimizer's trace label
        self.frozen_shard = self.frozen.shard if self.frozen else None
        # Whether the forward keeps only its input and backward runs it again (Recompute);
        # set by the sharded model, which knows the policy.
        self.recompute = False
        # (id(module), attribute) of frozen parameters whose view is installed as a tensor of
        # its own: the same storage, but its own version counter. Views of one buffer share
        # one counter, so an in-place operation on one (torch.nn.utils.parametrize's set_
        # when PEFT parametrizes an expert weight each forward) would look like a change of
        # every other weight saved for backward. Set by ``shard_model``.
        self.own_versions: set[tuple[int, str]] = set()

    @property
    def groups(self) -> list[FlatGroup]:
        return [g for g in (self.trainable, self.frozen) if g is not None]

    def start_gather(self) -> None:
        groups = self.groups
        if not any(g.state is GroupState.SHARDED for g in groups):
            return  # gathered, or in flight: no collective
        if self.lockstep is not None:
            self.lockstep.gather(self.index)  # once for all its groups
        with traced("gather", self.index):
            for g in groups:
                g.start_gather()
        if self.lockstep is not None:
            self.lockstep.flush()  # (said with the first group's ready message, if it has one)

    def wait_gather(self) -> None:
        self.start_gather()  # (a gather not started yet starts here, said where first)
        with traced("gather_wait", self.index):
            for g in self.groups:
                g.wait_gather()

    def free(self, keep_secondary: bool = False) -> None:
        """Frees the gathered buffers, except a resident frozen group's
        (Prefetch.keep_gathered). ``keep_secondary``: hpZ keeps each group's secondary shard
        for the backward that will gather it again (``FlatGroup.free``)."""
        for g in self.groups:
            g.free(keep_secondary=keep_secondary)

    def drop_secondary(self) -> None:
        """Gives back the secondary shards kept for a backward (hpZ), if any."""
        for g in self.groups:
            g.drop_secondary()

    def release(self) -> None:
        """Frees every gathered buffer, resident ones included."""
        for g in self.groups:
            g.free(release=True)

    @property
    def gathered_size(self) -> int:
        """Bytes of this layer's gathered buffers when gathered (all groups, param dtype)."""
        return sum(g.layout.padded_numel * g.ctx.param_dtype.itemsize for g in self.groups)

    def install(self, with_grad_leaves: bool,
                trainable_views: tuple[torch.Tensor, ...] | None = None) -> list[torch.Tensor]:
        """Puts unsharded views of the gathered buffers on the module; returns the trainable
        parameters' views (autograd leaves when with_grad_leaves). trainable_views: the
        trainable parameters' tensors to install instead (``shard_model``'s, outputs of the
        autograd node that reduce-scatters their gradients)."""
        leaves: list[torch.Tensor] = []
        for trainable, group in ((True, self.trainable), (False, self.frozen)):
            if group is None:
                continue
            views = (list(trainable_views) if trainable and trainable_views is not None
                     else group.views(requires_grad=with_grad_leaves and trainable))
            for view, owners in zip(views, self._owners[trainable]):
                for mod, attr in owners:
                    if not trainable and (id(mod), attr) in self.own_versions:
                        setattr(mod, attr, _own_tensor(view))  # a buffer (shard_model)
                    elif attr in mod._buffers:
                        setattr(mod, attr, view)
                    else:
                        # A plain attribute, which is all nn.Module.__setattr__ would make of
                        # it (the parameter is no longer registered): set directly, as its
                        # checks cost a few microseconds per parameter and call.
                        mod.__dict__[attr] = view
            if trainable:
                leaves = views
        return leaves

    def full_state(self, trainable_only: bool = False, *,
                   to_rank: int | None = None) -> dict[str, torch.Tensor]:
        """Collective (every rank must call it): the layer's unsharded parameters by name, on
        the CPU; trainable ones in fp32 from the master weights. With ``to_rank`` only that rank
        of the group receives them; the others get an empty dict."""
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            if group.trainable or not trainable_only:
                out.update(group.gather_full(to_rank))
        return out
