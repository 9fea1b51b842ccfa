"""``OptimizerPass``: the optimizer's update of offloaded shards, run on one host worker while
the next forward computes (``Offload(overlap="exact")``, docs/decisions.md, "The overlapped
optimizer pass").

``optimizer.step()`` does what is collective and what decides the update on the calling thread
(the lockstep's check, the step counts, the gradients each shard is stepped with, the settings
with the clipping and loss-scale factor folded in), then hands the per-shard Adam work to the
worker and returns. The worker steps the units in forward order and marks each done as soon
as the values the gathers read (its model copy) are written; on NVMe the masters' and moments'
writes trail behind. The results are bitwise those of the synchronous pass: the same kernel on
the same values, elementwise, only later.

Who waits for what:
- a unit's gather (and a device mirror's upload) for that unit's update alone,
  ``wait_for_update``; so does adding a gradient into a shard's ``.grad`` (the pass reads it);
- with ``Offload(overlap="delayed")`` the gathers read a published copy that the worker never
  writes (``ShardParameter.published``, refreshed by each ``step()`` before its pass starts):
  they wait for nothing (``wait_for_gather``), and backward's accumulation waits only when it
  would add into the very gradient the pass reads (``wait_for_gradient``);
- everything that reads or writes the optimizer's or the parameters' state whole (a second
  step, ``zero_grad`` that zeroes in place, state dicts, checkpoints, full states, exports,
  reading or writing a master) for the whole pass: ``settle_updates``, the one wait.

A failure on the worker (an I/O error, a full disk, a failure of the kernel) is held: a unit's
wait returns (the forward goes on, on values the run will never use) and ``settle_updates``
raises it, every time (the state is part-stepped: the run cannot go on). Where every rank
settles together (the next step, a checkpoint, a full state), it is agreed
(comm/agree.py): one line on every rank, before anything is written.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from typing import Callable, Iterable

import torch

from zerocore.comm.lockstep import lockstep_of

# How often a unit's wait looks whether its pass can still mark it done (``_wait_event``).
_STUCK_CHECK_S = 1.0

# A test hook: called on the worker before each unit's update with the unit's index (its
# layer, -1 when it has none); it may sleep (a lagging worker) or raise (a failing one).
PassHook = Callable[[int], None]


# What a job tells the worker: that it begins a unit's update (its layer's index), and that it
# has written a unit's gathered values (the unit's key: ``id`` of its shard).
Begins = Callable[[int], None]
Done = Callable[[int], None]


class Job:
    """Work of one or more units (``keys``: ``id`` of each one's shard; a job holds no shard,
    so a pass in flight holds no model) that the worker runs as one: ``run(begins, done)``
    updates them in order, calling ``begins(index)`` before each and ``done(key)`` as each
    one's gathered values are written."""

    def __init__(self, keys: list[int], run: Callable[[Begins, Done], None]):
        self.keys, self.run = keys, run


