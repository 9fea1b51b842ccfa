"""A process group of a planned world (``zerocore.plan``): ``world_size`` ranks of which this
process is one, and no other exists. It is torch's own fake backend (``FakeProcessGroup``, in
``torch._C._distributed_c10d``): every collective completes at once and moves nothing, so the
engine's step runs over it on fake tensors (shapes and dtypes, no memory) as it would over a
real group of that size.

The group is not registered with torch.distributed (no ``init_process_group``: the plan may run
in a process that has a real group, or none), so the engine asks the group itself for its rank
and size (``group.rank()``, ``group.size()``), never ``dist.get_rank(group)``. Agreement between
ranks (the same stack, the same policies, the same transport) is trivially true in a planned
world, whose ranks are this one N times: ``is_fake`` lets the agreement steps say so instead of
reading values that no collective wrote.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup


def fake_group(world_size: int, rank: int = 0) -> dist.ProcessGroup:
    """A group of ``world_size`` ranks, this process being ``rank``, whose collectives move
    nothing (CPU tensors, fake or real)."""
    backend = FakeProcessGroup._create_internal(rank, world_size)
    group = dist.ProcessGroup(dist.HashStore(), rank, world_size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return group


def is_fake(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is a planned world's (``fake_group``)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False  # no CPU backend: an NCCL group, a real one
    return isinstance(backend, FakeProcessGroup)
