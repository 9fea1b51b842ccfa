"""CPU offload's traffic between the device and the host (``Offload(optimizer=True)``, and the
parameter windows of ``Offload(params=True)``): the side streams, gradient shards on their way
to the CPU masters, and the CPU thread count of GPU ranks. (An offloaded master shard knows
when the device has finished reading it: ``sharded_param.wait_for_device``.)

The stream design (what overlaps with what, what waits for what) is written down in
docs/decisions.md, "CPU offload: the stream design". In short, on CUDA:
- ``download``: each layer's reduced gradient shard is copied device -> pinned host memory on
  this stream as soon as the compute stream has its reduce-scatter's result; the copy overlaps
  the backward of the layers before it, and the host waits for that copy alone (its event)
  before it adds the values into ``shard.grad``.
- ``upload``: the updated model copy (fp32 master in fp32) is copied pinned host -> device mirror
  on this stream, after the last all-gather that read the mirror; its event is what the next
  all-gather of that layer, and the host's next write of the copy, wait for.
- ``gather``: offloaded layers' all-gathers are issued from this stream, which waits for the
  upload's event and for the compute stream's work so far (the gathered buffer may reuse memory
  that work still reads): the compute stream waits for the all-gather, never for an upload.
On the CPU there are no streams: the same code runs with plain copies and no events, and gives
bitwise the values of the synchronous offload it replaced.

Parameter offload (``Offload(params=True)``) uses the same streams: each gather's window is
uploaded on ``upload`` (or rounded from a device master on ``gather``) and gathered from
``gather``; no mirror is kept (docs/decisions.md, "Parameter offload (issue 31, item 1)";
zerocore/engine/homes/host_window.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import weakref

import torch

from zerocore.engine.optimizer_pass import wait_for_gradient
from zerocore.engine.sharded_param import ShardParameter


class OffloadStreams:
    """The side streams of CPU offload on one CUDA device, shared by every layer of a model."""

    def __init__(self, device: torch.device):
        assert device.type == "cuda"
        # Gradient shards device -> host; overlaps the backward of the layers before.
        self.download = torch.cuda.Stream(device)
        # Model copies host -> device mirror (parameter offload: host shards -> each gather's
        # window); overlaps the host's Adam and the forward (the layer before's compute).
        self.upload = torch.cuda.Stream(device)
        # Issues offloaded groups' all-gathers after their upload; high priority, as the
        # compute stream will wait for what it issues.
        self.gather = torch.cuda.Stream(device, priority=-1)


def accumulate_grad(shard: ShardParameter, grad: torch.Tensor, owned: bool) -> None:
    """``shard.grad += grad`` in fp32 on the shard's device (or ``shard.grad = grad``).

    grad: this rank's averaged gradient shard (1D, reduce dtype); owned is False when it is a
    view of a buffer that will be reused, so it is copied before it becomes ``shard.grad``.
    Widening to fp32 is exact, so the order of widening and moving does not change a bit.
    An overlapped optimizer pass may still read ``shard.grad``: waited for first."""
    wait_for_gradient(shard)
    if grad.dtype != torch.float32 or grad.device != shard.device:
        grad = grad.to(device=shard.device, dtype=torch.float32)
    elif not owned and shard.grad is None:
        grad = grad.clone()
    if shard.grad is None:
        shard.grad = grad
    else:
        shard.grad.add_(grad)


@dataclasses.dataclass
class GradToHost:
    """A gradient shard on its way to an offloaded master's ``.grad``."""

    shard: ShardParameter
    values: torch.Tensor               # 1D, reduce dtype, shard_numel: on the host once copied
    copied: torch.cuda.Event | None    # recorded after the device -> host copy;
                                       # None: already there
    owned: bool                        # values is its own buffer (see accumulate_grad)

    def deliver(self) -> None:
        """Waits for this copy alone, then accumulates into ``shard.grad`` (fp32, host)."""
        if self.copied is not None:
            self.copied.synchronize()
        accumulate_grad(self.shard, self.values, self.owned)


class HostAdder:
    """The host's side of offloaded gradients: one worker thread per sharding that adds each
    gradient shard into its master's ``.grad`` once its copy to the host is complete, in the
    order they arrive, while the autograd thread goes on with backward (on a GPU: launching the
    next layers' kernels instead of waiting for a host addition of millions of elements). The
    same additions in the same order as on the autograd thread: bitwise the same gradients.
    ``wait`` at the end of backward: gradients are complete when backward returns."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zerocore-host-add")
        # The thread goes with the sharding (idle, it holds nothing).
        weakref.finalize(self, self._pool.shutdown, wait=False)
        self._pending: list[concurrent.futures.Future] = []

    def add(self, gradient: "GradToHost") -> concurrent.futures.Future:
        """Adds ``gradient`` on the worker; the future is done when it is added."""
        added = self._pool.submit(gradient.deliver)
        self._pending.append(added)
        return added

    def in_flight(self) -> int:
        return sum(not f.done() for f in self._pending)

    def wait(self) -> None:
        """Until every addition is done; the first failure, if any, raised here."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()


def start_grad_to_host(grad: torch.Tensor, shard: ShardParameter, owned: bool,
                       streams: OffloadStreams | None,
                       staging: torch.Tensor | None = None) -> GradToHost:
    """Starts moving a reduced gradient shard (1D, reduce dtype, on the compute device) towards
    ``shard`` in CPU memory. On the CPU (no streams) there is nothing to move. On CUDA it is
    copied into a pinned buffer on the download stream, once the compute stream's work so far
    (which includes waiting for the reduce-scatter) is done, and the compute stream goes on
    meanwhile."""
    if streams is None:
        assert grad.device.type == "cpu", "an offloaded gradient on CUDA without offload streams"
        return GradToHost(shard, grad, None, owned)
    # A staging buffer of the sharding's host arena (pinned; free again once the host added
    # its last gradient), else pinned from torch's caching host allocator, whose freed buffers
    # are reused only once the copies that touched them are complete. (Not pinned only in
    # tests that run this path with stand-in streams on a CPU.)
    if staging is not None:
        values = staging[:grad.numel()]
    else:
        values = torch.empty(grad.numel(), dtype=grad.dtype,
                             pin_memory=grad.device.type == "cuda")
    streams.download.wait_stream(torch.cuda.current_stream(grad.device))
    with torch.cuda.stream(streams.download):
        values.copy_(grad, non_blocking=True)
        copied = streams.download.record_event()
    # The device buffer belongs to the compute stream's pool: not to be reused before the copy.
    grad.record_stream(streams.download)
    # A staging buffer is used again: what is kept of it is a copy (accumulate_grad).
    return GradToHost(shard, values, copied, owned=staging is None)


def cpu_threads(requested: int | None, *, usable_cores: int, ranks_on_host: int,
                current: int) -> int:
    """CPU threads for a GPU rank that steps its optimizer on the CPU: ``requested`` when given,
    else this rank's share of the host's cores (never more than torch uses now): N ranks on one
    host each running a host-wide thread pool would oversubscribe it N times."""
    if requested is not None:
        return requested
    return max(1, min(current, usable_cores // max(ranks_on_host, 1)))