class OptimizerPass:
    """One optimizer's host worker and the pass in flight on it. Owned by the optimizer; each
    shard it steps there points to it (``shard.update_pass``) so that the engine's waits find
    it. ``hook``: ``PassHook``, for tests."""

    def __init__(self, hook: PassHook | None = None):
        self._hook = hook
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="zerocore-optimizer-pass")
        # The pass in flight: its future, and each of its units' event (by id of the shard),
        # set once the unit's update is written or the pass has ended (done or failed).
        self._running: concurrent.futures.Future | None = None
        self._units: dict[int, threading.Event] = {}
        # The gradient each unit of the pass in flight reads (by id of the shard), let go of by
        # the calling thread once the unit is done (``wait_unit``, ``finish``): the last
        # reference to a gradient is then this thread's, never the worker's (a memory
        # profiler that follows the calling thread sees it freed, where it is).
        self._held: dict[int, torch.Tensor] = {}
        # The first failure of a pass: raised by every ``finish`` from then on.
        self._failure: BaseException | None = None
        # The worker's thread (once it has run: its ident): its own uses of a shard never wait.
        self._worker_thread: list[int] = []
        # The worker goes with the pass: a pass in flight ends first (the pass is not held by
        # its own running: ``_run`` is given what it needs, not ``self``).
        weakref.finalize(self, _shut_down, self._worker)

    @property
    def in_flight(self) -> bool:
        """Whether a pass is still running on the worker."""
        return self._running is not None and not self._running.done()

    def start(self, jobs: list[Job], held: dict[int, torch.Tensor]) -> None:
        """Starts a pass over ``jobs`` (in forward order), which read the gradients ``held``
        (by id of the shard; each job lets go of its own before it says the unit is done).
        The previous pass must be finished."""
        assert self._running is None, "a pass is started only once the last one is settled"
        self._held = held
        self._units = {key: threading.Event() for job in jobs for key in job.keys}
        self._running = self._worker.submit(self._run, jobs, self._units, self._hook,
                                            self._worker_thread)

    @staticmethod
    def _run(jobs: list[Job], units: dict[int, threading.Event], hook: PassHook | None,
             thread: list[int]) -> None:
        thread[:] = [threading.get_ident()]
        begins = hook if hook is not None else (lambda index: None)
        try:
            while jobs:
                # Each job let go of once run: the gradients it holds are freed as the forward
                # goes on, not at the pass's end (the plan counts them until ``zero_grad``).
                job = jobs.pop(0)
                job.run(begins, lambda key: units[key].set())
                del job
        finally:
            for event in units.values():   # done or failed: no wait outlives the pass
                event.set()

    def wait_unit(self, shard: torch.nn.Parameter) -> None:
        """Blocks until ``shard``'s update is written, or the pass has ended (see the module's
        docstring: a failure is raised by ``finish``, not here)."""
        event = self._units.get(id(shard))
        if event is not None and threading.get_ident() not in self._worker_thread:
            self._wait_event(event)
            self._held.pop(id(shard), None)

    def _wait_event(self, event: threading.Event) -> None:
        """``event.wait()``, except that an event still unset while no pass is in flight (its
        pass ended, and every pass's end sets all its events) cannot be set any more: raised
        with what the pass holds, instead of a wait for ever; said twice, a second apart, so
        that a pass ending just then is not mistaken for it. (A guard: the hang that had this
        wait for ever was a pass blocked on its worker, found and fixed since: ``_shut_down``.)"""
        stuck = 0
        while not event.wait(_STUCK_CHECK_S):
            running = self._running
            stuck = stuck + 1 if running is None or running.done() else 0
            if stuck >= 2 and not event.is_set():
                threads = [t.name for t in getattr(self._worker, "_threads", ())
                           if t.is_alive()]
                queue = getattr(self._worker, "_work_queue", None)
                raise RuntimeError(
                    f"zerocore: an optimizer pass's unit was never marked done: the pass is "
                    f"{'none' if running is None else 'done'}, the event is "
                    f"{'in' if any(e is event for e in self._units.values()) else 'not in'} "
                    f"the pass's units ({len(self._units)}), the worker's threads alive: "
                    f"{threads or 'none'}, its queue holds "
                    f"{'?' if queue is None else queue.qsize()}; a bug of zerocore's, please "
                    f"report it")

    def wait_gradient(self, shard: torch.nn.Parameter, grad: torch.Tensor | None) -> None:
        """Before ``grad`` (``shard.grad``) is added into in place: waits for the shard's update
        if the pass reads that very tensor (a delayed pass: the new step's gradient is another
        one, beside it; the pass's is let go of when the pass is settled, at the next step)."""
        if grad is not None and self._held.get(id(shard)) is grad:
            self.wait_unit(shard)

    def unit_ready(self, shard: torch.nn.Parameter) -> bool:
        event = self._units.get(id(shard))
        return event is None or event.is_set()

    def finish(self) -> None:
        """Waits for the pass in flight; raises the held failure, if any pass had one."""
        running, self._running = self._running, None
        if running is not None:
            try:
                running.result()
            except Exception as e:  # noqa: BLE001  (held, and raised below on every call)
                self._failure = self._failure or e
            self._units, self._held = {}, {}
        if self._failure is not None:
            raise self._failure


