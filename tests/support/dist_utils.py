"""Harness for multi-process tests: N ranks of a gloo process group on the CPU, each a process
forked by torch.multiprocessing's "forkserver" (which has imported torch and zerocore once),
running test functions on every rank.

Starting a rank still costs a process and a process group, so a ``World`` starts its processes
once and keeps them for many tests; a pytest fixture owns it (module scope, one world
size at a time). ``world.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and
returns the results in rank order. ``fn`` must be a module-level function (the ranks import it by
name) and its arguments and result picklable (tensors are fine: they are copied).

Failures are made loud and bounded:
- an exception on any rank is raised in the parent as ``RankFailure``, carrying every failing
  rank's traceback;
- a rank that does not answer within the timeout (a hang: ranks waiting in mismatched
  collectives) or that dies raises ``RankFailure`` naming it, instead of blocking the test run.
After a failure the processes are stopped, because a failed function may leave collectives
unmatched; the next ``run`` starts a fresh set on a new port.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds one test function may take on every rank (tests may pass more). The heaviest function
# of test_shard.py takes ~10 s on a heavily loaded 2-core machine; a hang is detected after this.
DEFAULT_TIMEOUT_S = 120.0
# Seconds for the ranks to start (interpreter, `import torch, zerocore`, process group), which
# grows with the load of the machine.
START_TIMEOUT_S = 180.0
# gloo's own timeout, a backstop: a collective that waits this long raises on the rank itself. It
# is longer than any test's timeout, since a rank may legitimately wait in a collective while
# another computes (a reference model, a checkpoint); the parent's timeout bounds each test.
GLOO_TIMEOUT_S = 600.0
# After one rank fails, how long to wait for the others' answers (often their own errors) before
# stopping them: a rank blocked in a collective with the failed one would never answer.
GRACE_S = 5.0
# How long idle ranks asked to stop may take to leave the group and exit before they are signalled.
STOP_PATIENCE_S = 10.0
# A rank that does not answer is asked for its threads' stacks (SIGUSR1, faulthandler) before it
# is stopped, and they are put in the failure's message: a hang seen once in a while under load
# in CI is then named by where each thread waited, not only by the test it hung in. How long the
# ranks get to write them, and how much of each is kept (each distinct stack once: a few KB).
STACKS_WAIT_S = 1.0
STACKS_KEEP_CHARS = 12000


# Ranks are forked by a server process that has imported these (multiprocessing's "forkserver",
# one per test process, started with the first world). A spawned rank imported them itself
# (torch, zerocore, and torch._dynamo, which the reference torch.optim.AdamW's first call
# imports): two 3-rank worlds took 16.7 s of CPU spawned, 2.1 s forked with the server's own
# imports included (measured 2026-12-06, load 8). The distributed tier starts about 250 ranks
# (estimated from its modules' world sizes). Forking
# a process that has imported torch is what DataLoader's workers do; the server has run no op,
# so no thread pool or device state is copied.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zerocore", __name__]


class RankFailure(AssertionError):
    """A test function failed, hung or died on at least one rank."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it when binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any,
            parent: tuple[dict[str, str], str, list[str]], stacks: str) -> None:
    """A rank's main loop: join the group, then run tasks until told to stop (None). ``parent``:
    the environment, working directory and import path of the process that started the world
    at that moment, which a spawned rank would have had (a forked one has the server's).
    ``stacks``: the file where SIGUSR1 writes every thread's stack (``World._stacks``)."""
    stacks_file = open(stacks, "w")  # held for the process's life: faulthandler writes to it
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)
    environ, cwd, path = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    # Every rank shares 2 cores with the others: more threads than cores only adds contention.
    torch.set_num_threads(1)
    try:
        import zerocore  # noqa: F401  (registers the ops; fail here rather than in a test)
        from zerocore.tools import join_rendezvous
        join_rendezvous(port, rank, world_size, "gloo", GLOO_TIMEOUT_S)
    except Exception:
        results.put((0, rank, "error", traceback.format_exc()))
        return
    results.put((0, rank, "ok", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args = task
        try:
            # Plain pickle copies tensors into the message: torch.multiprocessing's queues would
            # share them through one file descriptor each, which a long test run can exhaust.
            answer = ("ok", pickle.dumps(fn(rank, world_size, *args)))
        except Exception:
            answer = ("error", traceback.format_exc())
        results.put((task_id, rank, *answer))
    dist.destroy_process_group()


class World:
    """``world_size`` ranks in one gloo group; processes start on the first ``run``."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: Any = None   # the rendezvous the ranks joined, held here while they live
        self._task_id = 0
        # Where each rank writes its threads' stacks when asked (``_stacks``).
        self._stacks_dir = tempfile.TemporaryDirectory(prefix="zerocore-test-stacks-")

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any,
            timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """``[fn(0, world_size, *args), fn(1, ...), ...]``, each computed on its own rank."""
        if not self._procs:
            self._start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn, args))
        answers = self._collect(self._task_id, timeout, what=fn.__name__)
        return [pickle.loads(answers[r][1]) for r in range(self.world_size)]

    def close(self, patience: float = STOP_PATIENCE_S) -> None:
        """Stops the ranks: politely if they are idle (they leave the group and exit within
        ``patience`` seconds), else by signal (they are our children)."""
        self._ask_to_stop()
        self._reap(time.monotonic() + patience)

    def _ask_to_stop(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass

    def _reap(self, deadline: float) -> None:
        """Waits until ``deadline`` for the ranks asked to stop to exit, then signals them."""
        procs, self._procs = self._procs, []
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._tasks, self._results, self._store = [], None, None

    # -- internals -------------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        # The port stays this process's while the ranks live (``hold_rendezvous``): one learnt
        # free and handed on could be taken before rank 0 bound it (EADDRINUSE, seen in a run).
        from zerocore.tools import hold_rendezvous
        self._store = hold_rendezvous(timeout_s=GLOO_TIMEOUT_S)
        port = self._store.port
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"zerocore-test-rank{r}",
                                   args=(r, self.world_size, port, self._tasks[r], self._results,
                                         (dict(os.environ), os.getcwd(), list(sys.path)),
                                         self._stacks_path(r)))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(0, START_TIMEOUT_S, what=f"starting {self.world_size} ranks on port {port}")

    def _collect(self, task_id: int, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        """Waits for every rank's answer to ``task_id``; RankFailure on an error, hang or death."""
        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            failed = any(status == "error" for status, _ in answers.values())
            if failed:
                deadline = min(deadline, time.monotonic() + GRACE_S)
            try:
                tid, rank, status, value = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                        if r not in answers and not p.is_alive()]
                if dead:
                    self._fail(what, answers, "rank(s) died: " + ", ".join(
                        f"rank {r} (exit code {code})" for r, code in dead))
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in answers]
                    limit = GRACE_S if failed else timeout
                    self._fail(what, answers, f"rank(s) {missing} did not answer within "
                                              f"{limit:.0f} s (hung in a collective?)"
                                              + self._stacks(missing))
                continue
            if tid == task_id:
                answers[rank] = (status, value)
        if any(status == "error" for status, _ in answers.values()):
            self._fail(what, answers, "")
        return answers

    def _stacks_path(self, rank: int) -> str:
        return os.path.join(self._stacks_dir.name, f"rank{rank}.txt")

    def _stacks(self, ranks: list[int]) -> str:
        """The stacks of every thread of ``ranks`` (those that did not answer), as their
        faulthandler writes them on SIGUSR1, for the failure's message."""
        for r in ranks:
            with contextlib.suppress(OSError):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(STACKS_WAIT_S)
        parts = []
        for r in ranks:
            try:
                with open(self._stacks_path(r)) as f:
                    text = _distinct_stacks(f.read())
            except OSError as e:
                text = f"(not readable: {e})"
            parts.append(f"\n----- rank {r}'s threads, where it waited -----\n"
                         f"{text[:STACKS_KEEP_CHARS].rstrip() or '(none written)'}")
        return "".join(parts)

    def _fail(self, what: str, answers: dict[int, tuple[str, Any]], reason: str) -> None:
        self.close(patience=2.0)  # some rank may be stuck in a collective: don't wait long
        parts = [f"{what} failed on a {self.world_size}-rank world" + (f": {reason}" if reason
                                                                       else "")]
        for r in sorted(answers):
            status, value = answers[r]
            if status == "error":
                parts.append(f"----- rank {r} raised -----\n{value.rstrip()}")
            elif reason:  # (ranks left waiting: what the others returned may say why)
                parts.append(f"----- rank {r} returned -----\n{_returned(value)}")
        raise RankFailure("\n".join(parts))


