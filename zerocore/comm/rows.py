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

from zerocore.comm.collectives import broadcast_from


class _Buffer:
    """One set of rows (2D int64: ranks x words) with the views every gather of it takes, made
    once: a view costs a few microseconds of host time, and a step of small units starts and
    reads hundreds of these gathers on its critical path (docs/decisions.md, "Broadcasts
    issued by the process group")."""

    __slots__ = ("rows", "identity", "slots", "each", "identities", "as_bytes", "_payloads")

    def __init__(self, ranks: int, words: int, rank: int):
        self.rows = torch.empty(ranks, words, dtype=torch.int64)
        self.identity = self.rows[rank, :1]                        # this rank's identity
        self.slots = self.rows[rank, 1:].view(torch.uint8)         # this rank's slots
        self.each = [self.rows[r] for r in range(ranks)]           # a row per broadcast
        self.identities = self.rows[:, 0]                          # every rank's identity
        self.as_bytes = self.rows.view(torch.uint8)                # (ranks, 8 * words)
        self._payloads: dict[int, torch.Tensor] = {}  # {bytes: every rank's first bytes}

    def payloads(self, n: int) -> torch.Tensor:
        """Every rank's first ``n`` bytes of slots (ranks x n uint8, a view): a model's units
        carry a few sizes of part, each asked for at every gather of such a unit."""
        view = self._payloads.get(n)
        if view is None:
            view = self._payloads[n] = self.as_bytes[:, 8:8 + n]
        return view


class Sent:
    """One rows gather in flight: this rank's identity, the rows (every rank's, by rank of
    the group, once waited for) and the broadcasts' handles."""

    __slots__ = ("identity", "buffer", "handles", "payload_nbytes", "compared")

    def __init__(self, identity: int, buffer: _Buffer, handles: list[dist.Work],
                 payload_nbytes: int):
        self.identity = identity
        self.buffer: _Buffer | None = buffer  # None once given back
        self.handles = handles
        self.payload_nbytes = payload_nbytes
        self.compared = False     # the identities were compared (and agreed)

    def identities(self) -> list[int]:
        return self.buffer.identities.tolist()

    def part(self, rank: int) -> torch.Tensor:
        """Rank ``rank`` (of the group)'s slots as sent (1D uint8, a view of the rows): valid
        until the rows are given back."""
        return self.buffer.payloads(self.payload_nbytes)[rank]

    def copy_out(self, out: torch.Tensor) -> None:
        """``out`` (1D, contiguous, any dtype) <- every rank's slots, rank by rank: the same
        bytes a plain gather of the parts writes."""
        every = self.buffer.payloads(self.payload_nbytes)
        out.view(torch.uint8).view(every.shape).copy_(every)


class Rows:
    """The gather of rows of ``width`` bytes of slots (plus the identity) over ``group``: one
    broadcast per rank, each received in place into its row, in rank order on every rank (as
    ``all_gather_by_broadcast``), asynchronously."""

    def __init__(self, group: dist.ProcessGroup, width: int):
        self.group = group
        self.rank = group.rank()
        self.world = group.size()
        self.words = 1 + -(-width // 8)  # the identity, then the slots as whole int64
        # Rows given back (``give_back``), taken again before any is made: as many as are
        # ever in flight together (a check, and the prefetched gathers), made once. A row made
        # per gather would be freed on gloo's worker thread when it drops the broadcasts'
        # last reference, a free torch's profiler does not follow (``PeakMemory``).
        self._spare: list[_Buffer] = []

    def start(self, identity: int, payload: torch.Tensor | tuple[torch.Tensor, ...] = ()
              ) -> Sent:
        """``payload``: 1D uint8, at most ``width`` bytes in all, this rank's part of a carried
        gather or reduction, or pieces of it laid end to end (a reduction's slices around this
        rank's own); none: the identity alone (the slots are sent as they are: unread)."""
        buffer = (self._spare.pop() if self._spare
                  else _Buffer(self.world, self.words, self.rank))
        buffer.identity.fill_(identity)
        slots = buffer.slots
        n = 0
        for piece in (payload,) if isinstance(payload, torch.Tensor) else payload:
            k = piece.numel()
            slots[n:n + k].copy_(piece)
            n += k
        handles = [broadcast_from(row, r, self.group) for r, row in enumerate(buffer.each)]
        return Sent(identity, buffer, handles, n)

    def give_back(self, sent: Sent) -> None:
        """``sent``'s rows may be written again: waited for, compared, and copied out."""
        self._spare.append(sent.buffer)
        sent.buffer = None
