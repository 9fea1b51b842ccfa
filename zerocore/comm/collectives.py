"""The plain c10d collectives of ZeRO-3, as functions over an explicit process group, each
counting the bytes it moves in a ``CommCounter`` the caller passes in (and the few blocking
collectives of small metadata, which are not counted).

All the counted ones are issued with ``async_op=True`` and return a handle: on NCCL the
collective runs on the process group's own CUDA stream, which c10d orders after the work already
queued on the current stream (so an all-gather issued after the optimizer step sees the updated
shards) and ``handle.wait()`` makes the current stream wait for it without blocking the host; on
gloo it runs on gloo's threads, so the next layer's all-gather overlaps this layer's computation.

gloo ranks of one host that may read each other's memory gather and reduce without these
(``peer_memory``).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Callable

import torch
import torch.distributed as dist


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); the GPU machines
# run older torch. Resolve the name once, here.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class CommCounter:
    """Bytes moved per kind of collective, counted as the size of the unsharded buffer (the
    all-gather output, the reduce-scatter input): the quantity the 3Ψ estimate is about."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    # Collectives issued (a gather of one broadcast per rank, or by reading, is one): none for
    # one rank, where the bytes above are still counted (the estimate counts them).
    all_gather_calls: int = 0
    # Parameter-group gathers the engine started, whatever their way and the world size (one
    # rank's, a copy with no collective, included): how often a model's weights were gathered.
    group_gathers: int = 0
    reduce_scatter_calls: int = 0
    all_reduce_calls: int = 0
    # HSDP: gradient shards all-reduced across the replicas (the replicate group: between
    # nodes), counted as the shard-sized buffer each all-reduce sums; all the above stay in
    # the shard group. None issued for one replica, where the bytes are still counted.
    replica_all_reduce_bytes: int = 0
    replica_all_reduce_calls: int = 0
    # hpZ: gathers of primary shards into secondary shards and reduce-scatters of secondary
    # gradient slices over the replicate group (between nodes), counted as above (the
    # gathered secondary shard; the secondary slice reduced, or its int8 message); the
    # fields above then hold the shard group's (within the node) alone.
    replicate_all_gather_bytes: int = 0
    replicate_all_gather_calls: int = 0
    replicate_reduce_scatter_bytes: int = 0
    replicate_reduce_scatter_calls: int = 0
    # Bytes this rank sent to each other rank (global ranks: (from, to)), for the ways built of
    # point-to-point messages, whose every byte is known where it is sent (``send``; a flat
    # layout's gather across nodes: transport.GatherByNodes); the backend's collectives choose
    # their own links and are not in it.
    link_bytes: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    # Seconds the calling thread spent (time.perf_counter) issuing gathers (allocating the
    # gathered buffer, copying its own shard, enqueueing), blocked waiting for them, packing
    # and issuing gradient reductions, and blocked waiting for those (then averaging): where
    # communication was not hidden behind computation, for a step's breakdown. On CUDA the
    # waits make a stream wait and return at once, so only issuing shows there.
    gather_issue_s: float = 0.0
    gather_wait_s: float = 0.0
    reduce_issue_s: float = 0.0
    reduce_wait_s: float = 0.0

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, {} if isinstance(value, dict) else type(value)(0))


now = time.perf_counter  # the clock of CommCounter's seconds


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
               counter: CommCounter) -> dist.Work | None:
    """output (1D, world_size * shard.numel()) <- every rank's shard, in rank order."""
    counter.all_gather_bytes += nbytes(output)
    counter.all_gather_calls += 1
    return _all_gather_single(output, shard, group=group, async_op=True)


