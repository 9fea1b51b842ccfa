"""``ShardedLayer``: one layer of a sharded stack — the user's module with its parameters taken
out and replaced by flat groups — and ``LayerFunction``, the autograd node that gathers the layer
around its forward and its backward.

Why an autograd Function and not hooks. Each layer's forward runs inside ``LayerFunction``: the
layer's own graph is built inside it (on per-parameter leaves viewing the gathered buffer) and
kept in the node; the node's backward re-gathers the parameters, runs ``torch.autograd.grad`` on
that inner graph, packs the parameter gradients and starts their reduce-scatter. The trainable
shard is an input of the node, so autograd always schedules the node, even for a first layer
whose input (token ids) needs no gradient. Nothing depends on hooks registered on
autograd-internal objects that can be garbage-collected (the failure of the reference
implementation, whose shards never received gradients).

Recomputation (``zerocore.Recompute``): a chosen layer's node runs the forward without a graph
and keeps only its input and the ``ForwardState`` (generator states, autocast) of that run; its
backward, once the parameters are gathered again, runs the forward under autograd in that state
and differentiates the graph it just built, as it would have the kept one.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from zerocore.engine.compiled import plain_name
from zerocore.engine.flat_group import FlatGroup, GroupContext, PendingGrad
from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.meta_layer import RangeReader
from zerocore.kernels import ops
from zerocore.engine.offload import GradToHost, accumulate_grad, start_grad_to_host
from zerocore.engine.recompute import ForwardState


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


def _rank_slice(chosen: list[tuple[str, nn.Parameter]], layout: FlatLayout, rank: int,
                dtype: torch.dtype, read: RangeReader | None) -> torch.Tensor:
    """The group's unsharded flat buffer (1D, ``dtype``, padded_numel) with only this rank's
    range ``[lo, hi)`` written (padding zero): what ``FlatGroup`` keeps. The rest is allocated
    but never touched, so on the CPU it takes address space, not memory (pages are backed when
    first written). A meta parameter's elements come from ``read``, only those in the range,
    one parameter at a time (each piece is packed and dropped before the next is read)."""
    lo, hi = layout.shard_range(rank)
    device = next((p.device for _, p in chosen if not p.is_meta), torch.device("cpu"))
    full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    full[lo:hi].zero_()  # padding, and any gap between parameters
    for (name, p), slot in zip(chosen, layout.slots):
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= stop:
            continue
        a, b = start - slot.offset, stop - slot.offset
        if p.is_meta:
            piece = read(name, a, b)
            if piece.shape != (b - a,) or not piece.is_floating_point():
                raise ValueError(f"MetaLayer.read({name!r}, {a}, {b}) returned "
                                 f"{piece.dtype} {tuple(piece.shape)}; expected {b - a} "
                                 f"floating-point elements")
        else:
            piece = p.detach().reshape(-1)[a:b]
        with torch.no_grad():
            ops.pack([piece.to(device)], [0], full[start:stop])  # pack's dtype conversion
        del piece
    return full


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
                                 f"values; materialise the layer, or give it as "
                                 f"zerocore.MetaLayer(module, read) to read each rank's part")
        groups: dict[bool, FlatGroup | None] = {}
        self._owners: dict[bool, list[list[tuple[nn.Module, str]]]] = {}
        for trainable in (True, False):
            chosen = [(n, p, o) for n, p, o in params if p.requires_grad == trainable]
            self._owners[trainable] = [o for _, _, o in chosen]
            if not chosen:
                groups[trainable] = None
                continue
            int8 = not trainable and ctx.int8_block is not None
            layout = FlatLayout.build([(n, tuple(p.shape)) for n, p, _ in chosen], world_size,
                                      block=ctx.int8_block if int8 else 1)
            # Trainable masters, and frozen values about to be quantized, from fp32.
            full_dtype = torch.float32 if trainable or int8 else ctx.param_dtype
            # Only this rank's part is written: FlatGroup keeps only that slice.
            full = _rank_slice([(n, p) for n, p, _ in chosen], layout, ctx.rank, full_dtype,
                               read)
            groups[trainable] = FlatGroup(layout, full, trainable, ctx)
            del full
        # The module no longer owns its parameters: their values live in the groups, and
        # unsharded views are installed as plain attributes while the layer runs.
        for _, _, owners in params:
            for mod, attr in owners:
                del mod._parameters[attr]
        self.module = module.to(ctx.device)  # buffers (e.g. rotary tables) only, now
        self.device = ctx.device               # where the layer computes
        self.trainable: FlatGroup | None = groups[True]
        self.frozen: FlatGroup | None = groups[False]
        self.trainable_shard = self.trainable.shard if self.trainable else None
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
        for g in self.groups:
            g.start_gather()

    def wait_gather(self) -> None:
        for g in self.groups:
            g.wait_gather()

    def free(self) -> None:
        """Frees the gathered buffers, except a resident frozen group's
        (Prefetch.keep_gathered)."""
        for g in self.groups:
            g.free()

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
                    own = not trainable and (id(mod), attr) in self.own_versions
                    setattr(mod, attr, _own_tensor(view) if own else view)
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

    def run_without_graph(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's forward with no graph recorded (grad mode off, or a recomputed layer's
        first forward). The trainable views are still leaves that require grad: torch chooses
        some kernels by whether a weight requires grad (a Linear on a non-contiguous 3-D input,
        as nn.MultiheadAttention(batch_first=True) does), so views that did not would compute
        other bits than the recomputation, than a run without recomputation and than the
        unsharded model, whose parameters require grad whatever the grad mode."""
        self.install(with_grad_leaves=True)
        return self.module(x)

    def run_with_graph(self, x_in: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The layer's forward on ``x_in`` with autograd recording, on fresh leaves viewing the
        gathered buffers: (the trainable parameters' leaves, the output)."""
        with torch.enable_grad():
            leaves = self.install(with_grad_leaves=True)
            y = self.module(x_in)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"layer {self.index} returned {type(y).__name__}; zerocore layers "
                            f"must map one tensor to one tensor")
        return leaves, y


class BackwardCoordinator:
    """What the backward passes of all layers of one model share: prefetching the layer that
    runs backward next, the reduce-scatters still in flight, gradient shards on their way to
    offloaded masters, and the end-of-backward callback that completes them. Owned by the
    sharded model; passed explicitly to each node."""

    def __init__(self, layers: list[ShardedLayer], prefetch: bool,
                 on_finish: Callable[[], None] | None = None):
        """on_finish: called at the end of ``finish`` (the sharded model's own bookkeeping)."""
        self.layers = layers
        self.prefetch = prefetch
        self.on_finish = on_finish
        self.pending: list[PendingGrad] = []
        # CPU offload: gradient shards copied (or being copied) to the host, in backward order;
        # each is added into its master's .grad once its own copy is complete.
        self.to_host: list[GradToHost] = []
        self._callback_queued = False
        # Packed-gradient buffers of delivered gradients, reused by the next layers' backward
        # (on the CPU; CUDA's caching allocator already reuses memory). A fresh full-size buffer
        # per layer costs page faults, since glibc often hands large freed blocks back to the
        # OS: reusing them saved ~4% of the backward time in bench/bench_fsdp.py. At most two
        # are in use at once (one being packed, one in flight); all are released when backward
        # ends.
        self._spare: list[torch.Tensor] = []

    def queue_finish(self) -> None:
        """Makes ``finish`` run when the backward pass in progress ends (once per pass)."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True

    def before_layer_backward(self, layer: ShardedLayer, previous: ShardedLayer | None) -> None:
        self.queue_finish()
        layer.wait_gather()
        if self.prefetch and previous is not None:
            previous.start_gather()

    def scratch_for(self, group: FlatGroup) -> torch.Tensor | None:
        """A buffer to pack ``group``'s gradients into, or None to let the group allocate."""
        if group.ctx.device.type != "cpu":
            return None
        numel, dtype = group.layout.padded_numel, group.ctx.reduce_dtype
        if self._spare:
            buf = self._spare.pop()
            if buf.numel() >= numel and buf.dtype == dtype:
                return buf
        return torch.empty(numel, dtype=dtype, device=group.ctx.device)

    def _deliver(self, pending: PendingGrad) -> None:
        grad = FlatGroup.finish_reduce_scatter(pending)
        group = pending.group
        owned = pending.owned  # else a view of the reusable packed buffer
        if group.ctx.offload:
            self.to_host.append(start_grad_to_host(grad, group.shard, owned, group.ctx.streams))
            # Whatever has arrived is added now, on the host, while the device computes; on
            # the CPU that is this gradient, before its packed buffer is reused below.
            self._deliver_to_host(wait=False)
        else:
            accumulate_grad(group.shard, grad, owned)
        if pending.scratch is not None:
            self._spare.append(pending.scratch)

    def _deliver_to_host(self, wait: bool) -> None:
        """Adds the gradient shards whose copy to the host is complete (all of them, waiting for
        each copy in turn, when ``wait``) into their masters' ``.grad``."""
        waiting = []
        for g in self.to_host:
            if wait or g.ready():
                g.deliver()
            else:
                waiting.append(g)
        self.to_host = waiting

    def after_layer_backward(self, pending: PendingGrad | None) -> None:
        # Keep at most one reduce-scatter in flight: it overlaps the next layer's backward.
        while self.pending:
            self._deliver(self.pending.pop(0))
        if pending is not None:
            self.pending.append(pending)

    def finish(self) -> None:
        """End of backward: deliver every gradient still in flight, and release a layer that was
        prefetched but whose backward did not run, and the spare gradient buffers."""
        self._callback_queued = False
        while self.pending:
            self._deliver(self.pending.pop(0))
        # Gradients are complete when backward returns, as torch's are: the host waits for each
        # remaining copy (its event), not for the device as a whole.
        self._deliver_to_host(wait=True)
        self._spare.clear()
        for layer in self.layers:
            layer.free()
        if self.on_finish is not None:
            self.on_finish()


class LayerFunction(torch.autograd.Function):
    """y = layer(x), with the layer's parameters gathered for the forward and again for the
    backward. Inputs after x are the trainable shard (or nothing); its "gradient" is delivered
    by the reduce-scatter into ``shard.grad``, so autograd receives None for it."""

    @staticmethod
    def forward(ctx, coordinator: BackwardCoordinator, layer: ShardedLayer,
                previous: ShardedLayer | None, x: torch.Tensor, *shards: torch.Tensor):
        x_in = x.detach().requires_grad_(x.requires_grad)
        ctx.coordinator, ctx.layer, ctx.previous = coordinator, layer, previous
        ctx.num_shards = len(shards)
        if layer.recompute:
            # Only the input is kept (and what the recomputation must reproduce); the forward
            # runs without a graph (grad mode is off inside Function.forward), so its
            # intermediate tensors are freed as it goes.
            ctx.forward_state = ForwardState.capture(layer.device)
            y = layer.run_without_graph(x_in)
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"layer {layer.index} returned {type(y).__name__}; zerocore "
                                f"layers must map one tensor to one tensor")
            ctx.inner = (x_in, None, None, True)
            return y.detach()
        leaves, y = layer.run_with_graph(x_in)
        # The inner graph is kept by its output's gradient edge, not by the output itself:
        # holding y would hold its storage until this layer's backward, and the last layer's
        # output (the logits, B x T x vocabulary) is then dead weight through the whole
        # backward once the loss has used it. Autograd needs y's node, not its values.
        ctx.inner = (x_in, leaves, get_gradient_edge(y) if y.requires_grad else None, False)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        coordinator: BackwardCoordinator = ctx.coordinator
        layer: ShardedLayer = ctx.layer
        x_in, leaves, output, recomputed = ctx.inner
        ctx.inner = None  # the inner graph is used once
        coordinator.before_layer_backward(layer, ctx.previous)
        if recomputed:
            # Recomputation: the parameters are gathered again; the same forward, in the
            # first run's random-number and autocast state, builds the graph to differentiate.
            with ctx.forward_state.reinstated():
                leaves, y = layer.run_with_graph(x_in)
            output = y if y.requires_grad else None
            ctx.forward_state = None
        inputs = ([x_in] if x_in.requires_grad else []) + leaves
        grad_x = None
        pending = None
        if output is not None and inputs:
            grads = torch.autograd.grad(output, inputs, grad_y, allow_unused=True)
            if x_in.requires_grad:
                grad_x, grads = grads[0], grads[1:]
            if layer.trainable is not None:
                pending = layer.trainable.start_reduce_scatter(
                    list(grads), coordinator.scratch_for(layer.trainable))
        elif layer.trainable is not None:
            pending = layer.trainable.start_reduce_scatter(
                [None] * len(leaves), coordinator.scratch_for(layer.trainable))
        layer.free()
        coordinator.after_layer_backward(pending)
        return (None, None, None, grad_x) + (None,) * ctx.num_shards