def _distinct_stacks(dump: str) -> str:
    """faulthandler's dump of every thread, each distinct stack once with how many threads
    have it (a rank that ran many tests may hold many idle pool threads alike), the current
    thread's (the main one: SIGUSR1 is handled there) first."""
    counts: dict[str, int] = {}
    current = ""
    for block in dump.strip().split("\n\n"):
        header, _, frames = block.partition("\n")
        if header.startswith("Current thread"):
            current = block
        else:
            counts[frames] = counts.get(frames, 0) + 1
    others = [f"{n} thread(s) at:\n{frames}" for frames, n in counts.items()]
    return "\n\n".join([current, *others])


def _returned(value: bytes) -> str:
    """A rank's pickled answer, as text for a failure's message (at most 2,000 characters)."""
    try:
        return repr(pickle.loads(value))[:2000]
    except Exception as e:  # noqa: BLE001  (the message must still be raised)
        return f"(not readable here: {type(e).__name__}: {e})"


def stop_forkserver() -> None:
    """Ends this process's fork server, if it started one, and waits for it: its CPU time, its
    ranks' included, then counts as this process's children's, which .ci/run reports per tier
    (a server left running is reparented when this process exits, and its time is lost).
    ``_stop`` is multiprocessing's own (Python 3.8 on); without it the server just ends with
    this process, as before."""
    from multiprocessing import forkserver
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


