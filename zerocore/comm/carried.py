"""The lockstep's identity carried in a gather of rows of one shape (docs/decisions.md, "The
identity carried in the gathers of small units"). Over gloo's collectives of a flat mesh, every
step the lockstep checks begins with one gather of rows (comm/rows.py): each rank broadcasts a
row of the same width, its identity (one int64) then slots. A small unit's gather
(``CarriedGather``) puts its shard in the slots, so its check costs no collective of its own;
a small unit's gradient reduction (``CarriedReduce``) puts there the slices the other ranks
keep; every other step sends its identity alone in such a row (comm/lockstep.py,
``Lockstep.check``).
Every rank's k-th collective of the model is then one of these gathers, of one shape whatever
each rank does, so ranks that diverged pair row with row, never collectives of other sizes
(which gloo answers with an abort), and the identities in the rows name the divergence.
"""

from __future__ import annotations

import torch

from zerocore.comm.collectives import nbytes
from zerocore.comm.lockstep import REDUCE, Lockstep
from zerocore.comm.rows import Sent
from zerocore.comm.transport import (Gather, GatherByReading, Reduce, ReduceByReading,
                                     Reduction, divided, others_slices, sum_in_rank_order)

# The largest part of a unit (bytes per rank) carried in the rows. Every step the lockstep
# checks sends a row this wide at most, a unit too large for it included: the width is the
# largest carried part of the model, so a model of large units alone carries nothing and keeps
# the all-reduce of two int64. 16 KiB holds a Linear(64)'s part at two ranks (8.3 KiB), the
# slices of its fp32 gradients a rank sends the others in a carried reduction at any number of
# ranks (at three 11.1 KB: (N - 1) / N of 16.6 KB), and a layer norm's of any width in use,
# while a row of it stays far below the large units' own megabytes; a first choice, not tuned
# (no other width was measured).
CARRY_MAX_BYTES = 16 << 10


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


class CarriedReduce(Reduce):
    """A small unit's gradient reduction through the lockstep's rows: each rank sends, in its
    row beside the reduction's identity, the slices of its packed gradients that the other ranks
    keep (``others_slices``), and once the identities agreed (``Lockstep.compared``) sums its
    own slice of every rank's in rank order (``sum_in_rank_order``), read in place from the
    rows. At two ranks that is the exchange's half and the exchange's sum, bitwise
    (``ReduceByExchange``: x + y == y + x); at three and more, the plain reduction it wraps is
    gloo's all-to-all (``Reduce``), the same sum in the same order. Its check costs no
    collective of its own, and it starts at once, as the plain way does. With the lockstep
    switched off it is the plain way it wraps."""

    @staticmethod
    def row_nbytes(padded_numel: int, world_size: int, dtype: torch.dtype) -> int:
        """Bytes of one rank's part of the rows: the slices of the packed gradients the other
        ranks keep (``others_slices``)."""
        return (world_size - 1) * (padded_numel // world_size) * dtype.itemsize

    def __init__(self, plain: Reduce, lockstep: Lockstep, unit: int):
        super().__init__(plain.route)
        self.name = plain.name
        self._plain = plain
        self._lockstep = lockstep
        self._unit = unit

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        if not self._lockstep.carries_reduce(self._unit):
            return self._plain.start(packed, lo, hi)
        r = self.route
        factors = r.factors(packed.dtype)
        divided(packed, factors.pre)
        r.counter.reduce_scatter_bytes += nbytes(packed)  # counted as the plain way's
        r.counter.reduce_scatter_calls += 1
        pieces = tuple(p.view(torch.uint8) for p in others_slices(packed, lo, hi))
        sent = self._lockstep.start_carried(self._unit, pieces, kind=REDUCE)

        def finish() -> torch.Tensor:
            rows = self._lockstep.compared(sent)
            n, rank = hi - lo, r.rank

            def theirs(q: int) -> torch.Tensor:  # rank q's part holds every slice but q's own
                k = rank - 1 if rank > q else rank
                return rows.part(q).view(packed.dtype)[k * n:(k + 1) * n]
            mine = sum_in_rank_order(packed[lo:hi], rank, r.world_size, theirs)
            self._lockstep.give_back(sent)  # (added: the rows may be written again)
            return divided(mine, factors.post)
        return Reduction(finish)


class ReadCarriedGather(Gather):
    """Peer reading's gather (``GatherByReading``) with the lockstep's identity in its ready
    message (``Lockstep.carry_reading``): the identity said when the unit's gather began
    (``Lockstep.gather``) rides in the same write as the message that this rank's buffer is
    ready, and the identities said up to it are compared when the gather is waited for, before
    any other rank's part is read. With the lockstep switched off nothing is said, and it is
    the plain gather it wraps."""

    def __init__(self, plain: GatherByReading, lockstep: Lockstep):
        super().__init__(plain.route)
        self.name = plain.name
        self._plain = plain
        self._lockstep = lockstep
        self._through = 0  # the last identity said when the gather in flight started

    def start(self, out: torch.Tensor, source: torch.Tensor) -> None:
        self._through = self._lockstep.said
        self._plain.start(out, source)

    def wait(self, out: torch.Tensor) -> None:
        self._lockstep.compare_said(self._through)
        self._plain.wait(out)

    def before_free(self) -> None:
        self._plain.before_free()


class ReadCarriedReduce(Reduce):
    """Peer reading's reduction (``ReduceByReading``) with the lockstep's identity in its ready
    message, as ``ReadCarriedGather``: compared when the reduction is finished, before any other
    rank's contribution is read. With the lockstep switched off it is the plain
    reduction it wraps."""

    name = ReduceByReading.name
    in_flight_nbytes = ReduceByReading.in_flight_nbytes
    kept_nbytes = ReduceByReading.kept_nbytes

    def __init__(self, plain: ReduceByReading, lockstep: Lockstep):
        super().__init__(plain.route)
        self._plain = plain
        self._lockstep = lockstep

    def before_pack(self) -> None:
        self._plain.before_pack()

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> Reduction:
        through = self._lockstep.said
        reduction = self._plain.start(packed, lo, hi)

        def finish() -> torch.Tensor:
            self._lockstep.compare_said(through)
            return reduction.finish()
        return Reduction(finish, held=reduction.held)
