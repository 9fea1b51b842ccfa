"""The lockstep's identity carried in a gather of rows of one shape (docs/decisions.md, "The
identity carried in the gathers of small units"). Over gloo's collectives of a flat mesh, every
step the lockstep checks begins with one gather of rows (comm/rows.py): each rank broadcasts a
row of the same width, its identity (one int64) then slots. A small unit's gather
(``CarriedGather``) puts its shard in the slots, so its check costs no collective of its own;
every other step sends its identity alone in such a row (comm/lockstep.py, ``Lockstep.check``).
Every rank's k-th collective of the model is then one of these gathers, of one shape whatever
each rank does, so ranks that diverged pair row with row, never collectives of other sizes
(which gloo answers with an abort), and the identities in the rows name the divergence.
"""

from __future__ import annotations

import torch

from zerocore.comm.collectives import nbytes
from zerocore.comm.lockstep import Lockstep
from zerocore.comm.rows import Sent
from zerocore.comm.transport import Gather

# The largest part of a unit (bytes per rank) carried in the rows. Every step the lockstep
# checks sends a row this wide at most, a unit too large for it included: the width is the
# largest carried part of the model, so a model of large units alone carries nothing and keeps
# the all-reduce of two int64. 16 KiB holds a Linear(64)'s part at two ranks (8.3 KiB) and a
# layer norm's of any width in use, while a row of it stays far below the large units' own
# megabytes; a first choice, not tuned (no other width was measured).
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