@contextlib.contextmanager
def worlds_by_size() -> Iterator[Callable[[int], World]]:
    """``get(n)``: an n-rank World, started on first use and kept (an idle rank costs only
    memory, and tests that reshard move between world sizes); all are closed on exit. For a
    module-scoped fixture: ``with worlds_by_size() as get: yield get``."""
    opened: dict[int, World] = {}

    def get(n: int) -> World:
        if n not in opened:
            opened[n] = World(n)
        return opened[n]

    try:
        yield get
    finally:
        # Every world is asked first, then all are awaited together: a rank takes seconds to
        # exit (its interpreter's teardown), and the worlds one after another took 37 s at the
        # end of CI's distributed tier.
        for w in opened.values():
            w._ask_to_stop()
        deadline = time.monotonic() + STOP_PATIENCE_S
        for w in opened.values():
            w._reap(deadline)


# -- helpers for test functions running on a rank -------------------------------------------------

def all_gather_flat(t: torch.Tensor) -> torch.Tensor:
    """The concatenation, in rank order, of every rank's 1-D tensor ``t`` (same size
    everywhere)."""
    t = t.detach().contiguous()
    out = torch.empty(t.numel() * dist.get_world_size(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t)
    return out


def global_mean(x: torch.Tensor) -> float:
    """The mean over ranks of a scalar: the loss of the global batch when every rank's batch
    has the same size and its loss is a mean."""
    t = x.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def inject_overflow(layers: list, rank: int) -> None:
    """Puts an inf into this rank's gradient shard at a real parameter element (not padding)
    of the first of ``layers`` (a sharded model's ``ShardedLayer``s) whose shard on this rank
    holds one: an overflow only this rank's own statistics can reveal."""
    for layer in layers:
        group = layer.trainable
        if group is None:
            continue
        lo, hi = group.layout.shard_range(rank)
        for s in group.layout.slots:
            first = max(lo, s.offset)
            if first < min(hi, s.offset + s.numel):
                group.shard.grad[first - lo] = math.inf
                return
    raise AssertionError("this rank holds no trainable parameter element")
