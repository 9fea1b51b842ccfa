"""The lockstep's identity carried in a gather of rows of one shape (docs/decisions.md, "The
identity carried in the gathers of small units"). Over gloo's collectives of a flat mesh, every
step the lockstep checks begins with one ``Rows`` gather: each rank broadcasts a row of the
same width, its identity (one int64) then slots. A small unit's gather (``CarriedGather``)
puts its shard in the slots, so its check costs no collective of its own; every other step
sends its identity alone in such a row (comm/lockstep.py, ``Lockstep.check``). Every rank's
k-th collective of the model is then one of these gathers, of one shape whatever each rank
does, so ranks that diverged pair row with row, never collectives of other sizes (which gloo
answers with an abort), and the identities in the rows name the divergence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zerocore.comm.collectives import nbytes
from zerocore.comm.transport import Gather, group_ranks

if TYPE_CHECKING:
    from zerocore.comm.lockstep import Lockstep

# The largest part of a unit (bytes per rank) carried in the rows. Every step the lockstep
# checks sends a row this wide at most, a unit too large for it included: the width is the
# largest carried part of the model, so a model of large units alone carries nothing and keeps
# the all-reduce of two int64. 16 KiB holds a Linear(64)'s part at two ranks (8.3 KiB), a
# layer norm's of any width in use, and costs a broadcast of gloo about its round trip on
# loopback (bench/records/2026-12-06-engines-lockstep-carried-engine.md).
CARRY_MAX_BYTES = 16 << 10


class Sent:
    """One rows gather in flight: this rank's identity, the rows (every rank's, by rank of
    the group, once waited for) and the broadcasts' handles."""

    def __init__(self, identity: int, rows: torch.Tensor, handles: list[dist.Work],
                 payload_nbytes: int):
        self.identity = identity
        # 2D int64 (ranks, words): identity, then the slots' bytes; None once given back
        self.rows: torch.Tensor | None = rows
        self.handles = handles
        self.payload_nbytes = payload_nbytes
        self.compared = False     # the identities were compared (and agreed)

    def identities(self) -> list[int]:
        return self.rows[:, 0].tolist()

    def copy_out(self, out: torch.Tensor) -> None:
        """``out`` (1D, contiguous, any dtype) <- every rank's slots, rank by rank: the same
        bytes a plain gather of the parts writes."""
        n = self.payload_nbytes
        ranks = self.rows.shape[0]
        out.view(torch.uint8).view(ranks, n).copy_(self.rows.view(torch.uint8)[:, 8:8 + n])


class Rows:
    """The gather of rows of ``width`` bytes of slots (plus the identity) over ``group``: one
    broadcast per rank, each received in place into its row, in rank order on every rank (as
    ``all_gather_by_broadcast``), asynchronously."""

    def __init__(self, group: dist.ProcessGroup, width: int):
        self.group = group
        self.rank = group.rank()
        self.ranks = group_ranks(group)
        self.words = 1 + -(-width // 8)  # the identity, then the slots as whole int64
        # Rows given back (``give_back``), taken again before any is made: as many as are
        # ever in flight together (a check, and the prefetched gathers), made once. A row made
        # per gather would be freed on gloo's worker thread when it drops the broadcasts'
        # last reference, a free torch's profiler does not follow (``PeakMemory``).
        self._spare: list[torch.Tensor] = []

    def start(self, identity: int, payload: torch.Tensor | None = None) -> Sent:
        """``payload``: 1D uint8, at most ``width`` bytes, this rank's part of a carried
        gather; None: the identity alone (the slots are sent as they are: unread)."""
        rows = (self._spare.pop() if self._spare
                else torch.empty(len(self.ranks), self.words, dtype=torch.int64))
        mine = rows[self.rank]
        mine[:1].fill_(identity)
        n = 0
        if payload is not None:
            n = payload.numel()
            mine[1:].view(torch.uint8)[:n].copy_(payload)
        handles = [dist.broadcast(rows[r], src=self.ranks[r], group=self.group, async_op=True)
                   for r in range(len(self.ranks))]
        return Sent(identity, rows, handles, n)

    def give_back(self, sent: Sent) -> None:
        """``sent``'s rows may be written again: waited for, compared, and copied out."""
        self._spare.append(sent.rows)
        sent.rows = None


class CarriedGather(Gather):
    """A small unit's gather through the lockstep's rows: its identity travels with its data,
    compared when the gather is waited for, before the data is copied into the gathered buffer
    (``Lockstep.start_carried``, ``finish_carried``). With the lockstep switched off (a
    measurement, ``Lockstep.enabled``) it is the plain gather it wraps."""

    def __init__(self, plain: Gather, lockstep: Lockstep, unit: int):
        super().__init__(plain.route)
        self._plain = plain
        self._lockstep = lockstep
        self._unit = unit
        self._sent: Sent | None = None

    def stages_parts(self) -> bool:
        return self._lockstep.carries(self._unit)

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        if not self._lockstep.carries(self._unit):
            self._plain.start(out, source)
            return
        counter = self.route.counter  # the data's bytes, counted as the plain gather's
        counter.all_gather_bytes += nbytes(out)
        counter.all_gather_calls += 1
        self._sent = self._lockstep.start_carried(self._unit,
                                                  source.reshape(-1).view(torch.uint8))

    def wait(self, out: torch.Tensor) -> None:
        if self._sent is None:
            self._plain.wait(out)
            return
        sent, self._sent = self._sent, None
        self._lockstep.finish_carried(sent, out)

    def before_free(self) -> None:
        self._plain.before_free()