def _shut_down(worker: concurrent.futures.ThreadPoolExecutor) -> None:
    """The end of a pass's worker: its thread ends by itself once the pass in flight, if any,
    is done (the pass holds what it needs, not the pass object). Never waited for here: this
    is a finalizer, run by whichever thread the collector runs on and wherever it runs, which
    may be inside ``threading``'s own bookkeeping (``Thread.start`` holding the lock that
    ending a thread takes): a join there never returns. That hung the test suite now and
    then: a new thread's start collected an NVMe store whose finalizer joined its threads,
    and the optimizer's pass, which had asked for that thread, waited for ever
    (docs/decisions.md, "No finalizer waits for a thread")."""
    worker.shutdown(wait=False)


def wait_for_update(shard: torch.nn.Parameter) -> None:
    """Blocks until the optimizer's pass in flight has written ``shard``'s update (nothing to
    wait for when none is, or the shard is not stepped by one)."""
    running = getattr(shard, "update_pass", None)
    if running is not None:
        running.wait_unit(shard)


def update_ready(shard: torch.nn.Parameter) -> bool:
    """Whether ``shard``'s update is written (or none is in flight), without waiting."""
    running = getattr(shard, "update_pass", None)
    return running is None or running.unit_ready(shard)


def _delayed(shard: torch.nn.Parameter) -> bool:
    """Whether the gathers read ``shard``'s published copy (``Offload(overlap="delayed")``),
    which no pass writes."""
    return getattr(shard, "published", None) is not None


def wait_for_gather(shard: torch.nn.Parameter) -> None:
    """Before a gather reads ``shard``: waits for its update (``wait_for_update``), unless the
    gathers read its published copy."""
    if not _delayed(shard):
        wait_for_update(shard)


def gather_ready(shard: torch.nn.Parameter) -> bool:
    """Whether a gather of ``shard`` would read its values without waiting."""
    return _delayed(shard) or update_ready(shard)


def wait_for_gradient(shard: torch.nn.Parameter) -> None:
    """Before backward adds into ``shard.grad``: waits for the pass to have read it. Exact: the
    shard's update (the forward's gather waited for it already); delayed: only if the pass
    reads that very tensor (``OptimizerPass.wait_gradient``)."""
    running = getattr(shard, "update_pass", None)
    if running is None:
        return
    if _delayed(shard):
        running.wait_gradient(shard, shard.grad)
    else:
        running.wait_unit(shard)


def settle_updates(params: Iterable[torch.nn.Parameter], *, together: bool = False,
                   kind: int | None = None) -> None:
    """The one wait for whole passes: waits for every optimizer pass that any of ``params``
    is stepped by, and raises a failure one had. ``together``: every rank of the models these
    shards belong to settles here at once (a step, a checkpoint, a full state), so the failure
    is agreed over them (the failing rank raises its own error, the others ``PeerError``): a
    collective when any of ``params`` is stepped by a pass, which is the same on every rank (a
    policy). Otherwise this rank alone waits (a read of one shard's master). ``kind``: the
    lockstep's step kind the ranks exchange before they agree, when the caller has not just
    checked one of its own (``Lockstep.agreed``)."""
    params = list(params)
    passes: dict[int, OptimizerPass] = {}
    for p in params:
        running = getattr(p, "update_pass", None)
        if running is not None:
            passes.setdefault(id(running), running)
    if not passes:
        return

    def finish() -> None:
        failed = None
        for running in passes.values():
            try:
                running.finish()
            except Exception as e:  # noqa: BLE001  (every pass waited for, the first raised)
                failed = failed or e
        if failed is not None:
            raise failed
    locksteps = lockstep_of(params) if together else []
    if not locksteps:
        finish()
    for lockstep in locksteps:  # (an optimizer over several models: each agrees)
        lockstep.agreed(finish, kind)
