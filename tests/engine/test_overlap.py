"""The ways parameters and gradients travel (zerocore/comm/transport.py, chosen by ``Comm``)
change when and how values move, never a bit of what is computed: each one, on the CPU over
gloo, gives bitwise the results of every other.

- Two gloo ranks reduce gradients by exchanging halves (``Comm(reduce="exchange")``,
  ``collectives.reduce_scatter_by_exchange``) instead of all-reducing the whole packed buffer
  (``"collective"``): with two summands the order of an addition does not change its result,
  so the mean is the all-reduce's to the bit.
- Ranks of one host that may read each other's memory gather by reading the others' slices
  out of their gathered buffers (``Comm(gather="read")``: data movement only), and reduce by
  reading the others' contributions (``Comm(reduce="read")``), instead of gloo's broadcasts,
  exchanges and all-to-all (``peer_memory.PeerMemory``).
- From three ranks every way on gloo sums the gradients in rank order, ((g0 + g1) + g2): gloo's
  all-to-all (``"collective"``), reading, and the lockstep's rows.

The default (``"auto"``) takes the fastest way that applies; the tests train a model with each
way asked for by name and compare it with one trained alike another way, at every world size
where two ways apply (2 and 3: one rank has one way only), over several steps with
accumulation, clipping, bf16 and offload. Where a way does not apply (one rank, or the exchange
at three), asking for it is refused on every rank.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

import zerocore
from zerocore.comm import collectives
from tests.support.rank_order import mean_in_rank_order, packed_gradients
from tests.support.toy_stack import Spec, make_layers, train_digest

# Each way by name: its Comm arguments ("auto" is the default: on these ranks it reads where
# ranks of one host may read each other's memory, and two ranks reduce by reading).
WAYS = {
    "auto": {},
    "gather-collective": dict(gather="collective"),
    "gather-read": dict(gather="read"),
    "reduce-collective": dict(reduce="collective"),
    "reduce-exchange": dict(reduce="exchange"),
    "reduce-read": dict(reduce="read"),
    "all-collective": dict(gather="collective", reduce="collective"),
}
# (way, the way it is compared with, world size): two different paths each time (the test
# checks that the reports differ), at every world size where more than one way applies; one
# rank has one way only.
COMPARED = [("gather-read", "gather-collective", 2), ("gather-read", "gather-collective", 3),
            ("reduce-exchange", "reduce-collective", 2), ("reduce-read", "reduce-collective", 2),
            ("reduce-read", "reduce-exchange", 2), ("reduce-read", "reduce-collective", 3),
            ("all-collective", "auto", 2), ("all-collective", "auto", 3)]
# (way, world size) where the way does not apply: refused on every rank.
REFUSED = [("gather-read", 1), ("reduce-exchange", 1), ("reduce-exchange", 3),
           ("reduce-read", 1)]

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
@pytest.mark.parametrize("way, reference, world_size", COMPARED)
def test_every_way_gives_the_same_bits(worlds, case, way, reference, world_size):
    """Losses, gradient shards before every step, gradient norms and final weights: bitwise the
    same with one way as with another; each report says the way asked for was taken."""
    spec, world = CASES[case], worlds(world_size)
    expected, ref_results = world_digest(world, spec, WAYS[reference])
    got, results = world_digest(world, spec, WAYS[way])
    if None in (got, expected):   # every way compared applies, unless reading is refused here
        refused = [r["refused"] for r in results + ref_results if r["refused"]]
        pytest.skip("these ranks may not read each other's memory here (process_vm_readv "
                    "refused: another user, a container's seccomp profile): " + refused[0])
    assert got == expected
    for r, ref in zip(results, ref_results):
        assert r["ways"] != ref["ways"], (r["ways"], ref["ways"])   # two paths, not one
        for what, name in WAYS[way].items():   # the way asked for is the way taken
            assert f"{what}: {name}" in r["ways"], r["ways"]


@pytest.mark.parametrize("way, world_size", REFUSED)
def test_a_way_that_does_not_apply_is_refused(worlds, way, world_size):
    _, results = world_digest(worlds(world_size), CASES["mlp-fp32-offload"], WAYS[way])
    assert all(r["refused"] for r in results), results  # on every rank, in one line


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


def reduced_each_way(rank: int, world_size: int, dtype_name: str) -> dict:
    """One layer's reduction of a packed buffer every rank can make (seeded by rank; values over
    seven decades, so that the order of summation shows in the last bits), by each way that
    applies at this world size, as the engine runs it (the lockstep off: the plain ways), each
    against the mean computed here in rank order as ``mean_factors`` says: divided by ``pre``,
    ((g0 + g1) + g2), divided by ``post``. An odd width, so the shards end in padding."""
    dtype = getattr(torch, dtype_name)
    ways = ["collective", "read"] + (["exchange"] if world_size == 2 else [])
    got = {}
    for way in ways:
        torch.manual_seed(0)
        model = zerocore.shard([torch.nn.Linear(97, 89)], comm=zerocore.Comm(reduce=way))
        model.lockstep.enabled = False
        group = model.layers[0].groups[0]
        lo, hi = group.layout.shard_range(rank)
        n = group.layout.padded_numel

        def packed(q: int) -> torch.Tensor:
            return packed_gradients(q, n, dtype, top=4)
        expected = mean_in_rank_order(packed, lo, hi, world_size, dtype)
        for _ in range(2):  # twice: the second reuses what the first kept (reading's buffers)
            model.counter.reset()
            mean = group.reduce.start(packed(rank), lo, hi).finish()
            got[way] = (torch.equal(bits(mean), bits(expected)),
                        model.counter.reduce_scatter_calls,
                        model.counter.reduce_scatter_bytes == n * dtype.itemsize,
                        f"reduce: {way}" in model.comm_report().ways)
        del model
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_gloo_reduction_sums_in_rank_order(worlds, world_size, dtype):
    """Gloo's all-to-all (three ranks), reading, and the exchange (two ranks) each leave bitwise
    the mean summed in rank order, counted as one reduce-scatter of the whole buffer. (Gloo's
    own all-reduce fails this at three ranks: its ring sums in another order.)"""
    results = worlds(world_size).run(reduced_each_way, dtype)
    if any(not r["read"][3] for r in results):
        pytest.skip("these ranks may not read each other's memory here")
    for r in results:
        for way, (equal, calls, whole, named) in r.items():
            assert equal and named and calls == 1 and whole, (way, r)


# -- the choice itself: once per sharding, by the compute device ---------------------------------

def _probes_per_shard(rank: int, world_size: int) -> tuple[int, str, str]:
    from zerocore.comm.peer_memory import PeerMemory
    probes = 0
    probe = PeerMemory.probe

    def counted(self, group):
        nonlocal probes
        probes += 1
        return probe(self, group)
    PeerMemory.probe = counted   # (a test may replace a method; the library never does)
    try:
        model = zerocore.shard(make_layers(Spec(model="transformer")))
    finally:
        PeerMemory.probe = probe
    # The reduce way by name.
    ways = {(g.gather.route.gloo, type(g.gather).__name__, g.reduce.name)
            for layer in model.layers for g in layer.groups}
    return probes, model.ways.line(), repr(sorted(ways))


def test_the_transport_is_chosen_once_per_sharding(worlds):
    """Every layer's groups build their ways from one choice, made by one probe of the ranks'
    memory (a collective: not one per group, nor inside a group's constructor)."""
    for world_size in (2, 3):
        results = worlds(world_size).run(_probes_per_shard)
        assert [r[0] for r in results] == [1] * world_size, results
        assert len({r[1:] for r in results}) == 1, results   # every rank chose alike
        assert results[0][2].count("(") == 1, results[0][2]  # one way for every group


def _choose_on_each_device(rank: int, world_size: int) -> tuple[bool, str, bool]:
    from zerocore.comm import transport
    group = dist.group.WORLD
    on_cuda = transport.choose(group, torch.device("cuda", 0), zerocore.Comm(), peers=None)
    on_cpu = transport.choose(group, torch.device("cpu"), zerocore.Comm(), peers=None)
    return on_cuda.gloo, on_cuda.why, on_cpu.gloo


def test_the_compute_device_chooses_the_backends_ways(worlds):
    """Whether the ranks use gloo's ways is the compute device's type, not the backend's name:
    a group whose backend is "cpu:gloo,cuda:nccl" computing on CUDA takes NCCL's ways (the
    group here is gloo's alone, which is the point: its name is not asked)."""
    for gloo_on_cuda, why, gloo_on_cpu in worlds(2).run(_choose_on_each_device):
        assert (gloo_on_cuda, gloo_on_cpu) == (False, True)
        assert why == "the cuda backend's collectives", why
