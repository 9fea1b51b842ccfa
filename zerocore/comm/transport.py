"""How one flat group's all-gathers and gradient reductions travel between the ranks: the
strategies behind ``FlatGroup``, chosen once per group from ``zerocore.Comm`` and the backend.

Gathers (each writes every rank's shard into the group's gathered buffer):
- ``"collective"``: the backend's all-gather (NCCL; on gloo ``all_gather_by_broadcast``, which
  copies less than gloo's own all-gather);
- ``"read"``: gloo ranks of one host read each other's shard out of their gathered buffers
  (``collectives.PeerMemory``: one kernel copy instead of TCP over loopback); a buffer may be
  freed only once the other ranks are done reading it.

Reductions (each leaves this rank's slice of the mean of every rank's packed gradient):
- ``"collective"``: NCCL's reduce-scatter with AVG; on gloo an all-reduce summed in place (its
  ring's order of summation), then this rank's slice divided by the world size (gloo's AVG);
- ``"exchange"`` (two gloo ranks): each sends the half the other owns and adds what it
  receives: half the traffic of the all-reduce, the same bits (x + y == y + x);
- ``"read"`` (two gloo ranks of one host): each reads the other's contribution to its half.
The values are the same bits whichever way they travel; only the cost differs, which is why
the slower ways stay selectable (``Comm(gather=..., reduce=...)``), for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from zerocore.comm import collectives
from zerocore.policies import Comm


@dataclasses.dataclass(frozen=True)
class Route:
    """What one group's transport needs of its model: the group, the counter, where it runs,
    and the on-host peer memory (None when reading is off or impossible)."""

    process_group: dist.ProcessGroup
    counter: collectives.CommCounter
    gloo: bool  # gloo on the CPU (else the backend's collectives on the device)
    peers: collectives.PeerMemory | None
    world_size: int


class Gather:
    """An all-gather strategy of one group; ``start`` then ``wait`` for each gather."""

    name = "collective"

    def __init__(self, route: Route):
        self.route = route
        self._handles: list[dist.Work | None] = []

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        r = self.route
        if r.gloo:
            self._handles = collectives.all_gather_by_broadcast(out, source, r.process_group,
                                                                r.counter)
        else:
            self._handles = [collectives.all_gather(out, source, r.process_group, r.counter)]

    def wait(self, out: torch.Tensor) -> None:
        for handle in self._handles:
            if handle is not None:
                handle.wait()
        self._handles = []

    def before_free(self) -> None:
        """Waits until the gathered buffer may be given back (nothing to wait for here)."""


class GatherByReading(Gather):
    name = "read"

    def __init__(self, route: Route):
        super().__init__(route)
        self._channel = route.peers.new_channel()  # this group's messages among the ranks
        self._seq = 0  # gathers started: every rank counts alike
        self._being_read: int | None = None  # the gather others may still be reading

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        r = self.route
        self._seq += 1
        collectives.start_gather_by_reading(out, source, r.peers, self._channel, self._seq,
                                            r.process_group, r.counter)

    def wait(self, out: torch.Tensor) -> None:
        r = self.route
        collectives.finish_gather_by_reading(out, r.peers, self._channel, self._seq,
                                             r.process_group)
        self._being_read = self._seq

    def before_free(self) -> None:
        if self._being_read is not None:
            t0 = collectives.now()
            collectives.wait_gather_read(self.route.peers, self._channel, self._being_read)
            self.route.counter.gather_wait_s += collectives.now() - t0
            self._being_read = None


class Reduction:
    """A reduction in flight: ``finish`` returns this rank's averaged gradient slice."""

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self._finish = finish

    def finish(self) -> torch.Tensor:
        return self._finish()


class Reduce:
    """A gradient-reduction strategy of one group: ``start(packed, shard_range)`` for each
    reduction. ``owned``: the result is a tensor of its own, not a view of ``packed`` (which is
    reused from layer to layer once the result is delivered)."""

    name = "collective"

    def __init__(self, route: Route):
        self.route = route

    # What the way holds beside the packed buffer, for ``zerocore.plan`` (which has no group to
    # build one on, so these read only sizes). ``shard_nbytes``: one rank's slice of the packed
    # buffer, in the reduction's dtype.
    @staticmethod
    def in_flight_nbytes(shard_nbytes: int, gloo: bool) -> int:
        """Bytes a reduction in flight holds until it is finished: NCCL's reduce-scatter writes
        into an output of its own; gloo's all-reduce sums in place."""
        return 0 if gloo else shard_nbytes

    @staticmethod
    def kept_nbytes(largest_shard_nbytes: int) -> int:
        """Bytes the way keeps from step to step (none: its buffers go with each reduction)."""
        return 0

    @property
    def owned(self) -> bool:
        return not self.route.gloo

    def before_pack(self) -> None:
        """Waits until a packing buffer may be overwritten (nothing to wait for here)."""

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        if not r.gloo:
            out = torch.empty(hi - lo, dtype=packed.dtype, device=packed.device)
            handle = collectives.reduce_scatter_avg(out, packed, r.process_group, r.counter)
            return Reduction(lambda: _waited(handle, out))
        handle = collectives.all_reduce_sum_in_place(packed, r.process_group, r.counter)
        return Reduction(lambda: _mean_of_sum(_waited(handle, packed), lo, hi, None,
                                              r.world_size))


