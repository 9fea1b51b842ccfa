"""qgZ: the cross-node reduction of a gradient slice in int8 with an fp32 scale per block
(``zerocore.Comm(quantize_gradients="int8")``), summed in fp32: HSDP's all-reduce across the
replicas (``all_reduce_int8``), and hpZ's reduce-scatter across the nodes
(``reduce_scatter_int8``: the first hop below alone, each rank keeping its own summed chunk).

Two hops, as a ring all-reduce has, each moving int8 (ZeRO++'s qgZ is this, hierarchically):
1. the slice (padded to R chunks of whole blocks) is quantized and exchanged all-to-all: each
   replica receives chunk j of every replica, dequantizes them and sums them in fp32;
2. its summed chunk is quantized again and all-gathered; every replica dequantizes every chunk,
   its own included, so every replica holds the same bits.
Each rank sends and receives 2·(R−1)/R of the quantized slice, (1 + 4/block) bytes per element,
where the exact all-reduce moves 2·(R−1)/R of the slice in the reduce dtype (2 or 4 bytes).

Error: a block's values are rounded to its absmax/127, so each is off by at most absmax/254: the
sum, by at most (Σ_r absmax_r + absmax of the sum) / 254 per element of a block (the first hop's
error on each replica's values, then the second's), before the division by the world size.
A non-finite value on any replica (an fp16 overflow) cannot be quantized: it travels as a flag,
and every replica's result is NaN, which the loss scaler's check then finds on every replica.

The reduce-scatter's chunks are the ranks' own slices (the slice split R ways exactly, each
padded to whole blocks: a rank's chunk is its primary shard), and its error is the first hop's
alone: at most Σ_r absmax_r / 254 per element of a block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerocore.comm.collectives import CommCounter, all_gather_sync
from zerocore.kernels import ops


def chunk_numel(numel: int, replicas: int, block: int) -> int:
    """Elements of each replica's chunk: the slice split R ways, rounded up to whole blocks."""
    per = -(-numel // replicas)
    return -(-per // block) * block


def message_nbytes(numel: int, replicas: int, block: int) -> int:
    """Bytes of the quantized slice as it travels (R chunks, each its int8 values, fp32 scales
    and a non-finite flag): what the counter counts per all-reduce, as it counts the exact
    all-reduce's slice in the reduce dtype."""
    chunk = chunk_numel(numel, replicas, block)
    return replicas * _part_nbytes(chunk, block)


def _part_nbytes(chunk: int, block: int) -> int:
    return chunk + 4 * (chunk // block) + 4  # int8 | fp32 scales | int32 flag


def _pack(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Chunks (2D fp32, (R, chunk), whole blocks a row) as R byte messages end to end: each
    row's int8 values, their scales, and 1 when it held a non-finite value (quantized as zeros
    then). All rows in one quantization (its blocks are each row's: a row is whole blocks), so
    the work is a few operations whatever R is. No value is read on the host (nothing waits
    for the device, and a plan's fake tensors pass through)."""
    ranks = rows.shape[0]
    finite = torch.isfinite(rows)
    q, scales = ops.quantize_blockwise(torch.where(finite, rows, 0.0).reshape(-1), block)
    flags = (~finite).any(dim=1).to(torch.int32).reshape(ranks, 1)
    return torch.cat([q.view(torch.uint8).view(ranks, -1),
                      scales.view(torch.uint8).view(ranks, -1),
                      flags.view(torch.uint8)], dim=1).reshape(-1)


def _unpack(messages: torch.Tensor, ranks: int, n: int, block: int) -> torch.Tensor:
    """The chunks (2D fp32, (R, n)) that R messages end to end hold; a flagged one NaN."""
    m = messages.view(ranks, -1)
    scales_end = n + 4 * (n // block)
    q = m[:, :n].contiguous().view(torch.int8).reshape(-1)
    scales = m[:, n:scales_end].contiguous().view(torch.float32).reshape(-1)
    flagged = m[:, scales_end:].contiguous().view(torch.int32).bool()  # (R, 1)
    values = ops.dequantize_blockwise(q, scales, block, torch.float32).view(ranks, n)
    return values.masked_fill_(flagged, float("nan"))


def _sum_chunks(padded: torch.Tensor, group: dist.ProcessGroup, block: int) -> torch.Tensor:
    """The first hop: ``padded`` (2D fp32, (R, chunk), whole blocks a row) quantized row by row
    and exchanged all-to-all; the sum over the replicas of this rank's row, dequantized and
    summed in fp32 (1D fp32, chunk). No step loops over the replicas: a plan of 100,000 nodes
    runs the same few operations as one of two."""
    send = _pack(padded, block)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return _unpack(received, group.size(), padded.shape[1], block).sum(dim=0)


def reduce_scatter_int8(t: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter,
                        block: int) -> torch.Tensor:
    """This rank's slice (slice ``group.rank()`` of R equal ones) of the sum over the group of
    ``t`` (1D, any float dtype, a multiple of R elements), through int8 (see the module): a
    new 1-D fp32 tensor. Counted as crossing the nodes (hpZ's replicate group)."""
    ranks = group.size()
    per = t.numel() // ranks
    chunk = -(-per // block) * block
    counter.replicate_reduce_scatter_bytes += reduce_scatter_message_nbytes(t.numel(), ranks,
                                                                            block)
    if ranks == 1:
        return t.to(torch.float32, copy=True)
    counter.replicate_reduce_scatter_calls += 1
    padded = torch.zeros(ranks, chunk, dtype=torch.float32, device=t.device)
    padded[:, :per] = t.view(ranks, per)
    return _sum_chunks(padded, group, block)[:per]


def reduce_scatter_message_nbytes(numel: int, ranks: int, block: int) -> int:
    """Bytes ``reduce_scatter_int8`` of ``numel`` elements over ``ranks`` is counted as: R
    chunks of the exact split, each rounded up to whole blocks, as they travel."""
    return ranks * _part_nbytes(-(-(numel // ranks) // block) * block, block)


def all_reduce_int8(t: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter,
                    block: int) -> torch.Tensor:
    """The sum over the replicas of ``t`` (1D, any float dtype), through int8 (see the module):
    a new 1-D fp32 tensor like ``t``, the same bits on every replica. One replica: ``t`` in
    fp32 (nothing to exchange, nothing quantized)."""
    replicas = group.size()
    numel = t.numel()
    counter.replica_all_reduce_bytes += message_nbytes(numel, replicas, block)
    if replicas == 1:
        return t.to(torch.float32, copy=True)
    counter.replica_all_reduce_calls += 1
    chunk = chunk_numel(numel, replicas, block)
    padded = torch.zeros(replicas * chunk, dtype=torch.float32, device=t.device)
    padded[:numel] = t
    part = _part_nbytes(chunk, block)
    total = _sum_chunks(padded.view(replicas, chunk), group, block)
    gathered = torch.empty(replicas * part, dtype=torch.uint8, device=t.device)
    all_gather_sync(gathered, _pack(total.view(1, chunk), block), group)
    padded.view(replicas, chunk).copy_(_unpack(gathered, replicas, chunk, block))
    return padded[:numel]
