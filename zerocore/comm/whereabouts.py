"""``waits_elsewhere``: whether a thread of this process waits in a collective of its own (a
``torch.distributed`` call that zerocore did not make) over a group that includes a given rank.

A rank that runs a forward of the sharded model alone (a sample for the log on rank 0) waits at
the model's first exchange for ranks that are somewhere else. When they wait in a collective of
their own that the lone rank belongs to (``dist.barrier()`` after the loop, a metric's
``all_reduce``), neither can ever go on: the lone rank is not in their collective, and they are
not at its exchange. Nothing in their collective says so: gloo waits out the group's timeout.
The lone rank asks them where they are (``PeerMemory.ask`` on one host, ``StoreQuestions.ask`` over
gloo's collectives), and each answers from a thread of its own, which reads its main thread's
Python stack (``sys._current_frames``): a main thread whose innermost Python frame is a
``torch.distributed`` function called from outside zerocore, still at the same place a moment
later, waits there. Computing, or waiting inside zerocore (whose waits the lockstep understands),
is not waiting elsewhere.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["waits_elsewhere"]

_TORCH = str(Path(torch.__file__).parent) + os.sep
_TORCH_DISTRIBUTED = str(Path(dist.__file__).parent) + os.sep
_ZEROCORE = str(Path(__file__).resolve().parents[1]) + os.sep
# How long the main thread must stay at the same place to be said to wait there (a collective
# that is about to complete moves on within it).
_STILL_S = 0.2


def waits_elsewhere(thread_id: int, rank: int) -> str:
    """"" unless thread ``thread_id`` waits in a ``torch.distributed`` call made outside zerocore,
    over a group that includes global rank ``rank``, and is still there ``_STILL_S`` later;
    then where, e.g. "waits in torch.distributed.barrier() at train.py:42"."""
    first = _where(thread_id, rank)
    if first is None:
        return ""
    time.sleep(_STILL_S)
    again = _where(thread_id, rank)
    if again is None or again[0] is not first[0] or again[1] != first[1]:
        return ""
    return again[2]


def _where(thread_id: int, rank: int) -> tuple[object, int, str] | None:
    """(the innermost frame, its instruction, the words) of such a wait (see
    ``waits_elsewhere``), or None."""
    innermost = sys._current_frames().get(thread_id)
    if innermost is None or not innermost.f_code.co_filename.startswith(_TORCH_DISTRIBUTED):
        return None
    call, frame = None, innermost
    # torch.distributed's own frames, innermost first (the function the caller called is the
    # outermost of them that is not a logging wrapper), then the caller's.
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        if (frame.f_code.co_filename.startswith(_TORCH_DISTRIBUTED)
                and frame.f_code.co_name != "wrapper"):
            call = frame
        frame = frame.f_back
    caller = frame
    while frame is not None:
        if frame.f_code.co_filename.startswith(_ZEROCORE):
            return None  # zerocore's own wait: the lockstep understands those
        frame = frame.f_back
    if call is None or caller is None:
        return None
    group = call.f_locals.get("group")
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, dist.ProcessGroup):
        return None
    try:
        if rank not in dist.get_process_group_ranks(group):
            return None  # a collective of other ranks: it completes without the asker
    except (RuntimeError, ValueError):
        return None  # (a group already destroyed)
    where = os.path.relpath(caller.f_code.co_filename)
    if where.startswith(".."):
        where = caller.f_code.co_filename
    return (innermost, innermost.f_lasti,
            f"waits in torch.distributed.{call.f_code.co_name}() at {where}:{caller.f_lineno}")
