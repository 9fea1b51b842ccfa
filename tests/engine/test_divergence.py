"""Ranks that stop running the same program (comm/lockstep.py): a unit skipped on one rank, a
forward on one rank alone, unequal micro-batches before ``optimizer.step()``, an extra
``full_state_dict`` or checkpoint on one rank, HSDP's ``set_requires_all_reduce`` at odds
across the ranks. Each is refused on every rank with ``zerocore.Diverged``, naming what each
rank was doing, at the first collective where they differ, through both front doors, on the
peer-reading and the collective transports, flat and across HSDP's replicas and hpZ's nodes;
``zerocore.Comm``'s timeout stays at its default (30 minutes), so a refusal within the test's
bound (``RUN_TIMEOUT_S``) cannot be the timeout's.

Every case first trains one agreed step, so that the divergence meets a model in its usual state
(gathered once, stepped once). Each rank returns the exception it got as text (or "no error"):
the world stays up for the next case, since every rank left the same exchange.
"""

from __future__ import annotations

import gc
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from tests.support.dist_utils import World
from tests.support.hybrid_runs import mesh_of
from tests.support.refusals import ADVICE, assert_refused
from tests.support.toy_stack import LR, Spec, global_batch, loss_fn, make_layers
from zerocore.comm.device import uses_side_channel
from zerocore.comm.fake import fake_group
from zerocore.comm.lockstep import STEP, Diverged, Lockstep
from zerocore.comm.peer_memory import GATHER_READ, PeerLost, PeerMemory

WORLD_SIZES = [2, 3]
SPEC = Spec(model="transformer")
DOORS = ["shard", "shard_model"]
# "read": gloo ranks of one host reading each other's memory (the default here); "collective":
# gloo's collectives (peer reading off).
TRANSPORTS = ["read", "collective"]
CASES = ["skip", "lone_forward", "micro_batches", "full_state", "checkpoint"]
# Far below Comm's timeout (1800 s), far above what a refusal takes on a loaded machine (a
# few seconds: building the model and one step).
RUN_TIMEOUT_S = 240.0


