"""The lockstep's rows (comm/lockstep.py, over gloo's collectives of a flat mesh): one gather of a
row per rank, every row of one width for the whole model, each its rank's identity (one int64)
then slots in which a small unit's gather carries its part (comm/carried.py). Every check of
such a model is one of these gathers, so ranks that diverged pair row with row, never
collectives of other sizes, which gloo answers with an abort (docs/decisions.md, "The identity
carried in the gathers of small units").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerocore.comm.transport import group_ranks


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

    def part(self, rank: int) -> torch.Tensor:
        """Rank ``rank`` (of the group)'s slots as sent (1D uint8, a view of the rows): valid
        until the rows are given back."""
        return self.rows[rank].view(torch.uint8)[8:8 + self.payload_nbytes]

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

    def start(self, identity: int, payload: torch.Tensor | tuple[torch.Tensor, ...] = ()
              ) -> Sent:
        """``payload``: 1D uint8, at most ``width`` bytes in all, this rank's part of a carried
        gather or reduction, or pieces of it laid end to end (a reduction's slices around this
        rank's own); none: the identity alone (the slots are sent as they are: unread)."""
        rows = (self._spare.pop() if self._spare
                else torch.empty(len(self.ranks), self.words, dtype=torch.int64))
        mine = rows[self.rank]
        mine[:1].fill_(identity)
        slots = mine[1:].view(torch.uint8)
        n = 0
        for piece in (payload,) if isinstance(payload, torch.Tensor) else payload:
            slots[n:n + piece.numel()].copy_(piece)
            n += piece.numel()
        handles = [dist.broadcast(rows[r], src=self.ranks[r], group=self.group, async_op=True)
                   for r in range(len(self.ranks))]
        return Sent(identity, rows, handles, n)

    def give_back(self, sent: Sent) -> None:
        """``sent``'s rows may be written again: waited for, compared, and copied out."""
        self._spare.append(sent.rows)
        sent.rows = None
