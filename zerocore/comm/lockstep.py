"""``Lockstep``: every collective step a sharded model runs says first where each rank is, so
that ranks which stopped running the same program (a unit skipped on one, a forward on one
alone, unequal micro-batches before ``optimizer.step()``, an extra ``full_state_dict`` on one)
are caught at the first step where they differ, on every rank, with what each was doing, instead
of pairing one rank's gather with another's (wrong values, a size mismatch that aborts gloo) or
waiting out a timeout that blames a stopped rank (docs/decisions.md, "Ranks in lockstep").

Each step (a unit's gather, a gradient reduction, the optimizer's step and its statistics, full
states, checkpoints) is named by one int64, its identity: what kind of step, the unit, the phase
(forward with or without autograd, backward), the micro-batch (forwards since the last
``optimizer.step()``) and the step. Before the step's own collectives the ranks exchange their
identities: through the pipes of peer memory (16-byte messages, keyed by a sequence number that
every rank counts alike) when every rank of the model reads the others' memory (where a gather
or reduction by reading carries its identity in the write of its own ready message, compared
before anything is read: ``carry_reading``), else one
all-gather of one int64 per rank over the model's whole mesh (over gloo's collectives of a flat
mesh, a gather of rows of one shape, in which small units' gathers and gradient reductions
carry their data and so need no exchange of their own: comm/rows.py,
comm/carried.py). Every rank then holds every rank's
identity, so every rank sees the same difference and raises ``Diverged`` at once; each decodes
the identities itself (the unit names are the same on every rank: the structure is agreed), so
no further exchange is needed. A rank that never comes keeps the transport's own error: the
peer memory's timeout (a stopped or hung rank), or the backend's. A rank that waits long at an
exchange asks the ranks it waits for whether they wait in a collective of their own
(comm/whereabouts.py): then neither can go on, and it raises at once.

State of its own: where the runtime is (``forward_begins``, ``backward_begins``), set by the
hooks that run the units, and the counts the optimizer's step resets.
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from zerocore.comm.agree import run_agreed
from zerocore.comm.collectives import all_gather_sync, wait_for
from zerocore.comm.device import backend_map, uses_side_channel
from zerocore.comm.fake import is_fake
from zerocore.comm.peer_memory import GATHER_READY, PeerMemory
from zerocore.comm.rows import Rows, Sent
from zerocore.comm.store_questions import StoreQuestions
from zerocore.comm.transport import group_ranks

T = TypeVar("T")

# Kinds of step.
GATHER, REDUCE, STATS, STEP, FULL_STATE, SAVE, LOAD, WAIT, GATHER_IN_NODE = range(1, 10)
# Calls that are collective only through what they settle or compare, outside a step: a check of
# the masters and a zeroing in place, which wait for an overlapped optimizer pass on every rank
# (``agreed``), and the comparison of HSDP's replicas.
FINITE, ZERO_GRAD, REPLICAS = range(10, 13)
# Phases: a forward that builds a graph, one that does not (no_grad, inference), a backward
# (a recomputed forward is part of its backward: it gathers nothing of its own); a reduction
# whose HSDP sum waits for a later micro-batch (``set_requires_all_reduce(False)``).
FORWARD, FORWARD_NO_GRAD, BACKWARD, BACKWARD_KEPT = range(4)
# Kinds of message of the lockstep's peer-memory channel besides identities (``GATHER_READY``):
# what a long-waiting rank waits for and where it is, and that the ranks diverged.
_AWAITS, _ABORT, _AT = 1, 2, 3
# An ``_AWAITS`` message whose sequence number is not 0 is a probe for a cycle of waits
# (``_probe``): it names the rank that began it and the rank that one waits for, in the bits
# below (each plus one).
_PROBE_SHIFT = 16
# How many probes a rank remembers having passed on (each is passed on once: two ranks that
# read each other's pipes would otherwise pass one back and forth for ever).
_PASSED_KEPT = 1024
# An ``_AT`` message whose sequence number is not 0 answers ``PeerMemory.ask``: whether the rank
# waits in a collective of its own (comm/whereabouts.py); the number is the question's
# (``_blocked`` numbers them), so that an answer that arrives after the wait it was asked in, or
# after a later question, is told from the answer to the question out now.
_QUESTIONS = 0xFFFFFFFF  # question numbers run 1 .. this, then again (0 is ``_AT``'s own)
# The exchange's all-reduce over the backend is waited for in slices: the first as long as a
# waiting peer memory's first (``peer_memory._GRACE_S``: an exchange that takes longer is not
# the common case), then twice as long each, up to the last; after each the others are asked
# where they wait (``StoreQuestions``).
_SLICE_S, _SLICE_MAX_S = 0.5, 4.0

# Bits of an identity (63 in all: it travels as a signed int64): kind 4, phase 2, unit 18,
# micro-batch 16, step 23; counts wrap (two ranks that differ by a multiple of 2**16
# micro-batches would pass: a program that far apart has differed earlier).
_FIELDS = (("kind", 4), ("phase", 2), ("unit", 18), ("count", 16), ("step", 23))


class Identity(NamedTuple):
    """A step, as ranks compare it (a tuple: made several times per unit and step, on the
    host's critical path)."""
    kind: int
    phase: int = 0
    unit: int = 0
    count: int = 0   # the micro-batch, or for STATS and STEP the backward passes since a step
    step: int = 0

    def packed(self) -> int:
        # ``_FIELDS`` written out (tests/engine/test_lockstep.py checks the two agree).
        return ((self.kind & 0xF) | (self.phase & 0x3) << 4 | (self.unit & 0x3FFFF) << 6
                | (self.count & 0xFFFF) << 24 | (self.step & 0x7FFFFF) << 40)

    @staticmethod
    def unpacked(value: int) -> "Identity":
        fields, shift = {}, 0
        for name, bits in _FIELDS:
            fields[name] = (value >> shift) & ((1 << bits) - 1)
            shift += bits
        return Identity(**fields)


class Diverged(RuntimeError):
    """The ranks stopped running the same collectives: raised on every rank at the first one
    where they differ. ``doing``: {rank: what that rank was doing}, in words."""

    def __init__(self, message: str, doing: dict[int, str] | None = None):
        super().__init__(message)
        self.doing = dict(doing or {})

    def __reduce__(self):
        return Diverged, (str(self), self.doing)


_ADVICE = ("every rank must run the same forwards and backwards of the sharded model, in the "
           "same order (a unit that runs on some ranks runs on all: compute it and discard the "
           "result), the same number of micro-batches before each optimizer.step(), and the "
           "same full_state_dict/checkpoint calls. A forward on one rank alone (logging, a "
           "sample) cannot gather the others' shards: run it on every rank and use the result "
           "on one, or run it on an unsharded copy (full_state_dict(to_rank=0) loaded into the "
           "model's own class)")


class Lockstep:
    """One sharded model's identity exchange (see the module docstring). ``group``: every rank
    of the model (the mesh's whole); ``peers``: the peer memory when it reaches every one of
    them (a flat mesh of one host), else None (the all-gather). ``enabled``: an internal
    switch for measuring the check's cost (bench/) and for seeing a test fail without it; not
    a policy: with it off, diverged ranks are back to wrong values or a timeout."""

    def __init__(self, group: dist.ProcessGroup, peers: PeerMemory | None = None,
                 peer_group: dist.ProcessGroup | None = None,
                 side_channel: bool | None = None):
        self.group = group
        self.enabled = group.size() > 1 and not is_fake(group)  # a plan's world agrees
        self._peers = peers
        # The ranks the peer memory reaches (HSDP's and hpZ's shard group: one node), whose
        # exchange goes through its pipes first; the whole group's all-gather follows when it
        # is wider (every rank of it then sees what any differs in).
        self._peer_group = peer_group if peers is not None else None
        self._wider = peers is None or peer_group.size() < group.size()
        self._channel = peers.new_channel() if peers is not None else 0
        if peers is not None:
            peers.watch(self._heard, self._blocked)
        # What this rank said last (packed), and what the others said of their waits: the
        # identity each said it was at (``_AT``) and the message it waits for (``_AWAITS``),
        # by rank in the peer group, until it sends anything else.
        self._last = 0
        self._at: dict[int, int] = {}
        self._awaits: dict[int, int] = {}
        self._aborted = False
        # The questions of ``_blocked`` (whether a rank waits in a collective of its own): how
        # many were asked, the last one asked of each rank (number, the message waited for),
        # and the last place each said it waits, with that message (``_answered``).
        self._questions_asked = 0
        self._asked: dict[int, tuple[int, int]] = {}
        self._said_elsewhere: dict[int, tuple[int, str]] = {}
        self._passed: dict[tuple[int, int], None] = {}  # probes passed on (``_probe``), in order
        self._seq = 0  # exchanges so far: every rank counts alike (the pipes' key)
        # The exchange over the backend runs on the CPU: over the group itself when it has a
        # CPU backend (gloo), else over a gloo side group of the same ranks (an NCCL-only
        # group would cost a host synchronisation per unit; ``exchange_group``).
        self._group = exchange_group(group, side_channel) if self.enabled else group
        # Made once (an exchange runs several times per unit): (mine, -mine), reduced by
        # MAX to (the highest, -the lowest); every rank's only when they differ.
        self._extremes = torch.zeros(2, dtype=torch.int64)
        self._mine = torch.zeros(1, dtype=torch.int64)
        self._every = torch.zeros(group.size(), dtype=torch.int64)
        # Where the others wait when the all-reduce lasts (a forward on this rank alone).
        self._questions = (StoreQuestions(group, self._group, group_ranks(group))
                           if self.enabled and self._wider else None)
        # Unit index -> how messages name it (set by the front door: the model's own names).
        self.names: list[str] = []
        # Where the runtime is: the phase of the gathers it starts, and the micro-batch.
        self.phase = FORWARD
        self.micro_batch = 0
        self.forwards = 0    # forwards begun since the last optimizer step
        self.backwards = 0   # backward passes ended since the last optimizer step
        self.step = 0        # optimizer steps taken
        # The last reduction kept HSDP's sum for a later micro-batch: stepping now would step
        # without it (set_requires_all_reduce(False) on the last micro-batch).
        self._kept = False
        # Over gloo's collectives of a flat mesh, the rows every check gathers (comm/rows.py;
        # ``carry``), the units whose gathers carry their identity in them, and the carried
        # gathers started and not yet compared, in the order started.
        self._rows: Rows | None = None
        self._carried: frozenset[int] = frozenset()
        self._carried_reduces: frozenset[int] = frozenset()
        self._unchecked: collections.deque[Sent] = collections.deque()
        # Over peer reading of a flat mesh, whether the gathers (the reductions) by reading
        # carry their identity in their ready message (``carry_reading``), and the identities
        # said and not yet compared: (sequence number, packed), in the order said.
        self._read_gathers = False
        self._read_reduces = False
        self._said: collections.deque[tuple[int, int]] = collections.deque()

    # -- where the runtime is ----------------------------------------------------------------

    def forward_begins(self, grad: bool) -> None:
        self.phase = FORWARD if grad else FORWARD_NO_GRAD
        self.micro_batch = self.forwards
        self.forwards += 1

    def backward_begins(self, micro_batch: int) -> None:
        self.phase = BACKWARD
        self.micro_batch = micro_batch

    def backward_ended(self) -> None:
        self.backwards += 1

    # -- the steps ---------------------------------------------------------------------------

    def gather(self, unit: int, in_node: bool = False) -> None:
        """``in_node``: hpZ's second step, the gather within the node from the secondary
        shards, issued when the gather is waited for (a rank that skipped the unit never
        issues it)."""
        if self.carries(unit):
            return  # its gather carries the identity (``start_carried``)
        kind = GATHER_IN_NODE if in_node else GATHER
        identity = Identity(kind, self.phase, unit, self.micro_batch, self.step)
        if self._read_gathers and not in_node:
            self._say(identity)  # with its gather's ready message (``carry_reading``)
        else:
            self.check(identity)

    def reduce(self, unit: int, kept: bool) -> None:
        """``kept``: HSDP keeps this sum for a later micro-batch (no all-reduce across the
        replicas now): ranks that disagree on it would pair unlike all-reduces."""
        phase = BACKWARD_KEPT if kept else BACKWARD
        self._kept = kept
        if not kept and self.carries_reduce(unit):
            return  # its reduction carries the identity (``start_carried``)
        identity = Identity(REDUCE, phase, unit, self.micro_batch, self.step)
        if self._read_reduces and not kept:
            self._say(identity)  # with its reduction's ready message (``carry_reading``)
        else:
            self.check(identity)

    def before_step(self, kind: int = STEP) -> None:
        """The optimizer's step (``STEP``: its counts then start again) or the statistics taken
        before it (``STATS``: the gradient norm, the overflow check): unequal numbers of
        micro-batches are refused here, before any rank steps with them."""
        self.check(Identity(kind, 0, 0, self.backwards, self.step))
        if self._kept:  # the same on every rank: their reductions agreed on it
            raise RuntimeError(
                "zerocore: optimizer.step() after a backward whose gradients were kept for a "
                "later micro-batch (set_requires_all_reduce(False)): the gradient shards do not "
                "hold those micro-batches yet; call model.set_requires_all_reduce(True) before "
                "the last micro-batch's backward, then step")
        if kind == STEP:
            self.step += 1
            self.forwards = self.backwards = 0

    def collective(self, kind: int) -> None:
        """A step outside the training loop (``FULL_STATE``, ``SAVE``, ``LOAD``)."""
        self.check(Identity(kind, 0, 0, 0, self.step))

    def agreed(self, fn: Callable[[], T], kind: int | None = None) -> T:
        """Collective: ``fn()`` on every rank of the model, its failure agreed over them all
        (``run_agreed``, over the exchange's CPU group: no device round trip). ``kind``: the
        step the ranks exchange first (``FINITE``, ``ZERO_GRAD``); None when the caller's own
        check has just said where it is (the optimizer's step, a full state, a checkpoint).
        Without one, a rank that came here alone would pair its object gather with the
        others' exchange: a size error, or a wait that never ends."""
        if self.group.size() == 1 or is_fake(self.group):
            return fn()
        if kind is not None:
            self.check(Identity(kind, 0, 0, 0, self.step))
        self._compare_unchecked()  # (a collective of another shape follows)
        self.compare_said()
        return run_agreed(fn, group=self._group)

    def check(self, identity: Identity) -> None:
        """Collective: exchanges ``identity`` with every rank; raises ``Diverged`` on every rank
        when they differ."""
        if not self.enabled:
            return
        mine = identity.packed()
        self._last = mine
        self._seq += 1
        if self._rows is not None:
            self._compare_unchecked()
            sent = self._rows.start(mine)
            self._compare(sent)
            self._rows.give_back(sent)
            return
        peers, group = self._peers, self._peer_group
        if peers is not None and not self._wider:
            # Told now, with any identity said before and not yet sent (a step that is not a
            # gather or reduction by reading: it has no ready message to carry it), then
            # compared after every identity said before it, in order.
            peers.tell(peers.others(), self._channel, GATHER_READY, self._seq, mine)
            self._said.append((self._seq, mine))
            self.compare_said()
            return
        if peers is not None:
            peers.tell(peers.others(), self._channel, GATHER_READY, self._seq, mine)
            me = group.rank()
            every = [mine if q == me else peers.hear(q, self._channel, GATHER_READY, self._seq)
                     for q in range(group.size())]
        if self._wider:  # (after a difference within the node too: the other nodes learn it)
            every, group = self._all_gather(mine), self.group
        if any(v != mine for v in every):
            raise self.diverged(every, group)

    # -- the identity carried in peer reading's ready messages (comm/carried.py) --------------
    #
    # Over peer reading of a flat mesh (every rank of the model reads every other's memory),
    # a gather or reduction by reading begins with a message to each other rank: its buffer is
    # ready, at this address. The step's identity is written to the same pipes in the same
    # write, just before it (``PeerMemory.defer``): no message of its own, and no wait. It is
    # compared when the step is waited for, before anything is read from another rank: the
    # identities said since the last comparison, in order, each against what every other rank
    # said at that sequence number. Equal identities up to a step mean the same steps on every
    # rank up to it, so the same buffer of the same size at the address read; every rank
    # compares the same sequence in the same order, so every rank raises the same ``Diverged``
    # at the first that differs. A step with no ready message of its own (the optimizer's,
    # statistics, full states, checkpoints, and reductions over gloo's collectives) tells its
    # identity at once and waits to compare it, as before, after every identity said before
    # it (``check``); so does ``agreed``, before its gloo collective.

    def carry_reading(self, gathers: bool, reduces: bool) -> None:
        """When the model is built (``Sharding._carry``), over peer reading of a flat mesh: from
        now on the gathers (``gathers``) or the reductions (``reduces``) by reading carry their
        identity in their ready message (see above). Not collective: every rank decides alike
        (the ways and the mesh are agreed)."""
        assert self.reads_every_rank, "peer reading of a flat mesh only"
        self._read_gathers, self._read_reduces = gathers, reduces

    @property
    def reads_every_rank(self) -> bool:
        """Whether the peer memory reaches every rank of the model (a flat mesh of one host)."""
        return self._peers is not None and not self._wider

    @property
    def said(self) -> int:
        """The sequence number of the last identity said: a step by reading started now
        compares up to it (``compare_said``) before it reads anything."""
        return self._seq

    def _say(self, identity: Identity) -> None:
        """Says ``identity`` with the next message to the other ranks (a ready message) or before
        this rank waits for any of them; compared later (``compare_said``)."""
        if not self.enabled:
            return
        mine = identity.packed()
        self._last = mine
        self._seq += 1
        self._peers.defer(self._peers.others(), self._channel, GATHER_READY, self._seq, mine)
        self._said.append((self._seq, mine))

    def flush(self) -> None:
        """Sends an identity said whose step told nothing (a unit whose groups gather nothing:
        a replicated base), so that no rank goes on holding it."""
        if self._said:
            self._peers.flush()

    def compare_said(self, through: int | None = None) -> None:
        """Compares every identity said and not yet compared, up to sequence number
        ``through`` (default: all), in order, with every other rank's; raises ``Diverged`` at
        the first that differs (every rank at the same one)."""
        said = self._said
        if not said:
            return
        peers, channel = self._peers, self._channel
        peers.flush()  # (an identity said must be sent before this rank waits)
        others = peers.others()
        while said and (through is None or said[0][0] <= through):
            seq, mine = said.popleft()
            heard = [peers.hear(q, channel, GATHER_READY, seq) for q in others]
            if heard.count(mine) != len(heard):  # (one C call: this runs per gather)
                group = self._peer_group
                by_rank = dict(zip(others, heard))
                by_rank[group.rank()] = mine
                raise self.diverged([by_rank[q] for q in range(group.size())], group)

    # -- the identity carried in the rows (comm/rows.py, comm/carried.py) ---------------------
    #
    # Why no rank can pair collectives of other shapes (by induction on the model's
    # collectives): every rank's k-th is a rows gather, of one shape on every rank. A data
    # collective starts only after every rows gather before it was compared and found equal,
    # on every rank (``check`` and ``agreed`` compare those left unchecked first), and equal
    # identities mean the same data collective. A carried gather or reduction is itself a rows
    # gather: its data is read from the rows (copied out, or added) only once it and every one
    # before it were compared (``compared``). Every rank holds the same rows, so every rank
    # raises the same ``Diverged`` at the first that differs.

    def carry(self, width: int, units: set[int], reduces: set[int] = frozenset()) -> None:
        """Collective, once, when the model is built (``Sharding.seal``): from now on every check
        is a rows gather with ``width`` bytes of slots, and the gathers of ``units`` carry their
        parts in them (``CarriedGather``), the gradient reductions of ``reduces`` the slices of
        the packed gradients the other ranks keep (``CarriedReduce``); 0: none, as before.
        Only over gloo's collectives of a flat mesh: the caller's to know. The width is the
        same on every rank (the structure is agreed); compared once all the same, since ranks
        that differed in it would pair rows of other sizes."""
        widths = self._all_gather(width)
        if len(set(widths)) > 1:
            raise RuntimeError(f"zerocore: the ranks chose different widths for the lockstep's "
                               f"rows ({widths}, by rank): their models differ in the sizes "
                               f"of their units; shard the same model on every rank")
        if width > 0:  # (no unit small enough: the all-reduce stays)
            self._rows = Rows(self._group, width)
            self._carried = frozenset(units)
            self._carried_reduces = frozenset(reduces)

    def carries(self, unit: int) -> bool:
        """Whether ``unit``'s gathers carry its identity now."""
        return self.enabled and self._rows is not None and unit in self._carried

    def carries_reduce(self, unit: int) -> bool:
        """Whether ``unit``'s gradient reductions carry their identity now."""
        return self.enabled and self._rows is not None and unit in self._carried_reduces

    def start_carried(self, unit: int, part: torch.Tensor | tuple[torch.Tensor, ...],
                      kind: int = GATHER) -> Sent:
        """Starts ``unit``'s gather (``kind`` ``GATHER``) or gradient reduction (``REDUCE``,
        in backward) in the rows, ``part`` (1D uint8, or pieces laid end to end) this rank's
        bytes of it; compared by ``finish_carried``, or by the next check if that comes
        first."""
        mine = Identity(kind, BACKWARD if kind == REDUCE else self.phase, unit,
                        self.micro_batch, self.step).packed()
        self._last = mine
        self._seq += 1
        sent = self._rows.start(mine, part)
        self._unchecked.append(sent)
        return sent

    def finish_carried(self, sent: Sent, out: torch.Tensor) -> None:
        """Waits for a carried gather and every one started before it, compares them in that
        order (raising ``Diverged`` at the first that differs), then writes its data into
        ``out``, the gathered buffer: never before its identities agreed."""
        self.compared(sent)
        sent.copy_out(out)
        self._rows.give_back(sent)

    def compared(self, sent: Sent) -> Sent:
        """``sent``, waited for and compared, with every rows gather started before it, in that
        order (raising ``Diverged`` at the first that differs): its rows may be read now. The
        caller gives them back (``give_back``) once it has read them."""
        while not sent.compared:
            self._compare(self._unchecked.popleft())
        return sent

    def give_back(self, sent: Sent) -> None:
        self._rows.give_back(sent)

    def _compare_unchecked(self) -> None:
        """Compares every carried gather left unchecked (a prefetch not yet waited for, or
        never: a unit this rank skipped), in order."""
        while self._unchecked:
            self._compare(self._unchecked.popleft())

    def _compare(self, sent: Sent) -> None:
        for handle in sent.handles:
            self._wait(handle)
        every = sent.identities()
        if any(v != sent.identity for v in every):
            raise self.diverged(every, self.group)
        sent.compared = True

    def _all_gather(self, mine: int) -> list[int]:
        """Every rank's identity, by rank of the whole group. One all-reduce (MAX) of
        (mine, -mine) says whether they all agree: gloo's all-reduce of two int64 is a round
        trip cheaper than its all-gather (bench/records/2026-12-06-engines-lockstep-cheaper.md).
        Every rank then holds the same extremes, so every rank takes the same branch: only
        when they differ (a divergence: once) does the all-gather follow, to name them."""
        extremes = self._extremes
        extremes[0], extremes[1] = mine, -mine
        self._wait(dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self._group,
                                   async_op=True))
        highest, lowest = extremes[0].item(), -extremes[1].item()
        if highest == lowest:
            return [mine] * self.group.size()
        self._mine.fill_(mine)
        all_gather_sync(self._every, self._mine, self._group)
        return self._every.tolist()

    def _wait(self, work: dist.Work) -> None:
        """Waits for the exchange's all-reduce (or one broadcast of its rows) in slices; after
        each, asks the others where they wait, and raises ``Diverged`` when one waits in a
        collective of its own that this rank belongs to: it will never come to this exchange. Ends
        with the backend's own error (a lost rank, its timeout)."""
        if work.is_completed():  # (most broadcasts of a prefetched gather's rows, by now)
            work.wait()  # (returns at once, or raises the backend's error)
            return
        slice_s = _SLICE_S
        before: dict[int, str] = {}
        while not wait_for(work, slice_s):
            elsewhere = self._questions.ask()  # {rank: where it waits}
            # A rank that said so twice running, at the same place: once could be a rank only
            # slow inside a torch.distributed call this rank has left (``_answered``). (And not
            # an answer given just before that rank came here: then the exchange is done.)
            again = [(r, where) for r, where in elsewhere.items() if before.get(r) == where]
            if again and not work.is_completed():
                raise self._elsewhere(*again[0], self.group)
            before = elsewhere
            slice_s = min(2 * slice_s, _SLICE_MAX_S)

    # -- ranks that wait for each other (peer memory) ------------------------------------------
    #
    # A gather or reduction by reading ends with each rank waiting for the others' messages
    # (a buffer ready, a buffer read). Ranks that diverged can each wait for the other there,
    # neither at an exchange: one freeing a unit the other gathered but skipped. A wait that
    # lasts tells the rank waited for what it waits for (``_blocked``); a rank that hears this
    # while it waits itself, for a message the other never sent, knows that neither will send
    # again: both raise (``_abort``), and tell every other rank (``_ABORT``).

    def _heard(self, rank: int, key: int, value: int, awaited: int) -> bool:
        """Peer memory's watch (see above); True for a message of its own, consumed."""
        if _channel_of(key) != self._channel:
            self._awaits.pop(rank, None)  # that rank went on since it said it waits
            return False
        kind = (key >> 32) % 4
        if kind == GATHER_READY:  # an identity
            self._awaits.pop(rank, None)
            if _channel_of(awaited) != self._channel:
                self._overtaken(rank, key, value)
            return False
        if kind == _AT and key & 0xFFFFFFFF:
            self._answered(rank, key & 0xFFFFFFFF, value, awaited)
        elif kind == _AT:
            self._at[rank] = value
        elif kind == _AWAITS and key & 0xFFFFFFFF:
            self._probe(rank, key & 0xFFFFFFFF, value)
        elif kind == _AWAITS:
            self._awaits[rank] = value
            if _channel_of(awaited) != self._channel and not self._peers.was_sent(rank, value):
                self._abort(rank)
        elif kind == _ABORT:
            raise self._told(rank, value)
        return True

    def _blocked(self, rank: int, awaited: int) -> None:
        """Peer memory: this rank has waited a while for ``awaited`` from ``rank`` (told again
        each while it waits)."""
        # Whether ``rank`` waits in a collective of its own, which would leave both waiting
        # (answered from a thread of its own; ``_answered`` reads the answer).
        self._questions_asked = self._questions_asked % _QUESTIONS + 1
        self._asked[rank] = (self._questions_asked, awaited)
        self._peers.ask(rank, self._channel, _AT, self._questions_asked)
        me = self._peer_group.rank()
        # Every rank that waits for this one reads what it sends: the probe goes back along
        # the waits, and comes to ``rank`` when they close a cycle (``_probe``).
        self._peers.tell(self._peers.others(), self._channel, _AWAITS,
                         ((me + 1) << _PROBE_SHIFT) | (rank + 1), awaited)
        if _channel_of(awaited) == self._channel:
            return  # an exchange: the other, when it waits, hears this rank's identity
        peers = self._peers
        peers.tell([rank], self._channel, _AT, 0, self._last)
        peers.tell([rank], self._channel, _AWAITS, 0, awaited)
        theirs = self._awaits.get(rank)
        if theirs is not None and not peers.was_sent(rank, theirs):
            self._abort(rank)

    def _answered(self, rank: int, question: int, value: int, awaited: int) -> None:
        """``rank``'s answer to question ``question`` (``_blocked``), read while this rank waits
        for ``awaited`` from it. Taken only when it answers the last question asked of that
        rank, in this very wait: an older answer (a slow answering thread) may describe a wait
        that has since ended. Raises when the rank said twice running, in this wait, that it
        waits at the same place in a collective of its own: once could be a rank that is only
        slow inside a ``torch.distributed`` call that this rank has already left (unpickling a
        large object); a second question is asked a grace period later (``_blocked``)."""
        if self._asked.get(rank) != (question, awaited):
            return  # (a stale answer)
        where = self._peers.answer_text(rank, value)
        before = self._said_elsewhere.pop(rank, None)
        if not where:
            return
        if before == (awaited, where):
            raise self._elsewhere(group_ranks(self._peer_group)[rank], where, self._peer_group)
        self._said_elsewhere[rank] = (awaited, where)

    def _probe(self, rank: int, seq: int, awaited: int) -> None:
        """``rank``, which this rank waits for, passed on a probe: rank ``began`` waits for rank
        ``waits_for`` (``awaited``), and every rank between, from ``began``'s waiters on to
        ``rank``, waited for the one before it when it passed it on. Each was still waiting
        then: what it waited for comes before the probe in its pipe, and was not there. When
        this rank is ``waits_for`` and has not sent ``awaited``, the waits close a cycle:
        ``began`` waits for this rank, which waits for ``rank``, ..., which waits for
        ``began``; none of them will send again (Chandy, Misra and Haas's edge chasing, over
        pipes that keep their order). Otherwise this rank, waiting too, passes it on, once: it
        waits for ``rank`` until ``began`` is released, and the probe stays in its pipe until the
        rank that waits for it reads it."""
        began, waits_for = (seq >> _PROBE_SHIFT) - 1, (seq & ((1 << _PROBE_SHIFT) - 1)) - 1
        me = self._peer_group.rank()
        if waits_for == me:
            if not self._peers.was_sent(began, awaited):
                self._abort(began, cycle=True)
            return  # (what it waited for was sent since: a probe from before)
        if began == me or (seq, awaited) in self._passed:
            return  # (its own, back; or one passed on already: the first was enough)
        self._passed[(seq, awaited)] = None
        if len(self._passed) > _PASSED_KEPT:
            del self._passed[next(iter(self._passed))]
        self._peers.tell(self._peers.others(), self._channel, _AWAITS, seq, awaited)

    def _abort(self, rank: int, cycle: bool = False) -> None:
        names = group_ranks(self._peer_group)
        me = names[self._peer_group.rank()]
        theirs = self._at.get(rank)
        other = (f"; rank {names[rank]}'s last: {self.describe(Identity.unpacked(theirs))}"
                 if theirs is not None else "")
        through = (", through ranks that each wait for the next (a cycle)" if cycle else "")
        error = Diverged(f"zerocore: the ranks diverged: ranks {me} and {names[rank]} wait for "
                         f"each other{through}, each to finish a gather or reduction that the "
                         f"other started and did not finish (rank {me}'s last step: "
                         f"{self.describe(Identity.unpacked(self._last))}{other}): {_ADVICE}")
        self._tell_abort()
        raise self._beyond_the_node() or error

    def _elsewhere(self, rank: int, where: str, group: dist.ProcessGroup) -> Diverged:
        """Global rank ``rank`` answered that it waits in a collective of its own (``where``)
        that this rank belongs to, while this rank waits for it at a step of the model: neither
        can go on. Raised on this rank alone: the other's collective fails once this process
        ends."""
        me = group_ranks(group)[group.rank()]
        return Diverged(
            f"zerocore: the ranks diverged: rank {rank} {where}, a collective of its own "
            f"(not the sharded model's) that rank {me} takes part in, while rank {me} "
            f"{self.describe(Identity.unpacked(self._last))}: neither can go on; {_ADVICE}",
            {rank: where, me: self.describe(Identity.unpacked(self._last))})

    def _told(self, rank: int, value: int) -> Diverged:
        names = group_ranks(self._peer_group)
        self._tell_abort()
        beyond = self._beyond_the_node()
        if beyond is not None:
            return beyond
        return Diverged(f"zerocore: the ranks diverged: rank {names[rank]} found ranks waiting "
                        f"for each other (its last step: "
                        f"{self.describe(Identity.unpacked(value))}; rank "
                        f"{names[self._peer_group.rank()]}'s: "
                        f"{self.describe(Identity.unpacked(self._last))}): {_ADVICE}")

    def _beyond_the_node(self) -> Diverged | None:
        """HSDP, hpZ: the ranks of the other nodes are in (or will come to) the whole group's
        exchange; this rank's, saying it waits, lets every rank see the divergence. None when
        the peer group is the whole."""
        if not self._wider:
            return None
        return self.diverged(self._all_gather(Identity(WAIT, 0, 0, 0, self.step).packed()),
                             self.group)

    def _tell_abort(self) -> None:
        if not self._aborted:  # once: every rank that hears it passes it on
            self._aborted = True
            # (Not required: a rank that raised already may have closed its pipes, and one
            # that is gone needs no telling.)
            self._peers.tell(self._peers.others(), self._channel, _ABORT, 0, self._last,
                             required=False)

    def _overtaken(self, rank: int, key: int, value: int) -> None:
        """Peer memory's watch: ``rank`` said where it is (``key`` of this channel) while this
        rank waits for something else from it (``awaited``: a buffer ready, or read). A rank
        at an exchange sends nothing more until it hears this rank's, so what this rank waits
        for will never come: it is at a step the other did not reach (a gather the other
        started but never finished, having skipped its unit). Both raise: this rank here,
        the other once it hears this rank's identity, ``WAIT``."""
        if (key & 0xFFFFFFFF) != (self._seq + 1) & 0xFFFFFFFF:
            return  # (not the next exchange: cannot happen while every rank counts alike)
        self._seq += 1
        mine = Identity(WAIT, 0, 0, 0, self.step).packed()
        self._peers.tell(self._peers.others(), self._channel, GATHER_READY, self._seq, mine)
        if self._wider:  # the other nodes are in (or will come to) the whole group's exchange
            raise self.diverged(self._all_gather(mine), self.group)
        group = self._peer_group
        every: list[int | None] = [None] * group.size()  # (the others: not heard)
        every[group.rank()], every[rank] = mine, value
        raise self.diverged(every, group)

    # -- the message -------------------------------------------------------------------------

    def diverged(self, every: list[int | None], group: dist.ProcessGroup) -> Diverged:
        """What each rank was doing (``every``: identities by rank in the group, None where not
        known; named by their global ranks), ranks doing the same thing together."""
        ranks = group_ranks(group)
        doing = {ranks[q]: self.describe(Identity.unpacked(v))
                 for q, v in enumerate(every) if v is not None}
        together: dict[str, list[int]] = {}
        for rank, what in doing.items():
            together.setdefault(what, []).append(rank)
        parts = [f"rank {rs[0]} {what}" if len(rs) == 1 else
                 f"ranks {', '.join(map(str, rs))} {_plural(what)}"
                 for what, rs in together.items()]
        return Diverged(f"zerocore: the ranks diverged: {'; '.join(parts)}: {_ADVICE}", doing)

    def describe(self, identity: Identity) -> str:
        i = identity
        if i.kind in (GATHER, GATHER_IN_NODE):
            for_ = {FORWARD: f"forward of micro-batch {i.count}",
                    FORWARD_NO_GRAD: f"a forward without autograd (forward {i.count} since the "
                                     f"last optimizer.step())",
                    BACKWARD: f"backward of micro-batch {i.count}"}.get(i.phase, "?")
            within = " within the node (hpZ)" if i.kind == GATHER_IN_NODE else ""
            return f"gathers {self._unit(i.unit)}{within} for {for_} (step {i.step})"
        if i.kind == REDUCE:
            kept = (", keeping the sum for a later micro-batch (set_requires_all_reduce(False))"
                    if i.phase == BACKWARD_KEPT else "")
            return (f"reduces the gradients of {self._unit(i.unit)} in backward of micro-batch "
                    f"{i.count}{kept} (step {i.step})")
        passes = f"{i.count} backward pass{'es' if i.count != 1 else ''}"
        if i.kind == STEP:
            return f"is in optimizer.step() after {passes} (step {i.step})"
        if i.kind == STATS:
            return (f"takes the gradients' norm and overflow check before optimizer.step(), "
                    f"after {passes} (step {i.step})")
        return {WAIT: "waits for another rank to finish a gather or reduction they started "
                      "together (it reads this rank's memory), which it did not",
                FULL_STATE: "gathers the full state (full_state_dict, an export)",
                FINITE: "checks that its master weights are finite (trainable_finite(), "
                        "which waits for the overlapped optimizer pass on every rank)",
                ZERO_GRAD: "is in optimizer.zero_grad(set_to_none=False), which waits for "
                           "the overlapped optimizer pass on every rank",
                REPLICAS: "compares HSDP's replicas (replicas_agree())",
                SAVE: "is in zerocore.save_checkpoint()",
                LOAD: "is in zerocore.load_checkpoint()"}.get(i.kind, f"(step kind {i.kind})")

    def _unit(self, index: int) -> str:
        if 0 <= index < len(self.names):
            return self.names[index]
        return f"unit {index}"


