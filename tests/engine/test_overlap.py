"""The ways parameters and gradients travel (zerocore/comm/transport.py, chosen by ``Comm``)
change when and how values move, never a bit of what is computed: each one, on the CPU over
gloo, gives bitwise the results of every other.

- Two gloo ranks reduce gradients by exchanging halves (``Comm(reduce="exchange")``,
  ``collectives.reduce_scatter_by_exchange``) instead of all-reducing the whole packed buffer
  (``"collective"``): with two summands the order of an addition does not change its result,
  so the mean is the all-reduce's to the bit.
- Ranks of one host that may read each other's memory gather by reading the others' slices
  out of their gathered buffers (``Comm(gather="read")``: data movement only), and two of them
  reduce by reading the other's contribution (``Comm(reduce="read")``: the exchange's sum),
  instead of gloo's broadcasts and exchanges (``collectives.PeerMemory``).

The default (``"auto"``) takes the fastest way that applies; the tests train a model with each
way asked for by name and compare it with a default one trained alike, at world sizes 1-3, over
several steps with accumulation, clipping, bf16 and offload. Where a way does not apply, asking
for it is refused on every rank.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

import zerocore
from zerocore.comm import collectives
from tests.support.toy_stack import Spec, make_layers, train_digest

WORLD_SIZES = [1, 2, 3]


# Each way by name: its Comm arguments, and at which world sizes it applies on gloo (the
# reading ones where these ranks may read each other's memory: root, one host; elsewhere they
# are refused, which the test then says).
WAYS = {
    "gather-collective": (dict(gather="collective"), lambda n: True),
    "gather-read": (dict(gather="read"), lambda n: n >= 2),
    "reduce-collective": (dict(reduce="collective"), lambda n: True),
    "reduce-exchange": (dict(reduce="exchange"), lambda n: n == 2),
    "reduce-read": (dict(reduce="read"), lambda n: n == 2),
    "all-collective": (dict(gather="collective", reduce="collective"), lambda n: True),
}

CASES = {
    "mlp-fp32-micro2-clip": Spec(model="mlp", steps=4, micro=2, max_norm=0.05),
    "transformer-bf16-frozen-embedding": Spec(model="transformer", steps=3, train="no_embedding",
                                              param_dtype=torch.bfloat16),
    "mlp-fp32-offload": Spec(model="mlp", steps=3, offload=True),
}


def digest_with(rank: int, world_size: int, spec: Spec, comm: dict) -> dict:
    try:
        model = zerocore.shard(make_layers(spec),
                               mixed_precision=zerocore.MixedPrecision(spec.param_dtype),
                               offload=zerocore.Offload(optimizer=spec.offload),
                               comm=zerocore.Comm(**comm))
    except ValueError as e:
        return dict(refused=str(e))
    ways = model.comm_report().ways
    return dict(train_digest(model, spec, rank, world_size), ways=ways, refused=None)


def world_digest(world, spec: Spec, comm: dict) -> tuple[str | None, list[dict]]:
    results = world.run(digest_with, spec, comm)
    if any(r["refused"] for r in results):
        return None, results
    return hashlib.sha256("".join(r["digest"] for r in results).encode()).hexdigest(), results


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("way", sorted(WAYS))
def test_every_way_gives_the_same_bits(world, case, way):
    """Losses, gradient shards before every step, gradient norms and final weights: bitwise the
    same with the way asked for as with the default; a way that does not apply is refused."""
    spec = CASES[case]
    comm, applies = WAYS[way]
    default, _ = world_digest(world, spec, {})
    got, results = world_digest(world, spec, comm)
    if not applies(world.world_size):
        assert all(r["refused"] for r in results), results  # on every rank, in one line
        return
    if got is None and "read" in comm.values():
        pytest.skip("these ranks may not read each other's memory here (process_vm_readv "
                    "refused: another user, a container's seccomp profile): "
                    + results[0]["refused"])
    assert got == default
    for r in results:  # the way asked for is the way taken, and the report says so
        for what, name in comm.items():
            assert f"{what}: {name}" in r["ways"], r["ways"]


def exchange_vs_all_reduce(rank: int, world_size: int, numel: int, dtype_name: str) -> dict:
    """Both reductions of the same random packed buffer on this rank's slice, as the engine
    finishes them (add the received half, divide by the world size)."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(100 + rank)
    full = (torch.randn(numel, generator=g) * 10 ** torch.randint(-3, 4, (numel,), generator=g)
            ).to(dtype)
    counter = collectives.CommCounter()
    by_all_reduce = full.clone()
    collectives.all_reduce_sum_in_place(by_all_reduce, dist.group.WORLD, counter).wait()
    lo, hi = rank * numel // 2, (rank + 1) * numel // 2
    expected = by_all_reduce[lo:hi].div_(world_size)
    received = torch.empty(numel // 2, dtype=dtype)
    packed = full.clone()
    for h in collectives.reduce_scatter_by_exchange(packed, received, dist.group.WORLD, counter):
        h.wait()
    got = packed[lo:hi].add_(received).div_(world_size)
    return dict(equal=torch.equal(bits(got), bits(expected)),
                bytes=counter.reduce_scatter_bytes, calls=counter.reduce_scatter_calls)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so that -0.0 differs from 0.0 and equal NaNs compare equal)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_exchange_equals_all_reduce_bitwise(worlds, dtype):
    """The collective itself, on an odd-sized shard (278,011 elements a rank) of values spread
    over seven orders of magnitude, in each reduce dtype: bitwise the all-reduce's mean, and
    counted as one reduce-scatter of the whole buffer each time."""
    numel = 2 * 278_011
    itemsize = getattr(torch, dtype).itemsize
    for r in worlds(2).run(exchange_vs_all_reduce, numel, dtype):
        assert r["equal"]
        assert r["calls"] == 2 and r["bytes"] == 2 * numel * itemsize
