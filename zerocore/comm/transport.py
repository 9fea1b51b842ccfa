"""How one flat group's all-gathers and gradient reductions travel between the ranks: the
strategies behind ``FlatGroup``, chosen once per sharding (``choose``: the ``Ways``) from
``zerocore.Comm`` and the compute device, each group building its own from them.

Gathers (each writes every rank's shard into the group's gathered buffer):
- ``"collective"``: the backend's all-gather (NCCL; on gloo ``all_gather_by_broadcast``, which
  copies less than gloo's own all-gather);
- ``"read"``: gloo ranks of one host read each other's shard out of their gathered buffers
  (``peer_memory.PeerMemory``: one kernel copy instead of TCP over loopback); a buffer may be
  freed only once the other ranks are done reading it;
- ``"nodes"``: a flat group of gloo ranks over several nodes (torchrun's, ``Mesh.nodes``), in
  two steps of point-to-point messages, across the nodes then within each
  (``GatherByNodes``): every shard crosses into each other node once, the least any gather
  can send across them.

Reductions (each leaves this rank's slice of the mean of every rank's packed gradient, computed
as ``mean_factors`` says on every backend: divide by ``pre``, SUM, divide by ``post``):
- ``"collective"``: NCCL's reduce-scatter with SUM; on gloo, at two ranks an all-reduce summed
  in place, from three ranks an all-to-all of the slices, summed in rank order (``Reduce``);
  one rank: no collective;
- ``"exchange"`` (two gloo ranks): each sends the half the other owns and adds what it
  receives: half the traffic of the all-reduce, the same bits (x + y == y + x);
- ``"read"`` (gloo ranks of one host): each reads the others' contributions to its slice, and
  sums them in rank order.
On gloo every way sums in rank order, ((g0 + g1) + g2) + ... (``sum_in_rank_order``; at two
ranks any order is the same sum), as do the small units' reductions that the lockstep carries
in its rows over gloo's collectives (comm/carried.py): the values are the same bits whichever
way they travel; only the cost differs, which is why the slower ways stay selectable
(``Comm(gather=..., reduce=...)``), for tests and benchmarks. (Gloo's own all-reduce sums in
its ring's order, which from three ranks differs in the last bits: docs/decisions.md, "Every
gloo reduction sums in rank order".)

HSDP (a 2-D mesh, comm/mesh.py): each of these runs within the shard group, and
``ReduceAcrossReplicas`` then all-reduces this rank's slice across the replicas (``Replicas``)
before the one division by the whole world, on the backward that requires it.

hpZ (a 2-D mesh with ``Hybrid("hpz")``): a forward's gather first gathers the primary shards
across the nodes into this rank's secondary shard (``AcrossNodes.start_gather``), then the
shard group's way gathers the layer from the secondary shards; backward's gather is the second
step alone. ``ReduceAcrossNodes`` reduces within the shard group to the secondary slice, then
reduce-scatters that across the nodes (``AcrossNodes.reduce_scatter``) before the one division.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from zerocore.comm import collectives, peer_memory, quantized_reduce
from zerocore.comm.collectives import sum_in_rank_order
from zerocore.comm.fake import is_fake
from zerocore.comm.peer_memory import PeerMemory
from zerocore.policies import Comm


@dataclasses.dataclass(frozen=True)
class Route:
    """What one group's transport needs of its model: the group, the counter, where it runs,
    and the on-host peer memory (None when reading is off or impossible)."""

    process_group: dist.ProcessGroup
    counter: collectives.CommCounter
    gloo: bool  # gloo on the CPU (else the backend's collectives on the device)
    peers: peer_memory.PeerMemory | None
    world_size: int
    # This rank in the group and every group rank's global rank (what the broadcasts name),
    # asked of the group once rather than at every gather.
    rank: int = 0
    global_ranks: tuple[int, ...] = (0,)
    # HSDP: the replicas this group's gradient slices are all-reduced over after the group's
    # own reduction; None: flat (the group's reduction is the whole mean).
    replicas: "Replicas | None" = None
    # hpZ: the nodes this group's secondary slices are reduce-scattered across after the
    # group's own reduction (and its primary shards gathered across before its gathers).
    across: "AcrossNodes | None" = None

    @staticmethod
    def of(group: dist.ProcessGroup, counter: collectives.CommCounter, gloo: bool,
           peers: peer_memory.PeerMemory | None, replicas: "Replicas | None" = None,
           across: "AcrossNodes | None" = None) -> "Route":
        world = group.size()
        return Route(group, counter, gloo, peers, world, group.rank(), group_ranks(group),
                     replicas, across)

    @property
    def second_stage(self) -> "Replicas | AcrossNodes | None":
        return self.replicas if self.replicas is not None else self.across

    @property
    def mean_world_size(self) -> int:
        """How many ranks' gradients the mean is over: the group's, times its replicas (or
        hpZ's nodes)."""
        stage = self.second_stage
        return self.world_size * (stage.size if stage is not None else 1)

    def factors(self, dtype: torch.dtype) -> "MeanFactors":
        """The mean's factors for this group's own way: the whole mean's, except that with
        replicas (or hpZ's nodes) the division after the sum waits for their reduction
        (``ReduceAcrossReplicas``, ``ReduceAcrossNodes``), so that it still comes once, after
        every rank's sum."""
        f = mean_factors(dtype, self.mean_world_size)
        return f if self.second_stage is None else MeanFactors(f.pre, 1)


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The group's ranks as global ranks (a planned world's group is not registered with
    torch.distributed, comm/fake.py: its own numbering)."""
    if is_fake(group):
        return tuple(range(group.size()))
    return tuple(dist.get_process_group_ranks(group))


class Gather:
    """An all-gather strategy of one group; ``start`` then ``wait`` for each gather."""

    name = "collective"

    def __init__(self, route: Route):
        self.route = route
        self._handles: list[dist.Work | None] = []

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        r = self.route
        if r.gloo:
            self._handles = collectives.all_gather_by_broadcast(
                out, source, r.process_group, r.counter, r.rank, r.global_ranks)
        else:
            self._handles = [collectives.all_gather(out, source, r.process_group, r.counter)]

    def wait(self, out: torch.Tensor) -> None:
        for handle in self._handles:
            if handle is not None:
                handle.wait()
        self._handles = []

    def before_free(self) -> None:
        """Waits until the gathered buffer may be given back (nothing to wait for here)."""

    def stages_parts(self) -> bool:
        """Whether the next gather receives the parts into buffers of its own, copied into
        the gathered buffer only by ``wait`` (comm/carried.py): that buffer is then needed
        from the wait on, not from the start."""
        return False


class GatherByNodes(Gather):
    """A flat group over R nodes of S ranks each (gloo), gathered in two steps: each rank sends
    its shard to the ranks of its column (the same place in the other nodes), then each sends
    the R shards of its column to the other ranks of its node. Each rank receives every shard
    once, so the bytes are an all-gather's (counted as one), and the R-1 shards from other
    nodes each cross a node boundary once: (R-1)·B in all per gather of B bytes, (R-1)/N·B
    sent across by each rank, the least possible (every node must receive the (R-1)/R·B it
    does not hold). A ring all-gather over the nodes in order (FSDP2's on gloo) sends
    (N-1)/N·B over each of R node boundaries, R·(N-1)/N·B in all; gloo's broadcasts (binomial
    trees, ``Gather``) more (2x2: 2.5·B). Every value is copied, never summed: the same bits
    as any other gather. The second step depends on the first, so ``start`` sends across
    the nodes and posts every receive, and ``wait`` sends within the node."""

    name = "nodes"
    TAG = 1  # its messages' tag: apart from the exchange's (reduce_scatter_by_exchange: 0)

    def __init__(self, route: Route, ranks_per_node: int):
        super().__init__(route)
        rows = node_rows(route.global_ranks, ranks_per_node)
        assert rows is not None, "GatherByNodes needs a group over nodes of equal rank counts"
        node, place = next((n, row.index(route.rank)) for n, row in enumerate(rows)
                           if route.rank in row)
        self._rows = rows    # group ranks, node by node
        self._node = node    # this rank's node (a row) and its place in it (a column)
        self._place = place
        self._first: list[dist.Work] = []  # the step across the nodes

    def _column(self, place: int) -> list[int]:
        """The group ranks at ``place`` in every node, in node order."""
        return [row[place] for row in self._rows]

    def _others(self) -> list[tuple[int, int]]:
        """(place, group rank) of the other ranks of this node."""
        return [(i, q) for i, q in enumerate(self._rows[self._node]) if i != self._place]

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        r = self.route
        r.counter.all_gather_bytes += collectives.nbytes(out)
        r.counter.all_gather_calls += 1
        chunks = out.chunk(r.world_size)
        if chunks[r.rank].data_ptr() != source.data_ptr():
            chunks[r.rank].copy_(source)
        me = r.global_ranks[r.rank]
        across = [g for g in self._column(self._place) if g != r.rank]
        self._first = [collectives.send(chunks[r.rank], r.global_ranks[g], r.process_group,
                                        r.counter, me, self.TAG) for g in across]
        self._first += [collectives.receive(chunks[g], r.global_ranks[g], r.process_group,
                                            self.TAG) for g in across]
        # From each other rank of this node, the shards of its column, in node order (the
        # order it sends them in: ``wait``).
        self._handles = [collectives.receive(chunks[c], r.global_ranks[q], r.process_group,
                                             self.TAG)
                         for i, q in self._others() for c in self._column(i)]

    def wait(self, out: torch.Tensor) -> None:
        r = self.route
        for handle in self._first:
            handle.wait()  # this column's shards are in
        self._first = []
        chunks = out.chunk(r.world_size)
        me = r.global_ranks[r.rank]
        self._handles += [collectives.send(chunks[c], r.global_ranks[q], r.process_group,
                                           r.counter, me, self.TAG)
                          for _, q in self._others() for c in self._column(self._place)]
        super().wait(out)


def node_rows(global_ranks: tuple[int, ...], ranks_per_node: int
              ) -> tuple[tuple[int, ...], ...] | None:
    """A group's ranks (its own numbers) node by node, the nodes numbered as torchrun numbers
    ranks (global rank g on node g // ranks_per_node), or None unless they span two or more
    nodes with as many of the group's ranks on each (``GatherByNodes``'s columns)."""
    nodes: dict[int, list[int]] = {}
    for i, g in enumerate(global_ranks):
        nodes.setdefault(g // ranks_per_node, []).append(i)
    rows = tuple(tuple(row) for _, row in sorted(nodes.items()))
    if len(rows) < 2 or len({len(row) for row in rows}) != 1:
        return None
    return rows


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
        peer_memory.start_gather_by_reading(out, source, r.peers, self._channel, self._seq,
                                            r.process_group, r.counter)

    def wait(self, out: torch.Tensor) -> None:
        r = self.route
        peer_memory.finish_gather_by_reading(out, r.peers, self._channel, self._seq,
                                             r.process_group)
        self._being_read = self._seq

    def before_free(self) -> None:
        if self._being_read is not None:
            t0 = collectives.now()
            peer_memory.wait_gather_read(self.route.peers, self._channel, self._being_read)
            self.route.counter.gather_wait_s += collectives.now() - t0
            self._being_read = None


@dataclasses.dataclass(frozen=True)
class MeanFactors:
    """How the mean of the ranks' gradients is computed: each rank divides its packed gradients
    by ``pre`` (a power of two, so exactly, unless a value underflows), the ranks SUM them, and
    each divides its slice of the sum by ``post``, in fp32 (torch's arithmetic for 16-bit
    tensors), rounded once to the reduce dtype. pre * post == the world size (HSDP: the shard
    group's way sums with post 1, and the replicas' stage divides by the rest:
    ``Route.factors``)."""

    pre: int
    post: float


def mean_factors(dtype: torch.dtype, world_size: int) -> MeanFactors:
    """The factors of the gradient mean over ``world_size`` ranks in ``dtype``: the same on every
    backend, so a CPU run and a GPU run of one job differ only by rounding (docs/decisions.md,
    "The gradient mean"). fp32 and bf16 (fp32's range): sum, then one division by the world
    size. fp16 (largest value 65504): the division is split, about √N before the sum (the
    smallest power of two whose square is at least N) and the rest after, so that neither does
    the sum overflow as soon, nor do the inputs lose their small end to a division by N."""
    pre = 1
    if dtype == torch.float16:
        while pre * pre < world_size:
            pre *= 2
    return MeanFactors(pre, world_size / pre)


def divided(t: torch.Tensor, factor: float) -> torch.Tensor:
    """t /= factor in place (nothing to do for 1); by a Python scalar, which torch divides by in
    fp32 for 16-bit tensors, rounding once."""
    return t if factor == 1 else t.div_(factor)


class Reduction:
    """A reduction in flight: ``finish`` returns this rank's averaged gradient slice. ``held``:
    the buffer the way holds beside the packed one until then (``Reduce.in_flight_nbytes``:
    NCCL's output, the exchange's received half), for a plan's count; None if none."""

    def __init__(self, finish: Callable[[], torch.Tensor], held: torch.Tensor | None = None):
        self._finish = finish
        self.held = held

    def finish(self) -> torch.Tensor:
        return self._finish()


class Reduce:
    """A gradient-reduction strategy of one group: ``start(packed, shard_range)`` for each
    reduction. ``owned``: the result is a tensor of its own, not a view of ``packed`` (which is
    reused from layer to layer once the result is delivered). This class is the "collective"
    way: NCCL's reduce-scatter; on gloo an all-reduce in place at two ranks (two summands: any
    order is the same sum), and from three ranks an all-to-all summed in rank order
    (``reduce_scatter_by_all_to_all``), the order of every other way of three ranks on gloo."""

    name = "collective"

    def __init__(self, route: Route):
        self.route = route

    # What the way holds beside the packed buffer, from sizes alone: what a plan's rehearsed
    # reduction allocates (``PlannedReduce``) and keeps. ``shard_nbytes``: one rank's slice of
    # the packed buffer, in the reduction's dtype.
    @staticmethod
    def in_flight_nbytes(shard_nbytes: int, gloo: bool, world_size: int) -> int:
        """Bytes a reduction in flight holds until it is finished: NCCL's reduce-scatter writes
        into an output of its own; gloo's all-reduce sums in place, its all-to-all receives
        every rank's slice into rows of its own."""
        if not gloo:
            return shard_nbytes
        return shard_nbytes * world_size if world_size > 2 else 0

    @staticmethod
    def kept_nbytes(largest_shard_nbytes: int, rank: int) -> int:
        """Bytes the way keeps from step to step on group rank ``rank`` (none: its buffers go
        with each reduction)."""
        return 0

    @property
    def owned(self) -> bool:
        return not self.route.gloo

    def before_pack(self) -> None:
        """Waits until a packing buffer may be overwritten (nothing to wait for here)."""

    def kept_tensors(self) -> list[torch.Tensor]:
        """Tensors the way keeps between reductions (HSDP's sums kept over micro-batches), for
        a plan's count; none here."""
        return []

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        factors = r.factors(packed.dtype)
        divided(packed, factors.pre)
        if not r.gloo:
            out = torch.empty(hi - lo, dtype=packed.dtype, device=packed.device)
            handle = collectives.reduce_scatter_sum(out, packed, r.process_group, r.counter)
            return Reduction(lambda: divided(_waited(handle, out), factors.post), held=out)
        if r.world_size > 2:
            rows = torch.empty(r.world_size, hi - lo, dtype=packed.dtype, device=packed.device)
            handle = collectives.reduce_scatter_by_all_to_all(rows, packed, r.process_group,
                                                              r.counter)

            def finish() -> torch.Tensor:
                handle.wait()
                mine = sum_in_rank_order(packed[lo:hi], r.rank, r.world_size,
                                         lambda q: rows[q])
                return divided(mine, factors.post)
            return Reduction(finish, held=rows)
        handle = collectives.all_reduce_sum_in_place(packed, r.process_group, r.counter)
        return Reduction(lambda: mean_of_sum(_waited(handle, packed), lo, hi, None, factors))


class ReduceByExchange(Reduce):
    name = "exchange"

    @staticmethod
    def in_flight_nbytes(shard_nbytes: int, gloo: bool, world_size: int) -> int:
        return shard_nbytes  # ``received``: the peer's half, until it is added


    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        factors = r.factors(packed.dtype)
        divided(packed, factors.pre)
        received = torch.empty(hi - lo, dtype=packed.dtype, device=packed.device)
        handles = collectives.reduce_scatter_by_exchange(packed, received, r.process_group,
                                                         r.counter)

        def finish() -> torch.Tensor:
            for handle in handles:
                if handle is not None:
                    handle.wait()
            return mean_of_sum(packed, lo, hi, received, factors)
        return Reduction(finish, held=received)


def others_slices(packed: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """The slices of ``packed`` that the other ranks keep, in rank order (all but this rank's
    own, [lo, hi)): what this rank sends in a reduction carried in the lockstep's rows
    (``carried.CarriedReduce``). At two ranks, the exchange's half."""
    return tuple(p for p in (packed[:lo], packed[hi:]) if p.numel())


class ReduceByReading(Reduce):
    name = "read"

    @staticmethod
    def in_flight_nbytes(shard_nbytes: int, gloo: bool, world_size: int) -> int:
        return 0  # read into the kept buffers below

    @staticmethod
    def kept_nbytes(largest_shard_nbytes: int, rank: int) -> int:
        # PeerMemory.received_buffer: the buffers the others' contributions are read into a
        # piece at a time, kept and grown to the largest piece read so far, so every step after
        # the first holds them from its start: one, and from rank 2 on a second (the sum of
        # the ranks before).
        piece = min(largest_shard_nbytes, peer_memory.READ_CHUNK_BYTES)
        return piece * (2 if rank >= 2 else 1)

    def __init__(self, route: Route):
        super().__init__(route)
        self._channel = route.peers.new_channel()
        self._seq = 0  # reductions started: every rank counts alike

    def before_pack(self) -> None:
        # The other ranks may still be reading an earlier packed buffer (maybe this one).
        self.route.peers.settle_reductions()

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        self._seq += 1
        seq = self._seq
        factors = r.factors(packed.dtype)
        divided(packed, factors.pre)  # before the other ranks are told they may read
        peer_memory.start_reduce_by_reading(packed, r.peers, self._channel, seq,
                                            r.process_group, r.counter)

        def finish() -> torch.Tensor:
            peer_memory.finish_reduce_by_reading(packed[lo:hi], r.peers, self._channel, seq,
                                                 r.process_group)
            return divided(packed[lo:hi], factors.post)
        return Reduction(finish)


def _waited(handle: dist.Work | None, result: torch.Tensor) -> torch.Tensor:
    if handle is not None:
        handle.wait()
    return result


def mean_of_sum(packed: torch.Tensor, lo: int, hi: int, received: torch.Tensor | None,
                 factors: MeanFactors) -> torch.Tensor:
    """This rank's slice of ``packed`` (plus the peer's contribution ``received``, if any),
    divided by ``factors.post``: the mean, as the collective way computes it."""
    mine = packed[lo:hi]
    if received is not None:
        mine.add_(received)  # x + y == y + x: the all-reduce's sum, bitwise
    return divided(mine, factors.post)


class Replicas:
    """HSDP's replicate dim, one per sharding and shared by its groups' reductions: the group a
    rank's gradient slices are all-reduced over (its replicas: the ranks holding the same
    shard), whether the reductions of the backward about to run are
    (``Sharding.set_requires_all_reduce``: False on the micro-batches before the last of an
    accumulation, as FSDP2's ``set_requires_all_reduce``), and whether they travel in int8
    (``quantize_block``: ``Comm(quantize_gradients="int8")``'s block; None: exact)."""

    def __init__(self, group: dist.ProcessGroup, counter: collectives.CommCounter,
                 quantize_block: int | None = None):
        self.group = group
        self.size = group.size()
        self.counter = counter
        self.quantize_block = quantize_block
        self.requires_all_reduce = True

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the replicas: ``t`` itself, summed in place; quantized, a new
        fp32 tensor (comm/quantized_reduce.py). Counted as crossing the replicas."""
        if self.quantize_block is not None:
            return quantized_reduce.all_reduce_int8(t, self.group, self.counter,
                                                    self.quantize_block)
        collectives.all_reduce_across_replicas(t, self.group, self.counter)
        return t

    def nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes one all-reduce of ``numel`` elements of ``dtype`` is counted as."""
        if self.quantize_block is not None:
            return quantized_reduce.message_nbytes(numel, self.size, self.quantize_block)
        return numel * dtype.itemsize


class ReduceAcrossReplicas(Reduce):
    """HSDP's reduction: the shard group's own way (``inner``) sums the packed gradients within
    the shard group (``Route.factors``: not yet divided); then this rank's slice, added to the
    sums earlier micro-batches kept (``_kept``, fp32), is all-reduced across the replicas and
    divided once by the whole world. On a backward whose reductions do not require the
    all-reduce, the slice's sum is kept (fp32) and no gradient is delivered (``finish``
    returns None): only the last micro-batch of an accumulation crosses the replicas."""

    def __init__(self, route: Route, inner: Reduce):
        super().__init__(route)
        self.inner = inner
        self.name = inner.name
        # 1D fp32, shard_numel: the shard group's sums of the micro-batches not yet all-reduced.
        self._kept: torch.Tensor | None = None

    @property
    def owned(self) -> bool:
        return self.inner.owned

    def before_pack(self) -> None:
        self.inner.before_pack()

    def kept_tensors(self) -> list[torch.Tensor]:
        return [] if self._kept is None else [self._kept]

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        replicas = self.route.replicas
        factors = mean_factors(packed.dtype, self.route.mean_world_size)
        required = replicas.requires_all_reduce  # as it was when this backward reduced
        reduction = self.inner.start(packed, lo, hi)

        def finish() -> torch.Tensor | None:
            mine = reduction.finish()  # this rank's slice, summed over the shard group
            if not required:
                if self._kept is None:
                    self._kept = mine.to(torch.float32, copy=True)  # mine may be reused
                else:
                    self._kept.add_(mine)
                return None
            if self._kept is not None:
                # One rounding to the reduce dtype of the micro-batches' fp32 sum, so that
                # the replicas' traffic is the same whatever the accumulation (none when it
                # travels quantized: the fp32 sum is quantized).
                kept, self._kept = self._kept.add_(mine), None
                exact = replicas.quantize_block is None
                mine = kept.to(mine.dtype) if exact and mine.dtype != torch.float32 else kept
            return divided(replicas.all_reduce(mine), factors.post)
        return Reduction(finish, held=reduction.held)


class AcrossNodes:
    """hpZ's replicate dim, one per sharding and shared by its groups: the group between the
    nodes (a shard column: the ranks holding slice s of S of every layer, one per node) over
    which each forward gathers the ranks' primary shards into their secondary shard
    (``start_gather``), and over which each gradient's secondary slice, summed within the node,
    is reduce-scattered to the primary shards (``reduce_scatter``), exactly or, with
    ``quantize_block`` (``Comm(quantize_gradients="int8")``), in int8 (qgZ). Both counted as
    crossing the nodes. ``shards``: the shard group's size S (a secondary shard is 1/S of a
    layer). ``gloo``: gloo on the CPU (the gathers by broadcasts, the reduce-scatter an
    all-reduce in place); ``planned``: a plan's step (comm/fake.py), whose gathers are the
    plain collective."""

    def __init__(self, group: dist.ProcessGroup, counter: collectives.CommCounter, *,
                 shards: int, gloo: bool, planned: bool = False,
                 quantize_block: int | None = None):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.global_ranks = group_ranks(group)
        self.counter = counter
        self.shards = shards
        self.gloo = gloo
        self.planned = planned
        self.quantize_block = quantize_block

    def start_gather(self, out: torch.Tensor, source: torch.Tensor) -> list[dist.Work | None]:
        """Starts out (1D, the secondary shard: R primary shards) <- every node's primary
        shard ``source`` of this column, in replicate-group rank order; ``wait_gather`` the
        handles returned."""
        return collectives.all_gather_across_nodes(
            out, source, self.group, self.counter, self.gloo and not self.planned, self.rank,
            self.global_ranks)

    @staticmethod
    def wait_gather(handles: list[dist.Work | None]) -> None:
        for handle in handles:
            if handle is not None:
                handle.wait()

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's primary slice of the sum across the nodes of ``t`` (1D, the secondary
        slice, summed within each node), synchronously: a view of ``t`` (gloo, exact), or a
        tensor of its own (the device backend's; quantized: fp32)."""
        if self.quantize_block is not None:
            return quantized_reduce.reduce_scatter_int8(t, self.group, self.counter,
                                                        self.quantize_block)
        return collectives.reduce_scatter_across_nodes(t, self.group, self.counter, self.gloo)

    def gather_nbytes(self, gathered_nbytes: int) -> int:
        """Bytes one cross-node gather of a group whose whole gather moves ``gathered_nbytes``
        is counted as: its secondary shard, 1/S of it."""
        return gathered_nbytes // self.shards

    def reduce_nbytes(self, padded_numel: int, dtype: torch.dtype) -> int:
        """Bytes one cross-node reduce-scatter of a group of ``padded_numel`` elements reduced
        in ``dtype`` is counted as: its secondary slice, or that slice's int8 message."""
        numel = padded_numel // self.shards
        if self.quantize_block is not None:
            return quantized_reduce.reduce_scatter_message_nbytes(numel, self.size,
                                                                  self.quantize_block)
        return numel * dtype.itemsize


class ReduceAcrossNodes(Reduce):
    """hpZ's reduction: the shard group's own way (``inner``) sums the packed gradients within
    the node into this rank's secondary slice (``Route.factors``: not yet divided), which is
    reduce-scattered across the nodes to this rank's primary shard (``AcrossNodes``) and
    divided once by the whole world: the mean the flat layout computes, summed in another
    order. Every micro-batch crosses the nodes: the state is sharded over every rank, so there
    is no replica to defer to (``set_requires_all_reduce`` changes nothing here)."""

    def __init__(self, route: Route, inner: Reduce):
        super().__init__(route)
        self.inner = inner
        self.name = inner.name

    @property
    def owned(self) -> bool:
        # A quantized reduce-scatter's result is a tensor of its own; the exact one is a view
        # of the inner way's result where that is one.
        return self.inner.owned or self.route.across.quantize_block is not None

    def before_pack(self) -> None:
        self.inner.before_pack()

    def kept_tensors(self) -> list[torch.Tensor]:
        return self.inner.kept_tensors()

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        """``lo, hi``: this rank's primary shard (its slice s·R + r); the shard group's way
        reduces to its secondary slice s, which holds it."""
        r = self.route
        factors = mean_factors(packed.dtype, r.mean_world_size)
        per = packed.numel() // r.world_size
        reduction = self.inner.start(packed, r.rank * per, (r.rank + 1) * per)

        def finish() -> torch.Tensor:
            mine = reduction.finish()  # the secondary slice, summed over the shard group
            return divided(r.across.reduce_scatter(mine), factors.post)
        return Reduction(finish, held=reduction.held)


GATHERS: dict[str, type[Gather]] = {"collective": Gather, "read": GatherByReading,
                                    "nodes": GatherByNodes}
REDUCES: dict[str, type[Reduce]] = {"collective": Reduce, "exchange": ReduceByExchange,
                                    "read": ReduceByReading}


def resolve(comm: Comm, *, gloo: bool, world_size: int, can_read: bool,
            over_nodes: bool = False) -> tuple[str, str]:
    """The names of the gather and reduce ways ``comm`` asks for, here. ``"auto"`` takes the
    fastest that applies: reading on one host, else for gloo ranks over several nodes
    (``over_nodes``: ``node_rows`` applies) the gather by nodes, for two gloo ranks the
    exchange, else the collectives. A way asked for by name that does not apply is refused
    (the same on every rank: every rank knows the same facts)."""
    two = gloo and world_size == 2
    by_nodes = gloo and over_nodes
    gather = comm.gather if comm.gather != "auto" else (
        "read" if can_read else "nodes" if by_nodes else "collective")
    if gather == "nodes" and not by_nodes:
        raise ValueError(f"zerocore.Comm(gather='nodes') needs a flat layout of gloo ranks on "
                         f"the CPU over two or more torchrun nodes, as many on each (this "
                         f"group: {'gloo' if gloo else 'not gloo on the CPU'}, "
                         f"{'over such nodes' if over_nodes else 'not over such nodes'}); "
                         f"use 'auto' or 'collective'")
    if comm.reduce != "auto":
        reduce = comm.reduce
    else:
        reduce = "read" if can_read else "exchange" if two else "collective"
    if "read" in (gather, reduce) and not can_read:
        raise ValueError(f"zerocore.Comm(gather={comm.gather!r}, reduce={comm.reduce!r}): "
                         f"reading another rank's memory needs two or more gloo ranks of one "
                         f"Linux host that may read each other's memory; "
                         f"use 'auto' or 'collective'")
    if reduce == "exchange" and not two:
        ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
        raise ValueError(f"zerocore.Comm(reduce={comm.reduce!r}) needs exactly two gloo ranks "
                         f"on the CPU (this group: {ranks}, "
                         f"{'gloo' if gloo else 'not gloo on the CPU'}); use 'auto' or "
                         f"'collective'")
    return gather, reduce


@dataclasses.dataclass(frozen=True)
class Ways:
    """How every flat group of one sharded model gathers and reduces: chosen once per sharding
    (``choose``, a step every rank takes together), then each group builds its own strategies
    from it (``strategies``)."""

    gather: str     # a name of GATHERS
    reduce: str     # a name of REDUCES
    gloo: bool      # gloo's collectives on the CPU (else the device backend's: NCCL)
    why: str        # why these, for the start-up line
    # A plan's step (``zerocore.plan``, over comm/fake.py's group): nothing moves, and each
    # way holds beside the packed buffer what it says it holds (``Reduce.in_flight_nbytes``).
    planned: bool = False
    # How the ranks share the model (``Mesh.line``: flat, or HSDP's shards and replicas).
    layout: str = ""
    # Torchrun's ranks per node, for the gather by nodes (``GatherByNodes``); else None.
    ranks_per_node: int | None = None

    def line(self) -> str:
        ways = f"gather: {self.gather}; reduce: {self.reduce} ({self.why})"
        return f"{self.layout}; {ways}" if self.layout else ways


def choose(group: dist.ProcessGroup, device: torch.device, comm: Comm,
           peers: PeerMemory | None, layout: str = "", nodes: int | None = None) -> Ways:
    """Collective (every rank of ``group``, at the same point): the ways ``comm`` asks for on
    ``device``. Whether gloo ranks may read each other's memory is probed here, once, by all of
    them; every rank learns the same facts, so every rank chooses alike. With HSDP ``group``
    is the shard group: ranks read only the memory of their own group's ranks, and only when
    the probe finds them on one host. ``layout``: ``Mesh.line()``, for the start-up line.
    ``nodes``: the torchrun nodes a flat layout spans (``Mesh.nodes``, agreed with the mesh),
    the world's ranks numbered node by node, as torchrun numbers them."""
    gloo = device.type == "cpu"
    world_size = group.size()
    can_read = gloo and peers is not None and peers.probe(group)
    per_node = (dist.get_world_size() // nodes
                if nodes is not None and nodes > 1 and dist.get_world_size() % nodes == 0
                else None)
    over_nodes = per_node is not None and node_rows(group_ranks(group), per_node) is not None
    gather, reduce = resolve(comm, gloo=gloo, world_size=world_size, can_read=can_read,
                             over_nodes=over_nodes)
    if world_size == 1:
        why = "one rank: nothing to exchange"
    elif not gloo:
        why = f"the {device.type} backend's collectives"
    elif can_read:
        why = "gloo ranks of one host, reading each other's memory"
    elif peers is None:
        why = "gloo's collectives: reading each other's memory is off (Comm(peer_read='off'))"
    else:
        because = peers.unavailable_because or "the ranks may not read each other's memory"
        why = f"gloo's collectives: {because}"
    if gather == "nodes":
        why += f"; gathered across the {nodes} nodes, then within each"
    if (comm.gather, comm.reduce) != ("auto", "auto"):
        why += f"; asked for gather={comm.gather!r}, reduce={comm.reduce!r}"
    return Ways(gather, reduce, gloo, why, layout=layout,
                ranks_per_node=per_node if gather == "nodes" else None)


def planned(comm: Comm, *, device_kind: str, world_size: int, nodes: int = 1) -> Ways:
    """The ways a real run on ``device_kind`` would choose for ``comm`` (on the CPU: ranks of
    one Linux host that may read each other's memory, unless reading is off, or of ``nodes``
    nodes, a flat layout's), as a plan runs them: moving nothing, holding what they hold
    (every gather way holds the gathered buffer alone)."""
    gloo = device_kind == "cpu"
    over_nodes = nodes > 1 and world_size % nodes == 0
    gather, reduce = resolve(comm, gloo=gloo, world_size=world_size,
                             can_read=(gloo and world_size > 1 and comm.peer_read == "auto"
                                       and not over_nodes),
                             over_nodes=over_nodes)
    return Ways(gather, reduce, gloo, "planned", planned=True)


def strategies(ways: Ways, route: Route) -> tuple[Gather, Reduce]:
    """One group's gather and reduce strategies, of the ways chosen for its sharding (the
    reduction wrapped in ``ReduceAcrossReplicas`` when the route has replicas, in
    ``ReduceAcrossNodes`` when it crosses hpZ's nodes)."""
    if ways.planned:
        gather, reduce = PlannedGather(route, ways.gather), PlannedReduce(route,
                                                                          REDUCES[ways.reduce])
    elif ways.gather == "nodes":
        gather, reduce = GatherByNodes(route, ways.ranks_per_node), REDUCES[ways.reduce](route)
    else:
        gather, reduce = GATHERS[ways.gather](route), REDUCES[ways.reduce](route)
    if route.replicas is not None:
        reduce = ReduceAcrossReplicas(route, reduce)
    if route.across is not None:
        reduce = ReduceAcrossNodes(route, reduce)
    return gather, reduce


class PlannedGather(Gather):
    """A gather of a plan's step: the collective over the fake group, which writes nothing
    (every gather way holds no memory but the gathered buffer)."""

    def __init__(self, route: Route, name: str):
        super().__init__(route)
        self.name = name

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        r = self.route
        self._handles = [collectives.all_gather(out, source, r.process_group, r.counter)]


class PlannedReduce(Reduce):
    """A reduction of a plan's step: what ``way`` holds while it is in flight is allocated (a
    fake tensor), and its result is what the way's is (this rank's slice of the packed buffer
    on gloo, a tensor of its own on the device backend); no value is computed."""

    def __init__(self, route: Route, way: type[Reduce]):
        super().__init__(route)
        self.way = way
        self.name = way.name

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        r = self.route
        mine = packed[lo:hi]
        held = self.way.in_flight_nbytes(mine.numel() * mine.element_size(), r.gloo,
                                         r.world_size)
        side = torch.empty(held, dtype=torch.uint8, device=packed.device)
        handle = collectives.all_reduce_sum_in_place(packed, r.process_group, r.counter)

        def finish() -> torch.Tensor:
            _waited(handle, packed)
            # ``side`` lives until the reduction is delivered (the closure holds it), as the
            # exchange's received half does; on the device backend it is the result.
            if self.owned:
                return side.view(packed.dtype)
            return divided(mine, r.world_size)
        return Reduction(finish, held=side)


def ways(layers: Iterable[Any]) -> str:
    """How the groups of these layers (``ShardedLayer``) move their parameters and gradients,
    for reports: "gather: read; reduce: read" (several names when the groups differ; frozen
    groups reduce nothing)."""
    gathers = sorted({g.gather.name for layer in layers for g in layer.groups})
    reduces = sorted({g.reduce.name for layer in layers for g in layer.groups if g.trainable})
    return "; ".join(f"{what}: {', '.join(names)}" for what, names
                     in (("gather", gathers), ("reduce", reduces)) if names)
