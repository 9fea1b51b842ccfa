"""The processes of one machine's ranks, tied to the process that starts them (the launcher):
a rank cannot outlive it, from its first instruction, however the launcher ends.

    code = run_ranks("mymodule:rank_main", world_size, task, marker="my-rank")

    def rank_main(rank, fd, launcher):            # in each rank, mymodule importable
        link = socket.socket(fileno=fd)
        task = receive(link)
        stop_heard = watch_launcher(rank, link, launcher)
        ...

A rank runs ``BOOTSTRAP`` (``python -c``) before anything but the interpreter's own start-up is
imported: it asks the kernel for SIGKILL when the launcher dies (Linux ``PR_SET_PDEATHSIG``,
which needs no handler in the launcher, so it holds after a SIGKILL of the launcher too) and
leaves if the launcher is gone already; then, on the launcher's import path, it calls the
target ``(rank, fd, launcher pid)``. ``fd`` is one end of a socket pair whose other end only the
launcher holds, so the rank sees it close when the launcher ends, however it ends. The target
reads its task there (``receive``) and calls ``watch_launcher``: a thread that leaves the
moment the link closes (saying so on stderr: nobody else can) or says stop (the launcher was
stopped, and says so itself, once: the ranks leave silently rather than each print a line).
It returns ``stop_heard``: a rank that finds another gone asks it before saying so, since a
stop reaches the ranks one after another, and the first to leave is "gone" to the others.

``run_ranks`` is the launcher: it starts the ranks, sends each the task, forwards SIGINT and
SIGTERM to them as a stop, and waits for them with ``watch`` (``wait_for_ranks`` by default:
a failed rank stops the others; an application with more to say passes its own). Ctrl-C goes
to the launcher only: the ranks ignore SIGINT and are stopped through their links.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, NoReturn

# The launcher's and the ranks' lines (a rank's reason for leaving, the run's ending): logged,
# as the library never prints; with nothing configured they reach stderr as they are.
logger = logging.getLogger(__name__)

__all__ = ["BOOTSTRAP", "start_rank", "send", "receive", "watch_launcher", "stop_ranks",
           "run_ranks", "wait_for_ranks", "exit_description", "set_parent_death_signal",
           "STOP_GRACE_S", "STOP_HEARD_WAIT_S", "FAILURE_GRACE_S", "LEFT"]

# The exit code of a rank that left because its launcher ended or stopped it.
LEFT = 128 + signal.SIGTERM
# Seconds the ranks get to leave after a stop (their watchers leave at once, but a rank still
# importing has none yet): then they are killed.
STOP_GRACE_S = 1.0
# Seconds the other ranks get once one has failed, before they are stopped and killed.
FAILURE_GRACE_S = 10.0

# argv after ``-c BOOTSTRAP``: a marker (for ``ps`` and tests), the launcher's pid, the link's
# file descriptor, the rank, the import path (JSON) and the target ("module:function").
BOOTSTRAP = """\
import ctypes, importlib, json, os, signal, sys
_, _, launcher, fd, rank, path, target = sys.argv
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops us
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(launcher):
    os._exit(128 + int(signal.SIGKILL))
sys.path[:] = json.loads(path)
module, _, function = target.partition(":")
getattr(importlib.import_module(module), function)(int(rank), int(fd), int(launcher))
"""


def start_rank(rank: int, target: str, marker: str,
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen, socket.socket]:
    """Starts rank ``rank`` running ``target`` ("module:function", importable on this
    process's ``sys.path``); returns the process and this end of its link."""
    mine, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", BOOTSTRAP, marker, str(os.getpid()), str(theirs.fileno()),
             str(rank), json.dumps(sys.path), target], pass_fds=(theirs.fileno(),), env=env)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()  # the rank keeps its end; only this process keeps the other
    return proc, mine


def send(link: socket.socket, task: Any) -> None:
    """Sends a rank its task (pickled, length first)."""
    frame = pickle.dumps(task)
    link.sendall(struct.pack("<Q", len(frame)) + frame)


def receive(link: socket.socket) -> Any:
    """In a rank: its task; leaves at once if the launcher ended before sending it."""
    size = struct.unpack("<Q", _receive_exactly(link, 8))[0]
    return pickle.loads(_receive_exactly(link, size))


