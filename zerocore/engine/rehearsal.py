"""``Rehearsal``: what changes when the engine's own step runs for ``zerocore.plan`` instead of for
training: over a planned world's process group (comm/fake.py), on fake tensors, with a transport
that moves nothing and holds what each way says it holds, deciding as it would on the device
planned for, and telling the plan each time a gathered buffer's storage grows or shrinks (those
storages are resized in place, which no tensor operation shows). Nothing else of the engine
knows it is being rehearsed.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from zerocore.comm.transport import Ways


class StorageWatch(Protocol):
    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was just resized (allocated for a gather, or given back)."""


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    ways: Ways                # planned ways (``transport.planned``)
    device_kind: str          # "cuda" or "cpu": the device whose decisions the step takes
    watch: StorageWatch