def all_gather_across_nodes(output: torch.Tensor, shard: torch.Tensor,
                            group: dist.ProcessGroup, counter: CommCounter, gloo: bool,
                            rank: int, global_ranks: tuple[int, ...]) -> list[dist.Work | None]:
    """hpZ's gather over the replicate group: ``all_gather`` (on gloo
    ``all_gather_by_broadcast``), counted as crossing the nodes."""
    counter.replicate_all_gather_bytes += nbytes(output)
    counter.replicate_all_gather_calls += 1
    if gloo:
        return _broadcast_each(output, shard, group, rank, len(global_ranks))
    return [_all_gather_single(output, shard, group=group, async_op=True)]


def all_gather_by_broadcast(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                            counter: CommCounter, rank: int | None = None,
                            global_ranks: tuple[int, ...] | None = None
                            ) -> list[dist.Work | None]:
    """The same result as ``all_gather``, as one broadcast per rank received in place into its
    slice of output, in rank order on every rank. For gloo, whose all-gather gathers into a
    temporary and copies it out: this takes about a third less CPU per gather (2 ranks, 2
    cores, bench/RESULTS.md). ``rank``, ``global_ranks``: this rank in the group and the
    group's ranks as global ranks, when the caller knows them (asked of the group otherwise)."""
    counter.all_gather_bytes += nbytes(output)
    if rank is None or global_ranks is None:
        rank, global_ranks = dist.get_rank(group), tuple(dist.get_process_group_ranks(group))
    world = len(global_ranks)
    if world == 1:
        # One rank: the gather is a copy, and a collective of one would cost ~50-150 µs of
        # gloo's bookkeeping per call (bench/layer_cost.py).
        output.copy_(shard)
        return []
    counter.all_gather_calls += 1
    return _broadcast_each(output, shard, group, rank, world)


def _broadcast_each(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                    rank: int, world: int) -> list[dist.Work | None]:
    """``all_gather_by_broadcast``'s broadcasts (``rank`` and ``world``: in ``group``'s
    numbering), uncounted."""
    slices = output.chunk(world)
    handles = [broadcast_from(shard if r == rank else slices[r], r, group)
               for r in range(world)]
    if slices[rank].data_ptr() != shard.data_ptr():  # (hpZ gathers in place)
        slices[rank].copy_(shard)  # while the other ranks' slices arrive
    return handles

# Float types of one byte, which gloo does not know; a broadcast copies bytes, so they travel as
# uint8 (torch.distributed's own broadcast does the same on GPUs before sm_90).
_BYTE_FLOATS = frozenset(getattr(torch, name) for name in
                         ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                         if hasattr(torch, name))


