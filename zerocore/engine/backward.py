"""``BackwardCoordinator``: what the backward passes of all layers (units) of one sharded model
share: prefetching the layer whose backward runs next, the gradient reductions in flight (one at a
time, overlapping the next layer's backward), gradient shards on their way to offloaded masters,
the packed-gradient buffers reused from layer to layer, and the end-of-backward callback that
completes them. The runtime (runtime.py) calls it from its hooks and its autograd node.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from zerocore.engine.flat_group import FlatGroup, PendingGrad
from zerocore.engine.offload import GradToHost, HostAdder, accumulate_grad, start_grad_to_host
from zerocore.engine.sharded_layer import ShardedLayer
from zerocore.engine.tracing import traced


class BackwardCoordinator:
    """What the backward passes of all layers of one model share: prefetching the layer that
    runs backward next, the reduce-scatters still in flight, gradient shards on their way to
    offloaded masters, and the end-of-backward callback that completes them. Owned by the
    sharded model; passed explicitly to each node."""

    def __init__(self, layers: list[ShardedLayer], prefetch: bool,
                 on_finish: Callable[[], None] | None = None,
                 staging: list[torch.Tensor] | None = None):
        """on_finish: called at the end of ``finish`` (the sharded model's own bookkeeping).
        staging: offload's host buffers gradients are copied into from the device, used in
        turn (engine/host_arena.py); none: each copy gets a pinned buffer of its own."""
        self.layers = layers
        self.prefetch = prefetch
        self.on_finish = on_finish
        self.pending: list[PendingGrad] = []
        # CPU offload on a GPU: gradient shards copied (or being copied) to the host in this
        # backward, in order; the worker adds each into its master's .grad once its own copy
        # is complete (created with the first).
        self.to_host: list[GradToHost] = []
        self._adder: HostAdder | None = None
        self._staging = staging or []
        # The addition that last read each staging buffer: a copy into it waits for that.
        self._staging_read: list[Future | None] = [None] * len(self._staging)
        self._next_staging = 0
        self._callback_queued = False
        # Packed-gradient buffers of delivered gradients, reused by the next layers' backward
        # (on the CPU; CUDA's caching allocator already reuses memory). A fresh full-size buffer
        # per layer costs page faults, since glibc often hands large freed blocks back to the
        # OS: reusing them saved ~4% of the backward time in bench/bench_fsdp.py. At most two
        # are in use at once (one being packed, one in flight); all are released when backward
        # ends.
        self._spare: list[torch.Tensor] = []

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradient buffers it holds now: packed gradients (and what their reductions hold)
        in flight, the spare packed buffers, gradient shards on their way to the host. What a
        plan counts as gradient buffers (zerocore.plan)."""
        out: list[torch.Tensor] = list(self._spare)
        for p in self.pending:
            out.append(p.packed if p.scratch is None else p.scratch)
            if p.reduction.held is not None:
                out.append(p.reduction.held)
        out.extend(g.values for g in self.to_host)
        return out

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
        if group.ctx.device_kind != "cpu":
            return None
        numel, dtype = group.layout.padded_numel, group.ctx.reduce_dtype
        if self._spare:
            buf = self._spare.pop()
            if buf.numel() >= numel and buf.dtype == dtype:
                return buf
        return torch.empty(numel, dtype=dtype, device=group.ctx.device)

    def _deliver(self, pending: PendingGrad) -> None:
        with traced("reduce_wait", pending.group.shard.layer_index):
            grad = FlatGroup.finish_reduce_scatter(pending)
        group = pending.group
        owned = pending.owned  # else a view of the reusable packed buffer
        if grad is None:
            pass  # HSDP kept it for a later micro-batch's all-reduce: nothing to add yet
        elif group.home.steps_on_host and group.ctx.streams is not None:
            # On a GPU: copied to the host on the download stream, then added into the master's
            # gradient by the host's worker (HostAdder) while this thread goes on with backward.
            slot = None
            if self._staging:
                slot = self._next_staging
                self._next_staging = (slot + 1) % len(self._staging)
                if self._staging_read[slot] is not None:
                    self._staging_read[slot].result()
            to_host = start_grad_to_host(grad, group.shard, owned, group.ctx.streams,
                                         None if slot is None else self._staging[slot])
            self.to_host.append(to_host)
            if self._adder is None:
                self._adder = HostAdder()
            added = self._adder.add(to_host)
            if slot is not None:
                self._staging_read[slot] = added
        else:
            # On the CPU host and device are one (and the same cores), and without optimizer
            # offload the master is where the gradient is: it is added there, at once, before
            # its packed buffer is reused below.
            accumulate_grad(group.shard, grad, owned)
        if pending.scratch is not None:
            self._spare.append(pending.scratch)

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
        # remaining addition (and so each copy's event), not for the device as a whole.
        if self._adder is not None:
            self._adder.wait()
        self.to_host = []
        self._staging_read = [None] * len(self._staging)
        self._spare.clear()
        for layer in self.layers:
            layer.free()
        if self.on_finish is not None:
            self.on_finish()
