"""The lockstep's identity carried in the gathers of small units (comm/carried.py): over gloo's
collectives of a flat mesh, a unit whose part fits in the rows gathers its data in them, and the
identities are compared when the gather is waited for, before the data is copied out; its
gradient reduction sends in them the slices the other ranks keep, summed once compared. These
tests take that path explicitly: the data it gathers is bitwise the plain gather's, a training
run through it is bitwise the run without the lockstep, and a divergence met first at a carried
gather or reduction is refused on every rank with the lockstep's message
(tests/engine/test_divergence.py covers the rest of the cases on this transport, whose toy model
carries its embedding and readout and checks its blocks first).

Over peer reading, every unit's gather and (two ranks) reduction carries its identity in its
ready message, compared before anything is read from another rank: the last tests here
(tests/engine/test_divergence.py runs every divergence case over peer reading too).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from tests.support.refusals import assert_refused
from tests.support.rank_order import mean_in_rank_order, packed_gradients
from zerocore.comm.carried import (CARRY_MAX_BYTES, CarriedGather, CarriedReduce,
                                   ReadCarriedGather, ReadCarriedReduce)

WORLD_SIZES = [2, 3]
WIDTH = 8
# Far below Comm's timeout (1800 s): a refusal within it cannot be the timeout's.
RUN_TIMEOUT_S = 240.0


def _layers() -> list[nn.Module]:
    """Small trainable units (carried), a frozen one quantized to int8 (carried: its part is
    bytes), and one too large to carry (its gather checked first), in between."""
    torch.manual_seed(0)
    frozen = nn.Linear(WIDTH, WIDTH)
    frozen.requires_grad_(False)
    large = nn.Linear(128, 128)  # 66 KiB: 22 KiB a rank at 3 ranks, over CARRY_MAX_BYTES
    assert 4 * sum(p.numel() for p in large.parameters()) // 3 > CARRY_MAX_BYTES
    return [nn.Sequential(nn.Linear(WIDTH, 128), nn.GELU()), nn.Sequential(large, nn.GELU()),
            nn.Linear(128, WIDTH), frozen, nn.Linear(WIDTH, WIDTH)]


def _build(carried: bool, group: dist.ProcessGroup | None = None, reading: bool = False,
           ways: tuple[str, str] = ("auto", "auto")):
    """Over gloo's collectives, or (``reading``) over peer reading, gathering and reducing
    as ``ways`` says."""
    comm = (zerocore.Comm(gather=ways[0], reduce=ways[1]) if reading
            else zerocore.Comm(peer_read="off"))
    model = zerocore.shard(_layers(), comm=comm, group=group,
                           frozen_weights=zerocore.FrozenWeights("int8"))
    model.lockstep.enabled = carried  # off: the plain gathers, no check at all
    return model


def _carried_units(model) -> list[int]:
    return [layer.index for layer in model.layers[:model.num_units]
            if layer.groups and isinstance(layer.groups[0].gather, CarriedGather)
            and model.lockstep.carries(layer.index)]


def _carried_reduces(model) -> list[int]:
    return [layer.index for layer in model.layers[:model.num_units]
            if layer.groups and isinstance(layer.groups[0].reduce, CarriedReduce)
            and model.lockstep.carries_reduce(layer.index)]


def gathered_both_ways(rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """Each unit's gathered buffer through the rows and through the plain gather, compared
    bitwise; the units that carried their gathers, and their reductions."""
    model = _build(carried=True)
    carried = _carried_units(model), _carried_reduces(model)
    for layer in model.layers[:model.num_units]:
        got = []
        for on in (True, False):
            model.lockstep.enabled = on
            layer.wait_gather()
            got.append([g._comm.clone() for g in layer.groups])
            layer.free()
        for through_rows, plain in zip(*got):
            assert torch.equal(through_rows.view(torch.uint8), plain.view(torch.uint8)), (
                layer.index)
    del model
    gc.collect()
    return carried


def test_a_small_units_gather_through_the_rows_is_bitwise_the_plain_gather(world):
    got = world.run(gathered_both_ways)
    # The small trainable units and the quantized frozen one carry; the large one does not.
    # The small trainable units' reductions carry too: the slices the other ranks keep (at two
    # ranks the exchange's half; at three, what gloo's all-to-all sends).
    assert got == [([0, 2, 3, 4], [0, 2, 4])] * world.world_size


def trained(rank: int, world_size: int, carried: bool, reading: bool = False,
            ways: tuple[str, str] = ("auto", "auto")) -> list[torch.Tensor]:
    """Three steps of two micro-batches; the losses and the full trained state."""
    model = _build(carried, reading=reading, ways=ways)
    if reading:  # every unit's gather by reading says its identity in its ready message
        assert all(isinstance(g.gather, ReadCarriedGather) == (ways[0] != "collective")
                   for layer in model.layers[:model.num_units] for g in layer.groups)
    else:
        assert bool(_carried_units(model)) == carried
        # The small units' gradients go through the rows too (CarriedReduce)
        assert bool(_carried_reduces(model)) == carried
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        for m in range(2):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(
                100 * step + 10 * m + rank))
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    state = [t for _, layer in model.iter_full_states(to_rank=None) for t in layer.values()]
    del model, opt
    gc.collect()
    return [torch.stack(losses), *state]


def test_training_through_the_rows_is_bitwise_training_without_the_lockstep(world):
    through_rows = world.run(trained, True)
    plain = world.run(trained, False)
    for rank, (a, b) in enumerate(zip(through_rows, plain)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), rank  # the same bytes gathered: the same bits


def reduced_both_ways(rank: int, world_size: int, dtype_name: str) -> list[bool]:
    """Layer 0's reduction of packed gradients every rank can make (seeded by rank), through the
    rows and plain, each against the mean computed here in rank order as ``mean_factors`` says:
    divided by ``pre``, ((g0 + g1) + g2), divided by ``post``."""
    dtype = getattr(torch, dtype_name)
    model = _build(carried=True)
    group = model.layers[0].groups[0]
    lo, hi = group.layout.shard_range(rank)

    def packed(q: int) -> torch.Tensor:
        return packed_gradients(q, group.layout.padded_numel, dtype)  # over six decades
    expected = mean_in_rank_order(packed, lo, hi, world_size, dtype)
    got = []
    for on in (True, False):
        model.lockstep.enabled = on
        model.lockstep.backward_begins(micro_batch=0)
        model.lockstep.reduce(0, kept=False)  # (as FlatGroup's reduction says it first)
        mean = group.reduce.start(packed(rank), lo, hi).finish()
        got.append(torch.equal(mean.view(torch.uint8), expected.view(torch.uint8)))
    del model
    gc.collect()
    return got


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_a_carried_reduction_sums_in_rank_order_with_the_lockstep_on_or_off(world, dtype_name):
    # Bitwise the mean summed in rank order, through the rows (on) and through the plain way
    # (off: the exchange at two ranks, gloo's all-to-all at three); fp16 divides before the sum
    # and after it (pre 2, post 1.5 at three ranks).
    assert world.run(reduced_both_ways, dtype_name) == [[True, True]] * world.world_size


def diverge_at_a_carried_gather(rank: int, world_size: int, case: str) -> str:
    # Over a group of its own: ranks that diverged may leave rows gathers issued and unmatched
    # (at two ranks, skipping: the others' reduction of layer 4 and the prefetch after it),
    # which would pair with the next test's collectives over the world.
    model = _build(carried=True, group=dist.new_group(list(range(world_size))))
    assert model.lockstep.carries(0) and model.lockstep.carries(4)
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    units = [layer.module for layer in model.layers[:model.num_units]]
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    outcome = "no error"
    try:
        if case == "lone_forward" and rank == 0:  # a sample for the log, on rank 0 alone
            with torch.no_grad():
                model(x)
        if case == "skip" and rank == world_size - 1:  # the last unit left out on one rank
            y = x
            for unit in units[:-1]:
                y = unit(y)
            y.square().mean().backward()
        else:
            model(x).square().mean().backward()
        opt.step()
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    del model, opt
    gc.collect()
    return outcome


def test_a_forward_alone_is_refused_at_the_first_carried_gather(world):
    # Rank 0's forward without autograd and the others' training forward both begin with
    # layer 0, a carried unit: its rows name both, before any data is copied out.
    got = world.run(diverge_at_a_carried_gather, "lone_forward", timeout=RUN_TIMEOUT_S)
    others = "rank 1" if world.world_size == 2 else "ranks 1, 2"
    assert_refused(got, "rank 0 gathers layer 0 for a forward without autograd",
                    f"{others} gather{'s' if world.world_size == 2 else ''} layer 0 for "
                    f"forward of micro-batch 0 (step 1)")


def test_a_unit_skipped_on_one_rank_is_refused_at_a_carried_gather(world):
    # The last rank leaves out layer 4 (carried). Its backward begins with layer 3, still
    # gathered from its forward, so its first collective is layer 2's carried gather for
    # backward, which meets the others' reduction of layer 4 (a row of the same shape), carried
    # (CarriedReduce). Compared when the gather is waited for, before its data is copied out.
    last = world.world_size - 1
    got = world.run(diverge_at_a_carried_gather, "skip", timeout=RUN_TIMEOUT_S)
    assert_refused(got, f"rank {last} gathers layer 2 for backward of micro-batch 0 (step 1)",
                    "the gradients of layer 4 in backward of micro-batch 0 (step 1)")


def reduce_at_different_micro_batches(rank: int, world_size: int, reading: bool = False
                                      ) -> tuple[str, bool]:
    """Layer 0's reduction through the rows (``reading``: by reading, its identity in its ready
    message), each rank in the backward of micro-batch ``rank``: what its finish raised, and
    whether this rank's slice of the packed gradients is as it was (nothing of the others'
    added)."""
    model = _build(carried=True, reading=reading)
    group = model.layers[0].groups[0]
    if reading:
        assert isinstance(group.reduce, ReadCarriedReduce), "two ranks reduce by reading here"
    else:
        assert isinstance(group.reduce, CarriedReduce) and model.lockstep.carries_reduce(0)
    model.lockstep.backward_begins(micro_batch=rank)
    model.lockstep.reduce(0, kept=False)  # (as FlatGroup's reduction says it first)
    packed = torch.full((group.layout.padded_numel,), float(rank + 1))
    lo, hi = group.layout.shard_range(rank)
    reduction = group.reduce.start(packed, lo, hi)
    outcome = "no error"
    try:
        reduction.finish()
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    untouched = bool(packed[lo:hi].eq(rank + 1).all())
    del model
    gc.collect()
    return outcome, untouched


def test_a_reduction_through_the_rows_is_refused_before_anything_is_added(world):
    # Ranks in the backward of different micro-batches meet at layer 0's reduction, whose
    # identity travels with the slices each sends the others (at two ranks the exchange's half,
    # at three what gloo's all-to-all sends); compared before any rank's slice is added.
    got = world.run(reduce_at_different_micro_batches, timeout=RUN_TIMEOUT_S)
    assert_refused([outcome for outcome, _ in got],
                   *[f"rank {q} reduces the gradients of layer 0 in backward of micro-batch {q}"
                     for q in range(world.world_size)])
    assert [untouched for _, untouched in got] == [True] * world.world_size


# -- peer reading: the identity in the ready messages -------------------------------------------

def gather_read_at_different_phases(rank: int, world_size: int) -> tuple[str, bool]:
    """Layer 0's gather by reading, rank 0 for a forward without autograd, the others for a
    training forward: what its wait raised, and whether the other ranks' parts of the gathered
    buffer are still what this rank wrote there (NaN: nothing read from a rank whose identity
    differs)."""
    model = _build(carried=True, reading=True)
    layer = model.layers[0]
    (group,) = layer.groups
    assert isinstance(group.gather, ReadCarriedGather), "peer reading is the default here"
    model.lockstep.forward_begins(grad=rank != 0)
    layer.start_gather()
    parts = group._comm.chunk(world_size)
    for q, part in enumerate(parts):
        if q != rank:
            part.fill_(float("nan"))  # (the storage is this rank's from the start)
    outcome = "no error"
    try:
        layer.wait_gather()
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    untouched = all(bool(part.isnan().all()) for q, part in enumerate(parts) if q != rank)
    del model, layer, group, parts
    gc.collect()
    return outcome, untouched


def test_a_gather_by_reading_is_refused_before_anything_is_read(world):
    # Rank 0's forward without autograd and the others' training forward begin with layer 0's
    # gather by reading, whose identity rides with its ready message: compared when the gather
    # is waited for, before any other rank's part is read.
    got = world.run(gather_read_at_different_phases, timeout=RUN_TIMEOUT_S)
    others = "rank 1" if world.world_size == 2 else "ranks 1, 2"
    assert_refused([outcome for outcome, _ in got],
                   "rank 0 gathers layer 0 for a forward without autograd",
                   f"{others} gather{'s' if world.world_size == 2 else ''} layer 0 for "
                   f"forward of micro-batch 0 (step 0)")
    assert [untouched for _, untouched in got] == [True] * world.world_size


def test_a_reduction_by_reading_is_refused_before_anything_is_read(worlds):
    # Two ranks (three reduce by gloo's all-reduce, checked first: reading reduces at two
    # ranks only), in the backward of different micro-batches, meet at layer 0's reduction by
    # reading.
    got = worlds(2).run(reduce_at_different_micro_batches, True, timeout=RUN_TIMEOUT_S)
    assert_refused([outcome for outcome, _ in got],
                   "rank 0 reduces the gradients of layer 0 in backward of micro-batch 0",
                   "rank 1 reduces the gradients of layer 0 in backward of micro-batch 1")
    assert [untouched for _, untouched in got] == [True, True]


def test_training_by_reading_with_the_identity_is_bitwise_training_without(world):
    with_identity = world.run(trained, True, True)
    plain = world.run(trained, False, True)
    for rank, (a, b) in enumerate(zip(with_identity, plain)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), rank  # the same bytes read: the same bits


@pytest.mark.parametrize("ways", [("collective", "read"), ("read", "exchange")])
def test_one_way_by_reading_with_the_identity_is_bitwise_training_without(worlds, ways):
    # Two ranks, one way by reading and the other not: the identities of the steps by reading
    # ride with their ready messages, the others' are checked first (after comparing those).
    world = worlds(2)
    with_identity = world.run(trained, True, True, ways)
    plain = world.run(trained, False, True, ways)
    for rank, (a, b) in enumerate(zip(with_identity, plain)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), rank
