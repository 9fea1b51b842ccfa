"""The gradient mean over ranks (zerocore/comm/transport.py, ``mean_factors``): the same factors
on every backend, no collective for one rank, and results checked against an fp64 reference.

Each rank divides its packed gradients by ``pre``, the ranks SUM them, and each divides its
slice by ``post`` in fp32, rounding once (docs/decisions.md, "The gradient mean"). The factors
are a pure function of (dtype, world size), tested first. Then real gloo ranks reduce through
every way of the transport, including the branch NCCL takes (a reduce-scatter into a buffer of
its own: run here on gloo, whose reduce-scatter accepts CPU tensors), in fp32, bf16 and fp16
at 1, 2 and 3 ranks:
- inputs whose sums are exact in the dtype: the result must be the correctly rounded mean, bit
  for bit (only the division rounds). A factor rounded to the dtype (what NCCL's AVG does with
  1/N) or a division before the sum rounds again, which shows at 3 ranks (1/3 is inexact);
- random gradients spread over six decades: within the rounding error bound of the sum;
- fp16 values whose sum over the ranks overflows fp16: the pre-divide keeps it finite;
- the counter: one rank issues no collective, the others one per reduction.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from zerocore.comm import transport
from zerocore.comm.collectives import CommCounter
from zerocore.comm.peer_memory import PeerMemory
from tests.support.toy_stack import Spec, shard_stack, train_digest

# Every reduce dtype zerocore.MixedPrecision accepts.
DTYPES = ["float32", "bfloat16", "float16"]
SHARD = 4099  # elements of one rank's slice: odd, so no vector width divides it
# (way, world size): the transport's ways where they apply; "device" is the branch NCCL takes.
WAYS = [("collective", 1), ("device", 1),
        ("collective", 2), ("device", 2), ("exchange", 2), ("read", 2),
        ("collective", 3), ("device", 3), ("read", 3)]


# -- the factors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_bf16_sum_then_divide_once(dtype):
    for n in range(1, 1025):
        assert transport.mean_factors(dtype, n) == transport.MeanFactors(pre=1, post=n)


def test_fp16_divides_by_about_sqrt_n_before_and_after_the_sum():
    # The pre-divide is a power of two (exact in fp16 unless a value underflows), the smallest
    # whose square reaches N; the post-divide the rest.
    expected = {1: (1, 1.0), 2: (2, 1.0), 3: (2, 1.5), 4: (2, 2.0), 5: (4, 1.25), 8: (4, 2.0),
                16: (4, 4.0), 17: (8, 2.125), 64: (8, 8.0), 1000: (32, 31.25)}
    for n, (pre, post) in expected.items():
        assert transport.mean_factors(torch.float16, n) == transport.MeanFactors(pre, post), n
    for n in range(1, 4097):
        f = transport.mean_factors(torch.float16, n)
        assert f.pre & (f.pre - 1) == 0 and f.pre * f.post == n, (n, f)
        assert f.pre * f.pre >= n > (f.pre // 2) ** 2, (n, f)
        # About √N each: pre in [√N, 2√N), post in (√N / 2, √N].
        assert f.pre < 2 * math.sqrt(n) and f.post <= math.sqrt(n), (n, f)


# -- real ranks, every way ------------------------------------------------------------------------

def contributions(kind: str, dtype: torch.dtype, world_size: int) -> list[torch.Tensor]:
    """Every rank's packed gradients (1D, ``world_size * SHARD``, ``dtype``), the same list on
    every rank and in the test."""
    numel = world_size * SHARD
    shared = torch.Generator().manual_seed(7)
    if kind == "exact":
        # k * 2**e: |k| <= 42 so that a sum over up to 3 ranks (|k| <= 126 < 2**8) is exact in
        # bf16's 8 significant bits, and so in fp16 and fp32; e shared by the ranks' elements
        # and within [-12, 4]: no subnormal (fp16's start below 2**-14, after a pre-divide by 2),
        # no overflow.
        e = torch.randint(-12, 5, (numel,), generator=shared).double()
        out = []
        for r in range(world_size):
            k = torch.randint(-42, 43, (numel,), generator=torch.Generator().manual_seed(100 + r))
            out.append((k.double() * torch.exp2(e)).to(dtype))
        return out
    if kind == "random":
        # Gradient-like values over six decades, signs mixed (sums cancel).
        scale = 10.0 ** torch.randint(-3, 3, (numel,), generator=shared).double()
        return [(torch.randn(numel, generator=torch.Generator().manual_seed(200 + r),
                             dtype=torch.float64) * scale).to(dtype) for r in range(world_size)]
    assert kind == "fp16-overflow"
    # 40000 on every rank (signs alternate by element): 2 or 3 of them sum past fp16's 65504.
    signs = torch.ones(numel, dtype=torch.float64)
    signs[1::2] = -1
    return [(40000.0 * signs).to(dtype) for _ in range(world_size)]


def reduce_on_rank(rank: int, world_size: int, way: str, dtype_name: str,
                   kinds: list[str]) -> dict:
    """This rank's slice of the mean of ``contributions(kind, ...)`` for each kind, reduced the
    way ``way`` does it on the world group, and what the counter saw."""
    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    peers = None
    if way == "read":
        peers = PeerMemory(timeout_s=60)
        if not peers.probe(group):  # the same answer on every rank
            return dict(unavailable=True)
    route = transport.Route.of(group, CommCounter(), gloo=way != "device", peers=peers)
    reduce = transport.REDUCES["collective" if way == "device" else way](route)
    lo, hi = rank * SHARD, (rank + 1) * SHARD
    got = {}
    for kind in kinds:
        reduce.before_pack()  # (reading: the other rank is done with the last packed buffer)
        packed = contributions(kind, dtype, world_size)[rank].clone()
        got[kind] = reduce.start(packed, lo, hi).finish().clone()
    reduce.before_pack()
    return dict(unavailable=False, got=got, calls=route.counter.reduce_scatter_calls,
                bytes=route.counter.reduce_scatter_bytes)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (so that -0.0 differs from 0.0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("way, world_size", WAYS, ids=[f"{w}-ws{n}" for w, n in WAYS])
def test_the_mean_against_fp64(worlds, way, world_size, dtype_name):
    dtype = getattr(torch, dtype_name)
    kinds = ["exact", "random"] + (["fp16-overflow"] if dtype == torch.float16 else [])
    results = worlds(world_size).run(reduce_on_rank, way, dtype_name, kinds)
    if results[0]["unavailable"]:
        pytest.skip("these ranks may not read each other's memory (PeerMemory.probe)")
    for kind in kinds:
        inputs = [c.double() for c in contributions(kind, dtype, world_size)]
        mean64 = sum(inputs) / world_size
        for rank, r in enumerate(results):
            lo, hi = rank * SHARD, (rank + 1) * SHARD
            got, ref = r["got"][kind], mean64[lo:hi]
            assert got.dtype == dtype and got.shape == (SHARD,)
            if kind == "exact" or kind == "fp16-overflow":
                # The sum is exact, so the one rounding is the division's: the result is the
                # fp64 mean rounded to the dtype, to the bit.
                assert torch.equal(bits(got), bits(ref.to(dtype))), (kind, rank)
                continue
            # Rounding error of N-1 additions in the dtype (each at most u times the partial
            # sum, which is at most the sum of magnitudes), of the final rounding (u |mean|),
            # of fp32's division before it (2**-24 |mean|), and the absolute floor of values
            # that fall among the subnormals (half their spacing, per rounding; the pre-divide
            # is one more); the factor 1.01 covers the second-order terms (N u << 0.01).
            u = torch.finfo(dtype).eps / 2
            floor = torch.finfo(dtype).smallest_normal * u
            magnitude = sum(c[lo:hi].abs() for c in inputs) / world_size
            bound = 1.01 * ((world_size - 1) * u * magnitude + (u + 2.0 ** -24) * ref.abs()
                            + (world_size + 2) * floor)
            err = (got.double() - ref).abs()
            assert bool((err <= bound).all()), (kind, rank, (err / bound).max().item())


@pytest.mark.parametrize("way, world_size", WAYS, ids=[f"{w}-ws{n}" for w, n in WAYS])
def test_one_rank_issues_no_collective(worlds, way, world_size):
    """One rank: no collective at all (NCCL 2.27 leaves the last elements of a one-rank AVG
    unwritten); the traffic the estimate counts is still counted. More ranks: one each."""
    results = worlds(world_size).run(reduce_on_rank, way, "float32", ["exact", "random"])
    if results[0]["unavailable"]:
        pytest.skip("these ranks may not read each other's memory (PeerMemory.probe)")
    packed_bytes = world_size * SHARD * 4
    for r in results:
        assert r["calls"] == (0 if world_size == 1 else 2), r
        assert r["bytes"] == 2 * packed_bytes, r


def train_and_count(rank: int, world_size: int, spec: Spec) -> dict:
    model = shard_stack(spec)
    out = train_digest(model, spec, rank, world_size)
    return dict(out, calls=model.counter.reduce_scatter_calls,
                bytes=model.counter.reduce_scatter_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_one_rank_model_reduces_without_collectives(worlds, dtype):
    spec = Spec(model="mlp", steps=2, param_dtype=dtype)
    (r,) = worlds(1).run(train_and_count, spec)
    assert r["calls"] == 0 and r["bytes"] > 0, r