class Stack(nn.Module):
    """The toy transformer as a model whose forward may skip layers (``skip``: their indices),
    as ``if cond(x): x = block(x)`` does."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x)
        return x


def _build(door: str, transport: str, layout: str, group: dist.ProcessGroup | None = None,
           offload: zerocore.Offload | None = None):
    """(forward(x, skip), the sharding, how messages name layer 1) through a front door;
    over ``group`` (default: the world)."""
    policies: dict = dict(comm=zerocore.Comm() if transport == "read"
                          else zerocore.Comm(peer_read="off"), group=group)
    if offload is not None:
        policies["offload"] = offload
    if layout != "flat":
        policies["mesh"] = mesh_of((2, 2))
        if layout == "hpz":
            policies["hybrid"] = zerocore.Hybrid("hpz")
    layers = make_layers(SPEC)
    if door == "shard":
        model = zerocore.shard(layers, **policies)
        units = [layer.module for layer in model.layers[:model.num_units]]

        def forward(x: torch.Tensor, skip: set[int]) -> torch.Tensor:
            if not skip:
                return model(x)
            for i, unit in enumerate(units):  # the layers called one by one, one left out
                if i not in skip:
                    x = unit(x)
            return x
        return forward, model, "layer 1"
    stack = Stack(layers)
    sharding = zerocore.shard_model(stack, [stack.layers[1], stack.layers[2]], **policies)

    def forward(x: torch.Tensor, skip: set[int]) -> torch.Tensor:
        stack.skip = skip
        return stack(x)
    return forward, sharding, "`layers.1`"


def diverge(rank: int, world_size: int, door: str, transport: str, case: str,
            layout: str = "flat") -> str:
    """One agreed step, then ``case`` on one rank; what each rank raised, as text."""
    outcome = _attempt(rank, world_size, door, transport, case, layout)
    gc.collect()  # the model is gone: peer memory's pipes close on every rank together
    return outcome


def _attempt(rank: int, world_size: int, door: str, transport: str, case: str,
             layout: str) -> str:
    # (The optimizer's pass overlapped with the next forward, which the settling cases wait for.)
    offload = zerocore.Offload(optimizer="cpu") if case in ("finite", "zero_grad") else None
    forward, sharding, _ = _build(door, transport, layout, offload=offload)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR)
    last = world_size - 1

    def micro(step: int, m: int, skip: set[int] = set()) -> None:
        x, y = global_batch(SPEC, step, m, world_size)
        out = forward(x.chunk(world_size)[rank], skip)
        loss_fn(SPEC, out, y.chunk(world_size)[rank]).backward()

    micro(0, 0)
    opt.step()
    opt.zero_grad()
    outcome = "no error"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if case == "skip":  # layer 1 (a block) left out on the last rank
                micro(1, 0, {1} if rank == last else set())
            elif case == "lone_forward":  # a sample for the log, on rank 0 alone
                if rank == 0:
                    with torch.no_grad():
                        forward(global_batch(SPEC, 1, 0, 1)[0], set())
                micro(1, 0)
            elif case == "micro_batches":  # 2 micro-batches on rank 0, 3 on the others
                for m in range(2 if rank == 0 else 3):
                    micro(1, m)
            elif case == "full_state":  # an export on rank 0 alone
                if rank == 0:
                    dict(sharding.iter_full_states(to_rank=0))
                micro(1, 0)
            elif case == "checkpoint":  # a save on rank 0 alone (each rank its own directory)
                if rank == 0:
                    zerocore.save_checkpoint(tmp, 1, sharding, opt)
                micro(1, 0)
            elif case == "finite":  # a check before saving, on rank 0 alone
                if rank == 0:
                    sharding.trainable_finite()
                micro(1, 0)
            elif case == "zero_grad":  # gradients zeroed in place, on rank 0 alone
                if rank == 0:
                    opt.zero_grad(set_to_none=False)
                micro(1, 0)
            elif case == "replicas":  # the end-of-run comparison, on rank 0 alone
                if rank == 0:
                    sharding.replicas_agree()
                micro(1, 0)
            elif case == "hsdp_kept_on_one":  # rank 0 alone defers the replicas' all-reduce
                sharding.set_requires_all_reduce(rank != 0)
                micro(1, 0)
            elif case == "hsdp_kept_on_all":  # every rank steps before its all-reduce
                sharding.set_requires_all_reduce(False)
                micro(1, 0)
            opt.step()
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    return outcome


# What each case's message names, on every rank (``{unit}``: how the door names layer 1).
NAMED = {
    # Peer reading: the ranks wait for each other (one frees the unit the other skipped);
    # collectives: their backward gathers differ.
    "skip": ("of micro-batch 0 (step 1)",),
    "lone_forward": ("rank 0 gathers", "a forward without autograd",
                     "for forward of micro-batch 0"),
    "micro_batches": ("rank 0 is in optimizer.step() after 2 backward passes",
                      "for forward of micro-batch 2"),
    "full_state": ("rank 0 gathers the full state", "for forward of micro-batch 0"),
    "checkpoint": ("rank 0 is in zerocore.save_checkpoint()", "for forward of micro-batch 0"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("door", DOORS)
def test_diverged_ranks_are_refused_on_every_rank(world, door, transport, case):
    got = world.run(diverge, door, transport, case, timeout=RUN_TIMEOUT_S)
    assert_refused(got, *NAMED[case])


@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", CASES)
def test_diverged_ranks_are_refused_across_nodes(worlds, layout, transport, case):
    # 2 x 2: two "nodes" of two ranks; rank 3 (skip), rank 0 (a forward alone, an export, a
    # checkpoint) or ranks 1-3 (micro-batches) differ.
    got = worlds(4).run(diverge, "shard", transport, case, layout, timeout=RUN_TIMEOUT_S)
    assert_refused(got, *NAMED[case])


# Calls that are collective only through what they wait for or compare: with the optimizer's
# pass overlapped, ``trainable_finite`` and ``zero_grad(set_to_none=False)`` settle it on every
# rank (``Lockstep.agreed``); ``replicas_agree`` gathers every rank's hashes. On one rank alone,
# each met the others' first gather with a collective of another shape: a gloo size error, or
# (peer reading) a wait for the timeout. Through ``shard`` only: the settling and the comparison
# are the sharding's, the same behind either door.
SETTLING = {"finite": "rank 0 checks that its master weights are finite",
            "zero_grad": "rank 0 is in optimizer.zero_grad(set_to_none=False)",
            "replicas": "rank 0 compares HSDP's replicas"}


@pytest.mark.parametrize("case", sorted(SETTLING))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_that_settles_or_compares_on_one_rank_alone_is_refused(world, transport, case):
    got = world.run(diverge, "shard", transport, case, timeout=RUN_TIMEOUT_S)
    assert_refused(got, SETTLING[case], "for forward of micro-batch 0")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_set_requires_all_reduce_at_odds_across_ranks_is_refused(worlds, transport):
    got = worlds(4).run(diverge, "shard", transport, "hsdp_kept_on_one", "hsdp",
                        timeout=RUN_TIMEOUT_S)
    assert_refused(got, "keeping the sum for a later micro-batch")


def test_stepping_before_the_replicas_all_reduce_is_refused(worlds):
    got = worlds(4).run(diverge, "shard", "read", "hsdp_kept_on_all", "hsdp",
                        timeout=RUN_TIMEOUT_S)
    for rank, outcome in enumerate(got):
        assert outcome.startswith("RuntimeError: zerocore: optimizer.step() after a backward "
                                  "whose gradients were kept"), (rank, outcome)
        assert "set_requires_all_reduce(True)" in outcome, (rank, outcome)


# -- the exchange's own group ------------------------------------------------------------------

def exchange_over(rank: int, world_size: int, side_channel: bool | None) -> tuple[bool, str]:
    """A lockstep on the world, the last rank at the optimizer's step, the others at a gather:
    (whether the exchange ran over the world itself, what this rank raised)."""
    lockstep = Lockstep(dist.group.WORLD, side_channel=side_channel)
    lockstep.names = ["`layers.0`"]
    try:
        if rank == world_size - 1:
            lockstep.before_step(STEP)
        else:
            lockstep.gather(0)
        outcome = "no error"
    except Diverged as e:
        outcome = f"Diverged: {e}"
    return exchange_group_is_world(lockstep), outcome


def exchange_group_is_world(lockstep: Lockstep) -> bool:
    return lockstep._group is dist.group.WORLD  # (the choice under test: no public name)


@pytest.mark.parametrize("side_channel", [None, True])
def test_the_exchange_runs_over_a_gloo_side_group_when_the_group_has_no_cpu_backend(
        world, side_channel):
    # An NCCL-only group (None chooses by the backend: gloo here, so the group itself) would
    # cost a host synchronisation per unit: the exchange goes over a gloo side group of the same
    # ranks, forced here over gloo (CPU cannot run NCCL), and catches the divergence the same.
    got = world.run(exchange_over, side_channel)
    last = world.world_size - 1
    for over_world, outcome in got:
        assert over_world is (side_channel is None)
        assert outcome.startswith("Diverged: zerocore: the ranks diverged"), outcome
        assert f"rank {last} is in optimizer.step() after 0 backward passes" in outcome, outcome
        assert "`layers.0` for forward of micro-batch 0" in outcome, outcome


def test_only_a_group_without_a_cpu_backend_takes_the_side_group():
    assert uses_side_channel({"cuda": "nccl"})
    assert not uses_side_channel({"cpu": "gloo", "cuda": "nccl"})
    assert not uses_side_channel({"cpu": "gloo", "cuda": "gloo"})


# -- a rank that never comes to agree_values ---------------------------------------------------

# How long the ranks that came wait for one that does not: far below the group's own timeout
# (GLOO_TIMEOUT_S, 600 s) and the run's bound, so an answer within the bound is this wait's.
ABSENT_WAIT_S = 5.0


def agree_without_the_last(rank: int, world_size: int) -> str:
    if rank == world_size - 1:
        return "never came"
    try:
        zerocore.agree_values({"lr": 0.001}, what="a run", advice="give every rank the same",
                              timeout_s=ABSENT_WAIT_S)
    except PeerLost as e:
        return f"PeerLost: {e}"
    return "agreed"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_agree_values_with_a_rank_that_never_comes_raises_within_its_timeout(world_size):
    # A world of its own: the ranks that came leave an unfinished all-gather in the group.
    with World(world_size) as lonely:
        got = lonely.run(agree_without_the_last, timeout=RUN_TIMEOUT_S)
    assert got[-1] == "never came"
    for outcome in got[:-1]:
        assert outcome.startswith(f"PeerLost: a run: not every rank came to agree on the "
                                  f"settings within {ABSENT_WAIT_S:g} s"), outcome
        assert "a rank stopped, exited, or runs other code" in outcome, outcome


# -- a forward on one rank while the others wait in a collective of their own -------------------

# What the other ranks wait in, as a user's loop would: a barrier after the loop, or a metric.
OWN_COLLECTIVES = {"barrier": lambda: dist.barrier(),
                   "all_reduce": lambda: dist.all_reduce(torch.ones(1))}


def alone_while_others_wait(rank: int, world_size: int, door: str, transport: str,
                            collective: str) -> str:
    """One agreed step, then a forward without autograd on rank 0 alone while the others wait
    in ``collective`` (their own, outside the model, over the world). Rank 0 then joins that
    collective itself, which releases the others (in a user's program its error ends its
    process instead, and the others' collective fails at once): what each rank got, as text.
    The model has a group of its own: over gloo's collectives rank 0's exchange is still
    issued in it when rank 0 raises, and the others complete it once released (the world
    stays usable for the next case)."""
    group = dist.new_group(list(range(world_size)))
    forward, sharding, _ = _build(door, transport, "flat", group)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR)
    x, y = global_batch(SPEC, 0, 0, world_size)
    loss_fn(SPEC, forward(x.chunk(world_size)[rank], set()), y.chunk(world_size)[rank]).backward()
    opt.step()
    outcome = "no error"
    try:
        if rank == 0:
            with torch.no_grad():
                forward(global_batch(SPEC, 1, 0, 1)[0], set())
        else:
            OWN_COLLECTIVES[collective]()
            outcome = "released"
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    if rank == 0:
        OWN_COLLECTIVES[collective]()  # (the others are still in theirs)
    elif transport == "collective":  # rank 0's exchange, issued when it raised
        _complete_the_exchange(sharding.lockstep, group)
    del forward, sharding, opt
    gc.collect()
    return outcome


def _complete_the_exchange(lockstep: Lockstep, group: dist.ProcessGroup) -> None:
    """The others' side of the exchange rank 0 issued and left: a gather of the lockstep's rows
    (comm/carried.py: this model carries its small units' gathers in them), else (id, -id)
    reduced by MAX."""
    if lockstep._rows is not None:
        for handle in lockstep._rows.start(0).handles:
            handle.wait()
    else:
        dist.all_reduce(torch.zeros(2, dtype=torch.int64), op=dist.ReduceOp.MAX, group=group)


@pytest.mark.parametrize("collective", sorted(OWN_COLLECTIVES))
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("door", DOORS)
def test_a_forward_alone_while_the_others_wait_in_their_own_collective_is_refused(
        world, door, transport, collective):
    # Rank 0 asks the ranks it waits for where they are (peer reading: through its pipes;
    # gloo's collectives: through the model's store, once its exchange has waited a slice);
    # rank 1 answers from its own thread that it waits in the test's own collective. Comm's
    # timeout is at its default (30 minutes): a refusal within RUN_TIMEOUT_S is not its.
    got = world.run(alone_while_others_wait, door, transport, collective,
                    timeout=RUN_TIMEOUT_S)
    assert got[1:] == ["released"] * (world.world_size - 1), got
    refusal = got[0]
    assert refusal.startswith("Diverged: zerocore: the ranks diverged: rank 1 waits in "
                              f"torch.distributed.{collective}() at "), refusal
    assert "test_divergence.py:" in refusal, refusal  # the line of the user's own call
    assert "a forward without autograd" in refusal, refusal
    assert "run it on every rank and use the result on one" in refusal, refusal
    assert "raise the timeout" not in refusal, refusal


class _Exchange:
    """An exchange's handle whose timed waits expire until ``done``."""

    def __init__(self):
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.done


class _Answers:
    """The other ranks' answers to ``Lockstep._wait``'s questions, one list per question, in
    turn; the exchange completes as the ``arrives_at``-th is given (that rank answered, then
    came)."""

    def __init__(self, exchange: _Exchange, answers: list[dict[int, str]],
                 arrives_at: int | None = None):
        self.exchange, self.answers, self.arrives_at = exchange, answers, arrives_at
        self.asked = 0

    def ask(self) -> dict[int, str]:
        self.asked += 1
        if self.asked == self.arrives_at:
            self.exchange.done = True
        return self.answers[min(self.asked, len(self.answers)) - 1]


BARRIER = "waits in torch.distributed.barrier() at train.py:7"


def _waiting(answers: list[dict[int, str]], arrives_at: int | None) -> tuple[Lockstep, _Answers]:
    """A lockstep whose exchange's wait (``Lockstep._wait`` alone: the order of events cannot be
    forced across real ranks) hears ``answers``."""
    lockstep = Lockstep.__new__(Lockstep)  # (only its wait: no group is needed)
    exchange = _Exchange()
    lockstep._questions = _Answers(exchange, answers, arrives_at)
    lockstep.group = None  # (named in the message only)
    lockstep._elsewhere = lambda rank, where, group: Diverged(f"rank {rank} {where}")
    return lockstep, exchange


def test_an_answer_given_just_before_the_rank_came_to_the_exchange_is_not_a_divergence():
    # Asked twice, it said both times that it waits in its barrier, then came: the exchange is
    # done, and nothing raised.
    lockstep, exchange = _waiting([{1: BARRIER}], arrives_at=2)
    lockstep._wait(exchange)
    assert lockstep._questions.asked == 2


def test_a_rank_said_once_to_wait_elsewhere_is_asked_again_before_the_refusal():
    # Once in its barrier, then somewhere else (it was only slow there), then came: no
    # refusal; said twice at the same place: refused.
    lockstep, exchange = _waiting([{1: BARRIER}, {}, {1: BARRIER}, {}], arrives_at=4)
    lockstep._wait(exchange)
    lockstep, exchange = _waiting([{1: BARRIER}, {1: BARRIER.replace("7", "9")}, {}],
                                  arrives_at=3)
    lockstep._wait(exchange)
    lockstep, exchange = _waiting([{}, {1: BARRIER}, {1: BARRIER}], arrives_at=None)
    with pytest.raises(Diverged, match="rank 1 waits in torch.distributed.barrier"):
        lockstep._wait(exchange)
    assert lockstep._questions.asked == 3


class _Pipes:
    """The peer memory's answers as ``Lockstep._answered`` reads them: value -> text."""

    def answer_text(self, rank: int, value: int) -> str:
        return {0: "", 1: BARRIER}[value]


def test_only_the_answer_to_the_last_question_of_this_wait_counts():
    # Over peer reading each question is numbered (``_blocked``); an answer to an older
    # question, or one asked in a wait that has ended, is not taken.
    lockstep = Lockstep.__new__(Lockstep)
    lockstep._peers = _Pipes()
    lockstep._said_elsewhere = {}
    lockstep._elsewhere = lambda rank, where, group: Diverged(f"rank {rank} {where}")
    lockstep._peer_group = fake_group(2)  # (its ranks name the rank in the message)
    awaited, later = 5, 9   # the messages waited for, in this wait and the next
    lockstep._asked = {1: (2, awaited)}
    lockstep._answered(1, 1, 1, awaited)  # question 1's answer, after question 2 was asked
    lockstep._answered(1, 2, 1, awaited)  # the first of two
    lockstep._answered(1, 1, 1, awaited)  # (stale again: not the second)
    lockstep._asked = {1: (3, awaited)}
    lockstep._answered(1, 3, 1, later)    # a later wait's: question 3 was of this one
    lockstep._answered(1, 3, 0, awaited)  # not waiting now: what it said before is dropped
    lockstep._asked = {1: (4, awaited)}
    lockstep._answered(1, 4, 1, awaited)
    lockstep._asked = {1: (5, awaited)}
    with pytest.raises(Diverged, match="rank 1 waits in torch.distributed.barrier"):
        lockstep._answered(1, 5, 1, awaited)


# -- ranks that wait for each other in a cycle (peer reading) ------------------------------------

def wait_for_the_next(rank: int, world_size: int) -> str:
    """Each rank waits for a message from the next rank (the last for rank 0) that it never
    sends, outside any exchange: one cycle of waits through every rank, as ranks that diverged
    between two exchanges leave (each freeing a unit the next one skipped). What each got."""
    peers = PeerMemory(zerocore.Comm().timeout_s)
    assert peers.probe(dist.group.WORLD)
    lockstep = Lockstep(dist.group.WORLD, peers, dist.group.WORLD)
    lockstep.names = ["`layers.0`"]
    channel = peers.new_channel()  # a transport's, as a FlatGroup's
    try:
        peers.hear((rank + 1) % world_size, channel, GATHER_READ, 1)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    del lockstep, peers
    gc.collect()  # the pipes close on every rank together
    return outcome


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_waiting_for_each_other_in_a_cycle_are_refused_on_every_rank(worlds, world_size):
    # Two ranks that wait for each other were found before; a cycle of three or more is found
    # by a probe that each waiting rank passes back to the ranks that wait for it. Comm's
    # timeout is at its default: a refusal within RUN_TIMEOUT_S is not its.
    got = worlds(world_size).run(wait_for_the_next, timeout=RUN_TIMEOUT_S)
    for rank, outcome in enumerate(got):
        assert outcome.startswith("Diverged: zerocore: the ranks diverged"), (rank, outcome)
        assert ADVICE in outcome, (rank, outcome)
        assert "raise the timeout" not in outcome, (rank, outcome)
    assert any("wait for each other" in outcome for outcome in got), got
