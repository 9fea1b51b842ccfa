"""The engine's communication optimisations change when and how values move, never a bit of what
is computed: each one, on the CPU over gloo, gives bitwise the results of the path it replaced.

- Two gloo ranks reduce gradients by exchanging halves (``collectives.
  reduce_scatter_by_exchange``) instead of all-reducing the whole packed buffer
  (``FlatGroup.reduce_by_exchange``): with two summands the order of an addition does not
  change its result, so the mean is the all-reduce's to the bit.
- Ranks of one host that may read each other's memory gather by reading the others' slices
  out of their gathered buffers (``FlatGroup.gather_by_reading``: data movement only), and two
  of them reduce by reading the other's contribution (``FlatGroup.reduce_by_reading``: the
  exchange's sum), instead of gloo's broadcasts and exchanges (``collectives.PeerMemory``).

Each optimisation is a public attribute of ``FlatGroup`` that is on by default where it applies;
the tests turn it off on one model and compare it with a default one trained alike, at world
sizes 1-3 (where an optimisation does not apply, both runs take the same path and must agree
trivially), over several steps with accumulation, clipping, bf16 and offload.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

import zerocore
from zerocore import collectives
from tests.support.toy_stack import Spec, shard_stack, train_digest

WORLD_SIZES = [1, 2, 3]


# The FlatGroup attribute of each optimisation, its value when turned off, and the world sizes
# where it is on by default (this machine's ranks may read each other's memory: root, one
# host; elsewhere the reading ones may be off, which the test then says).
OPTIMISATIONS = {"gather_by_reading": False, "reduce_by_reading": False,
                 "reduce_by_exchange": False}
APPLIES = {"gather_by_reading": lambda n: n >= 2, "reduce_by_reading": lambda n: n == 2,
           "reduce_by_exchange": lambda n: n == 2}

CASES = {
    "mlp-fp32-micro2-clip": Spec(model="mlp", steps=4, micro=2, max_norm=0.05),
    "transformer-bf16-frozen-embedding": Spec(model="transformer", steps=3, train="no_embedding",
                                              param_dtype=torch.bfloat16),
    "mlp-fp32-offload": Spec(model="mlp", steps=3, offload=True),
}


def turn_off(model: zerocore.ShardedSequential, names: list[str]) -> int:
    """Turns the named optimisations off on every group; returns how many groups had one on."""
    changed = 0
    for layer in model.layers:
        for g in layer.groups:
            for name in names:
                if getattr(g, name) != OPTIMISATIONS[name]:
                    changed += 1
                setattr(g, name, OPTIMISATIONS[name])
    return changed


def digest_without(rank: int, world_size: int, spec: Spec, names: list[str]) -> dict:
    model = shard_stack(spec)
    changed = turn_off(model, names)
    return dict(train_digest(model, spec, rank, world_size), changed=changed)


def world_digest(world, spec: Spec, names: list[str]) -> tuple[str, int]:
    results = world.run(digest_without, spec, names)
    digest = hashlib.sha256("".join(r["digest"] for r in results).encode()).hexdigest()
    return digest, sum(r["changed"] for r in results)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("optimisation", sorted(OPTIMISATIONS) + ["all"])
def test_optimisation_is_bitwise_neutral(world, case, optimisation):
    """Losses, gradient shards before every step, gradient norms and final weights: bitwise the
    same with the optimisation (the default) as without it; "all": with every one turned off
    (the engine's gloo collectives before them)."""
    spec = CASES[case]
    default, _ = world_digest(world, spec, [])
    names = sorted(OPTIMISATIONS) if optimisation == "all" else [optimisation]
    without, changed = world_digest(world, spec, names)
    assert without == default
    # It must really have been on by default where it applies (else this compared nothing).
    # "all": something applies at 2 ranks (the exchange, whatever the host allows) and at 3
    # (gathers by reading, where ranks may read each other), nothing at 1.
    names_applying = [n for n in names if APPLIES[n](world.world_size)]
    applies = bool(names_applying)
    only_reading = all(n.endswith("_by_reading") for n in names_applying)
    if applies and changed == 0 and only_reading:
        pytest.skip("these ranks may not read each other's memory here (process_vm_readv "
                    "refused: another user, a container's seccomp profile); the gloo path ran")
    assert (changed > 0) == applies


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
