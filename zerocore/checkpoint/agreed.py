"""What every checkpoint operation shares: which sharding a model argument names, and running a
step on every rank together so that a failure on one is raised, as the same error, on all."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from zerocore.checkpoint.errors import (CheckpointError, CheckpointWriteError,
                                        DeepSpeedCheckpointError)
from zerocore.comm.agree import PeerError, run_agreed
from zerocore.engine.sharded_model import sharding_of
from zerocore.engine.sharding import Sharding

T = TypeVar("T")

# What a peer's failure is re-raised as on the ranks that did not fail, so that every rank
# raises the same type (by name: run_agreed gathers names and messages, not objects).
_SAME_ON_EVERY_RANK = {cls.__name__: cls for cls in
                       (CheckpointWriteError, CheckpointError, DeepSpeedCheckpointError,
                        TypeError, ValueError)}


def agreed(fn: Callable[[], T], group: dist.ProcessGroup, device: torch.device) -> T:
    """``run_agreed`` on ``device`` (the model's), with a peer's failure raised as that
    failure's type and message."""
    try:
        return run_agreed(fn, group=group, device=device)
    except PeerError as e:
        cls = _SAME_ON_EVERY_RANK.get(e.first_type)
        if cls is None:
            raise CheckpointError(f"rank {e.first_rank} failed: {e.first_type}: "
                                  f"{e.first_message}") from e
        raise cls(e.first_message) from e


def sharded_of(model: Any) -> Sharding:
    """The sharding a checkpoint reads or writes: a ``zerocore.shard`` model or a
    ``ShardedModel`` as it is; a model given to ``shard_model``, its sharding."""
    return model if isinstance(model, Sharding) else sharding_of(model)