class ReduceByExchange(Reduce):
    name = "exchange"

    @staticmethod
    def in_flight_nbytes(shard_nbytes: int, gloo: bool) -> int:
        return shard_nbytes  # ``received``: the peer's half, until it is added


    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        received = torch.empty(hi - lo, dtype=packed.dtype, device=packed.device)
        handles = collectives.reduce_scatter_by_exchange(packed, received, r.process_group,
                                                         r.counter)

        def finish() -> torch.Tensor:
            for handle in handles:
                if handle is not None:
                    handle.wait()
            return _mean_of_sum(packed, lo, hi, received, r.world_size)
        return Reduction(finish)


class ReduceByReading(Reduce):
    name = "read"

    @staticmethod
    def in_flight_nbytes(shard_nbytes: int, gloo: bool) -> int:
        return 0  # read into the kept buffer below

    @staticmethod
    def kept_nbytes(largest_shard_nbytes: int) -> int:
        # PeerMemory.received_buffer: one buffer the peer's contribution is read into, kept
        # and grown to the largest shard reduced so far, so every step after the first holds
        # it from its start.
        return largest_shard_nbytes

    def __init__(self, route: Route):
        super().__init__(route)
        self._channel = route.peers.new_channel()
        self._seq = 0  # reductions started: every rank counts alike

    def before_pack(self) -> None:
        # The other rank may still be reading an earlier packed buffer (maybe this one).
        self.route.peers.settle_reductions()

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        self._seq += 1
        seq = self._seq
        collectives.start_reduce_by_reading(packed, r.peers, self._channel, seq,
                                            r.process_group, r.counter)

        def finish() -> torch.Tensor:
            received = collectives.finish_reduce_by_reading(
                r.peers, self._channel, seq, hi - lo, packed.dtype, r.process_group)
            return _mean_of_sum(packed, lo, hi, received, r.world_size)
        return Reduction(finish)


def _waited(handle: dist.Work | None, result: torch.Tensor) -> torch.Tensor:
    if handle is not None:
        handle.wait()
    return result


def _mean_of_sum(packed: torch.Tensor, lo: int, hi: int, received: torch.Tensor | None,
                 world_size: int) -> torch.Tensor:
    """This rank's slice of ``packed`` (plus the peer's contribution ``received``, if any),
    divided by the world size: sum, then divide, as gloo's AVG does, so the same mean bitwise."""
    mine = packed[lo:hi]
    if received is not None:
        mine.add_(received)  # x + y == y + x: the all-reduce's sum, bitwise
    return mine.div_(world_size)


GATHERS: dict[str, type[Gather]] = {"collective": Gather, "read": GatherByReading}
REDUCES: dict[str, type[Reduce]] = {"collective": Reduce, "exchange": ReduceByExchange,
                                    "read": ReduceByReading}


def resolve(comm: Comm, *, gloo: bool, world_size: int, can_read: bool) -> tuple[str, str]:
    """The names of the gather and reduce ways ``comm`` asks for, here. ``"auto"`` takes the
    fastest that applies: reading on one host, else for two gloo ranks the exchange, else the
    collectives. A way asked for by name that does not apply is refused (the same on every
    rank: every rank knows the same facts)."""
    two = gloo and world_size == 2
    gather = comm.gather if comm.gather != "auto" else ("read" if can_read else "collective")
    if comm.reduce != "auto":
        reduce = comm.reduce
    else:
        reduce = "read" if can_read and two else "exchange" if two else "collective"
    if "read" in (gather, reduce) and not can_read:
        raise ValueError(f"zerocore.Comm(gather={comm.gather!r}, reduce={comm.reduce!r}): "
                         f"reading another rank's memory needs two or more gloo ranks of one "
                         f"Linux host that may read each other's memory; "
                         f"use 'auto' or 'collective'")
    if reduce in ("read", "exchange") and not two:
        ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
        raise ValueError(f"zerocore.Comm(reduce={comm.reduce!r}) needs exactly two gloo ranks "
                         f"on the CPU (this group: {ranks}, "
                         f"{'gloo' if gloo else 'not gloo on the CPU'}); use 'auto' or "
                         f"'collective'")
    return gather, reduce


def choose(route: Route, comm: Comm) -> tuple[Gather, Reduce]:
    """The group's gather and reduce strategies (``resolve``; whether ranks may read each
    other's memory is probed, a collective: the same answer on every rank)."""
    can_read = route.gloo and route.peers is not None and route.peers.probe(route.process_group)
    gather, reduce = resolve(comm, gloo=route.gloo, world_size=route.world_size,
                             can_read=can_read)
    return GATHERS[gather](route), REDUCES[reduce](route)


def ways(layers: Iterable[Any]) -> str:
    """How the groups of these layers (``ShardedLayer``) move their parameters and gradients,
    for reports: "gather: read; reduce: read" (several names when the groups differ; frozen
    groups reduce nothing)."""
    gathers = sorted({g.gather.name for layer in layers for g in layer.groups})
    reduces = sorted({g.reduce.name for layer in layers for g in layer.groups if g.trainable})
    return "; ".join(f"{what}: {', '.join(names)}" for what, names
                     in (("gather", gathers), ("reduce", reduces)) if names)