def broadcast_from(t: torch.Tensor, root: int, group: dist.ProcessGroup) -> dist.Work:
    """Starts broadcasting ``t`` (contiguous) from rank ``root`` of ``group`` (the group's
    numbering, not a global rank), received in place on the others. The process group's own
    call: ``dist.broadcast`` issues the same one after translating a global rank and checking
    its arguments, about 33 µs of host time per call on a 2-core machine (one gloo rank,
    ``timeit``), and a small unit's gather on gloo issues one broadcast per rank, on the
    critical path of a host-bound step (docs/decisions.md, "Broadcasts issued by the process
    group")."""
    if t.is_complex() or t.dtype in _BYTE_FLOATS:
        t = t.view(torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return group.broadcast([t], opts)


def send(t: torch.Tensor, to: int, group: dist.ProcessGroup, counter: CommCounter, me: int,
         tag: int) -> dist.Work:
    """Starts sending ``t`` to global rank ``to``, counted on the link (``me``, ``to``). gloo
    matches a message to a receive by its sender and tag, in the order each side posts them:
    every way that sends to a peer while another may also be in flight uses a tag of its own."""
    counter.link_bytes[me, to] = counter.link_bytes.get((me, to), 0) + nbytes(t)
    return dist.isend(t, dst=to, group=group, tag=tag)


def receive(t: torch.Tensor, source: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
    """Starts receiving ``t`` from global rank ``source`` (counted by its sender)."""
    return dist.irecv(t, src=source, group=group, tag=tag)


def all_reduce_sum_in_place(full: torch.Tensor, group: dist.ProcessGroup,
                            counter: CommCounter) -> dist.Work | None:
    """Starts summing ``full`` over ranks in place: this rank's slice of it is then what
    ``reduce_scatter_sum`` gives (gloo's reduce-scatter is that same all-reduce, so the values
    are bitwise equal). For gloo, whose reduce-scatter clones the whole input and all-reduces
    the clone: on a buffer we may overwrite, this saves the clone. Counted as the
    reduce-scatter it stands for. One rank: no collective (the sum over one rank is its own
    values)."""
    counter.reduce_scatter_bytes += nbytes(full)
    if dist.get_world_size(group) == 1:
        return None
    counter.reduce_scatter_calls += 1
    return dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_by_exchange(full: torch.Tensor, received: torch.Tensor,
                               group: dist.ProcessGroup, counter: CommCounter
                               ) -> list[dist.Work | None]:
    """Two ranks: starts sending the peer its half of ``full`` and receiving the peer's
    contribution to this rank's half into ``received`` (1D, full.numel() / 2); the caller then
    adds ``received`` into its half. Half the traffic of
    ``all_reduce_sum_in_place`` (gloo's all-reduce sends and receives the whole buffer: a
    reduce-scatter, then an all-gather of the sums this rank does not need) and, on gloo over
    loopback, about half its time (16 MiB: 8 ms instead of 17.6). Bitwise the same sum: with
    two summands the order of an addition does not change its result. Counted as the
    reduce-scatter it stands for."""
    assert dist.get_world_size(group) == 2, "reduce_scatter_by_exchange is for two ranks"
    counter.reduce_scatter_bytes += nbytes(full)
    counter.reduce_scatter_calls += 1
    rank = dist.get_rank(group)
    peer = dist.get_global_rank(group, 1 - rank)
    halves = full.chunk(2)
    return [dist.isend(halves[1 - rank], dst=peer, group=group),
            dist.irecv(received, src=peer, group=group)]


def reduce_scatter_by_all_to_all(rows: torch.Tensor, full: torch.Tensor,
                                 group: dist.ProcessGroup, counter: CommCounter
                                 ) -> dist.Work | None:
    """Gloo, three ranks and more: starts sending each rank its slice of ``full`` and receiving
    every rank's contribution to this rank's slice into ``rows`` (world_size x
    full.numel() / world_size, in rank order; this rank's own row a local copy); the caller
    then sums them in rank order (``sum_in_rank_order``, below), which gloo's all-reduce
    (its ring's order) does not. Half the traffic of ``all_reduce_sum_in_place``: each rank
    sends and receives (N - 1) / N of the buffer once. Counted as the reduce-scatter it stands
    for."""
    counter.reduce_scatter_bytes += nbytes(full)
    counter.reduce_scatter_calls += 1
    return dist.all_to_all_single(rows.view(-1), full, group=group, async_op=True)


def reduce_scatter_sum(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                       counter: CommCounter) -> dist.Work | None:
    """output (1D, full.numel() / world_size) <- the sum over ranks of this rank's slice of
    full. One rank: a copy, no collective (NCCL 2.27 leaves the last elements of a one-rank
    reduction unwritten, NVIDIA/nccl#1950; docs/decisions.md, "The gradient mean")."""
    counter.reduce_scatter_bytes += nbytes(full)
    if dist.get_world_size(group) == 1:
        output.copy_(full)
        return None
    counter.reduce_scatter_calls += 1
    return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group,
                                  async_op=True)


def all_gather_sync(output: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Blocking all-gather, not counted: small metadata (not model traffic), or traffic its
    caller counts itself (comm/quantized_reduce.py)."""
    _all_gather_single(output, t, group=group)


def wait_for(work: dist.Work, timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for ``work``: True once it is done, False while it still runs;
    the backend's own error when it failed. A timed wait that expires as the work completes
    raises all the same ("Operation timed out!"), and the work is complete by the time its
    caller looks: waited for again, without a timeout, it returns (done) or raises the
    backend's error. Taking that raise for a failure left this rank out of the collectives that
    followed, and the others waiting for it in them (docs/decisions.md, "A timed wait that
    expires as its collective completes")."""
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    work.wait()
    return True


def all_gather_async(output: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup
                     ) -> dist.Work:
    """All-gather, not counted, returning its handle: small metadata that its caller waits for
    with a timeout of its own (comm/same_values.py)."""
    return _all_gather_single(output, t, group=group, async_op=True)


def gather_to(shard: torch.Tensor, to_rank: int, group: dist.ProcessGroup
              ) -> torch.Tensor | None:
    """Blocking gather of every rank's 1D ``shard`` (same size everywhere) to rank ``to_rank``
    of ``group``: there (1D, world_size * shard.numel()) in rank order, None elsewhere. Not
    counted: export traffic, not model traffic."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full = (torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)
            if rank == to_rank else None)
    dist.gather(shard, list(full.chunk(world)) if full is not None else None,
                dst=dist.get_global_rank(group, to_rank), group=group)
    return full


def all_reduce_across_replicas(t: torch.Tensor, group: dist.ProcessGroup,
                               counter: CommCounter) -> None:
    """t <- sum over the replicas of t, in place, synchronously (HSDP's gradient shards; the
    group's own size, as a planned world's group is not registered: comm/fake.py). One
    replica: no collective."""
    counter.replica_all_reduce_bytes += nbytes(t)
    if group.size() == 1:
        return
    counter.replica_all_reduce_calls += 1
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_across_nodes(full: torch.Tensor, group: dist.ProcessGroup,
                                counter: CommCounter, gloo: bool) -> torch.Tensor:
    """hpZ's reduce-scatter over the replicate group, synchronously: this rank's slice of the
    sum over the group of ``full`` (1D, a multiple of the group's size), counted as crossing
    the nodes (the group's own size and rank: a planned world's group is not registered,
    comm/fake.py). On gloo an all-reduce in place (as ``all_reduce_sum_in_place``), the
    result a view of ``full``; otherwise the backend's reduce-scatter into a tensor of its
    own."""
    counter.replicate_reduce_scatter_bytes += nbytes(full)
    world = group.size()
    per = full.numel() // world
    mine = full[group.rank() * per:(group.rank() + 1) * per]  # (not chunk: one view, not R)
    if world == 1:
        return mine
    counter.replicate_reduce_scatter_calls += 1
    if gloo:
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        return mine
    out = torch.empty_like(mine)
    _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter) -> None:
    """t <- sum over ranks of t, synchronously (used for small statistics)."""
    counter.all_reduce_bytes += nbytes(t)
    counter.all_reduce_calls += 1
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def sum_in_rank_order(mine: torch.Tensor, rank: int, world: int,
                      theirs: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``mine`` (this rank's slice of its packed gradients) summed in place with every other
    rank's contribution to it, in rank order: ((g0 + g1) + g2) + ..., the same order for every
    slice on every rank, whichever way it travelled (gloo's all-to-all, the lockstep's rows,
    reading: ``peer_memory.finish_reduce_by_reading``; here so that the transports below
    ``transport`` share it). ``theirs(q)``: rank q's contribution
    (1D, the dtype of ``mine``), which this may overwrite: the sum of the ranks before this
    one is taken in rank 0's, then added to ``mine`` (x + y == y + x, bitwise), then the ranks
    after it are added. At two ranks, the exchange's sum bitwise (``mean_of_sum``)."""
    if rank > 0:
        before = theirs(0)
        for q in range(1, rank):
            before.add_(theirs(q))
        mine.add_(before)
    for q in range(rank + 1, world):
        mine.add_(theirs(q))
    return mine