def _receive_exactly(link: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = link.recv(n - len(data))
        if not chunk:
            os._exit(LEFT)  # the launcher ended before this rank started
        data += chunk
    return data


# Seconds a rank that found another gone waits for a stop of its own before saying so: the
# launcher sends its stops in one loop, so the next rank's arrives within milliseconds of the
# first's; this is the wait on a loaded machine for the watcher thread to be scheduled.
STOP_HEARD_WAIT_S = 0.5


def watch_launcher(rank: int, link: socket.socket,
                   launcher_pid: int) -> Callable[[float], bool]:
    """In a rank: leave when the launcher ends (saying so on stderr) or stops this rank
    (silently: the launcher says why), and on SIGTERM; then tell the launcher that a stop is
    heard from now on ("up"). Returns ``stop_heard(within_s)``: whether a stop came, waiting
    up to ``within_s`` for one (once one has, this process is leaving)."""
    said = threading.Lock()
    stopping = threading.Event()

    def leave(why: str | None) -> NoReturn:
        if why is not None and said.acquire(blocking=False):
            logger.warning(f"rank {rank}: {why}; exiting")
        stopping.set()  # (after the line: a caller of stop_heard may leave as soon as it is set)
        os._exit(LEFT)

    def watch() -> None:
        try:
            message = link.recv(4096)
        except OSError:
            message = b""
        leave(None if message else "the launcher ended")

    threading.Thread(target=watch, name="zerocore-lifeline", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda s, f: leave(
        "the launcher ended" if os.getppid() != launcher_pid else "received SIGTERM"))
    if os.getppid() != launcher_pid:  # the launcher died before the watch began
        leave("the launcher ended before this rank started")
    try:
        link.sendall(b"up\n")
    except OSError:
        pass  # the launcher is gone: the watcher leaves
    return stopping.wait


def stop_ranks(links: list[socket.socket], signum: int) -> None:
    """Tells each rank to leave (the launcher got ``signum``)."""
    for link in links:
        try:
            link.send(f"stop {signal.Signals(signum).name}\n".encode())
        except OSError:
            pass


def exit_description(code: int | None) -> str:
    """How a process ended, from its ``Popen.returncode``."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = " (the system's out-of-memory killer, or a user)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


# A watch: (the ranks' processes, their links, the signals the launcher got so far) -> the
# launcher's exit code, once every rank has ended.
Watch = Callable[[list[subprocess.Popen], list[socket.socket], list[int]], int]


def run_ranks(target: str, world_size: int, task: Any, *, marker: str,
              watch: Watch | None = None) -> int:
    """Starts ``world_size`` ranks of ``target``, sends each ``task``, and returns ``watch``'s
    exit code (``wait_for_ranks`` by default). SIGINT and SIGTERM, from before the first rank
    exists, stop the ranks started so far; no rank is left running when this returns."""
    links: list[socket.socket] = []
    procs: list[subprocess.Popen] = []
    signals: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        stop_ranks(links, signum)  # each rank's watcher leaves

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(world_size):
            if signals:
                break
            proc, link = start_rank(rank, target, marker)
            procs.append(proc)
            links.append(link)
        for link in links if not signals else ():  # (stopped: the ranks are killed)
            try:
                send(link, task)  # read right after the rank tied itself to this process
            except OSError:
                pass  # that rank is gone already: the watch says how it ended
        return (watch or wait_for_ranks)(procs, links, signals)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for link in links:
            link.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def wait_for_ranks(procs: list[subprocess.Popen], links: list[socket.socket],
                   signals: list[int]) -> int:
    """Waits for every rank. The launcher stopped: the ranks get ``STOP_GRACE_S``, then are
    killed; exit 128 + the signal. A rank failed: it is named, the others get
    ``FAILURE_GRACE_S`` to end by themselves, then are stopped and killed; its exit code."""
    deadline = math.inf
    failed: tuple[int, int] | None = None
    while any(p.poll() is None for p in procs):
        time.sleep(0.05)
        now = time.monotonic()
        if signals:
            deadline = min(deadline, now + STOP_GRACE_S)
        codes = [p.poll() for p in procs]
        if failed is None and not signals:
            failed = _first_failure(codes)
            if failed is not None:
                deadline = now + FAILURE_GRACE_S
        if now > deadline:
            stop_ranks(links, signal.SIGTERM)
            end_by = time.monotonic() + STOP_GRACE_S
            while any(p.poll() is None for p in procs) and time.monotonic() < end_by:
                time.sleep(0.05)
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if signals:
        logger.warning(f"stopped by {signal.Signals(signals[0]).name}")
        return 128 + signals[0]
    if failed is None:  # (every rank may have ended before the first poll)
        failed = _first_failure([p.poll() for p in procs])
    if failed is None:
        return 0
    rank, code = failed
    logger.warning(f"error: rank {rank} (pid {procs[rank].pid}) {exit_description(code)}"
                   + ("" if len(procs) == 1 else "; the other ranks were stopped"))
    return code if code > 0 else 128 - code


def _first_failure(codes: list[int | None]) -> tuple[int, int] | None:
    """(rank, code) of the rank to name among those that ended badly, or None. A rank killed by
    a signal comes before one that exited: a rank that lost contact with a killed one exits
    (code 3) right after it, and both can show in the same poll; the killed one is the cause.
    Then the lowest rank."""
    bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    return min(bad, key=lambda rc: (rc[1] > 0, rc[0])) if bad else None


def set_parent_death_signal(sig: int) -> None:
    """Linux's PR_SET_PDEATHSIG for this process: the kernel sends ``sig`` when its parent dies
    (under torchrun, its agent). A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass
