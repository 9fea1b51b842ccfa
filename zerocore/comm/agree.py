"""``run_agreed``: run a step on every rank and let the ranks agree on whether it failed.

Without it, an error on one rank (rank 0 alone writes a file, reads a manifest, prepares data)
leaves the other ranks waiting in their next collective until the process group times out, and
then they fail with a gloo/NCCL traceback that buries the real message. With it every rank leaves
the step together: each learns which ranks failed and with what message.

Semantics, on every rank of the group (a collective: every rank must call it, in the same order
as its other collectives):
- ``fn()`` runs; any ``Exception`` it raises is caught (``KeyboardInterrupt``/``SystemExit`` are
  not: the process is going away, and its peers will see it as a lost rank);
- the ranks all-gather whether they failed and the failure's type and message (one small
  object all-gather, on the CPU when the group has a CPU backend, else on ``device``: see
  ``run_agreed``);
- no rank failed: every rank returns its own ``fn()`` result;
- some rank failed: the lowest rank with each distinct failure (type and message) re-raises its
  own exception, unchanged; every other rank raises ``PeerError``, naming the failed ranks and
  the lowest failed rank's message. So an error that every rank hits alike (the same bad file)
  is raised once, by the lowest rank, with its own type, and a caller that prints the
  exceptions it gets and stays quiet on ``PeerError`` reports each distinct problem once.

``fn`` may do work on one rank only (``run_agreed(load if rank == 0 else lambda: None)``): the
others wait in the all-gather, and learn of rank 0's failure instead of hanging.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from zerocore.comm.device import comm_device
from zerocore.comm.objects import all_gather_objects

T = TypeVar("T")


class PeerError(RuntimeError):
    """Another rank failed in a step run by ``run_agreed``; that rank reports the problem.

    failures: {rank: "ExceptionType: message"} of every rank that failed, lowest first.
    first_rank, first_type, first_message: the lowest failed rank's exception, in parts.
    """

    def __init__(self, failures: dict[int, tuple[str, str]]):
        self._raw = dict(failures)
        self.failures = {r: f"{t}: {m}" for r, (t, m) in sorted(failures.items())}
        self.first_rank = min(failures)
        self.first_type, self.first_message = failures[self.first_rank]
        ranks = ", ".join(str(r) for r in self.failures)
        super().__init__(f"rank(s) {ranks} failed; rank {self.first_rank}: "
                         f"{self.first_type}: {self.first_message}")

    def __reduce__(self):
        # Exceptions unpickle as cls(*self.args), and args is the message here: rebuild from
        # the failures instead (process pools and test harnesses pickle exceptions).
        return PeerError, (self._raw,)


def run_agreed(fn: Callable[[], T], *, group: dist.ProcessGroup | None = None,
               device: torch.device | None = None) -> T:
    """Collective: ``fn()`` on every rank of ``group`` (default: the world), then agreement on
    the outcome; see the module docstring. Returns this rank's result of ``fn()``.

    device: where the agreement's bytes travel on a group without a CPU backend (NCCL alone):
    the device this rank computes on (a sharded model's ``.device``); default the group's bound
    device (``init_process_group(device_id=)``), else the current CUDA device."""
    error: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001  (any failure must reach the other ranks)
        error = e
    mine = None if error is None else (type(error).__name__, str(error))
    group = group if group is not None else dist.group.WORLD
    outcomes = all_gather_objects(mine, group, comm_device(group, torch.device("cpu"), device))
    failures = {r: o for r, o in enumerate(outcomes) if o is not None}
    if not failures:
        return result  # type: ignore[return-value]
    rank = dist.get_rank(group)
    if error is not None and min(r for r, o in failures.items() if o == mine) == rank:
        raise error
    raise PeerError(failures) from None