def _plural(doing: str) -> str:
    """``doing`` ("gathers ...", "is in ...") said of several ranks."""
    verb, _, rest = doing.partition(" ")
    return f"{'are' if verb == 'is' else verb[:-1]} {rest}"


def _channel_of(key: int) -> int:
    """The channel of a peer-memory message's key (``peer_memory._key``)."""
    return (key >> 32) // 4


def exchange_group(group: dist.ProcessGroup,
                   side_channel: bool | None = None) -> dist.ProcessGroup:
    """The group the exchange runs over, with CPU tensors: ``group`` itself when it has a CPU
    backend (gloo, "cpu:gloo,cuda:nccl"), else (NCCL alone) a gloo group of the same ranks,
    created by them alone and kept for the model's life. NCCL would run each exchange on the
    GPU and read the answer back: a host synchronisation per unit, which also ends the overlap
    of a prefetched gather. ``side_channel`` forces the choice (default: by the backend);
    tests use it to run the side group over gloo."""
    if side_channel is None:
        side_channel = uses_side_channel(backend_map(group))
    if not side_channel:
        return group
    # (use_local_synchronization: a subgroup's ranks need not wait for the world's others.
    # Not destroyed: see comm/device.py's agree_on_devices, why a side group is kept.)
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                          use_local_synchronization=True)


def lockstep_of(params) -> list[Lockstep]:
    """The lockstep of every sharded model whose shards are among ``params`` (an optimizer's
    parameters), each once, in the order met."""
    out: dict[int, Lockstep] = {}
    for p in params:
        lockstep = getattr(p, "lockstep", None)
        if lockstep is not None:
            out.setdefault(id(lockstep), lockstep)
    return list(out.values())
