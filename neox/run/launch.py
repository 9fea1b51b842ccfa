"""Starting, watching and stopping the processes of a fine-tuning run.

``launch`` (one machine): takes the output directory (lock, ownership, a write test), starts one
process per rank, and watches them. Ranks never outlive it, from their first instruction
(``zerocore.tools.run_ranks``: tied to the launcher by the kernel before their first
import, and by a socket only the launcher holds the other end of). Told to stop (SIGTERM,
Ctrl-C), the launcher stops the ranks through their sockets (they leave silently; the launcher
says so, once, on a line of its own), kills at once the ranks still starting (their watcher
not yet running) and whatever has not left ``STOP_GRACE_S`` later. When a rank fails, the
launcher names it and how it ended (its exit code, or the signal that killed it), gives the
others a moment to stop by themselves, then stops them. A rank that stops answering (stopped,
hung) is named by the rank that waited for it past ``--timeout`` (through the socket), or found
a stopped process once another rank gave up, killed at once, and named in the launcher's error.

``run_under_torchrun``: the process is one rank of torchrun's group (possibly many machines);
torchrun watches the processes. Each node parsed its own command line: once the group exists the
ranks agree the recipe (``neox.run.same_recipe``) before anything is read or written, then
global rank 0 takes the output directory. After a failure every rank knows at once (a refused
recipe), the ranks leave together (``_leave_together``): torchrun's agent terminates a node's
other ranks as soon as one exits.

Exit codes: 0 done; 2 a problem reported in one line (bad input, a corrupt checkpoint, a full
disk, a diverged run); 1 a crash (traceback shown); 3 a rank lost contact with another;
128 + N killed by signal N.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

import torch
import torch.distributed as dist

import zerocore
from neox.run.recipe import Recipe
from neox.run.run_dir import (OutputDirError, OutputDirLock, check_writable, checkpoint_run_id,
                              claim_output_dir)
from neox.run.failed import RunFailed
from neox.run.progress import say
from neox.run.same_recipe import agree_request
from neox.run.training import run_training
from zerocore.tools import (LEFT, RENDEZVOUS_HOST, STOP_GRACE_S, STOP_HEARD_WAIT_S,
                            exit_description, hold_rendezvous, join_rendezvous,
                            keep_freed_memory, receive, run_ranks, set_parent_death_signal,
                            watch_launcher)

__all__ = ["LaunchConfig", "RunRequest", "launch", "run_under_torchrun"]

# Seconds the other ranks get to stop by themselves once one has failed, before they are
# terminated (after a user error they all stop at once, having agreed on it).
SHUTDOWN_GRACE_S = 10.0
# Seconds the other ranks get once one lost contact with another (past --timeout): waiting for
# the same silent rank, or for one the launcher has just killed, they fail within moments.
LOST_GRACE_S = 3.0
# Seconds a rank named silent by another (and not a stopped process) gets to exit by itself
# before it is killed as the silent one: blocked waiting for the silent rank, it looks silent
# too, and its own wait ends about when the reporter's did.
REPORTED_GRACE_S = 1.0
# Seconds the ranks wait for each other before they leave together after a failure every rank
# knows (torchrun, ``_leave_together``): they all come within moments, having agreed on it; the
# bound only ends the wait when one crashed instead.
LEAVE_TOGETHER_S = 5.0
# Exit codes (see the module docstring).
EXIT_REPORTED = 2
EXIT_CRASH = 1
EXIT_LOST_PEER = 3


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    nproc: int                 # CPU processes (gloo); with GPUs the GPU count bounds it
    port: int                  # rendezvous port on this machine; 0: a free one
    timeout: float             # seconds a collective may wait before failing
    use_cuda: bool
    # The nodes the ranks are laid out on, node by node (what --hybrid shards within):
    # torchrun's, or --nodes on this machine.
    nodes: int = 1


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What the user asked for: the recipe, the checkpoint to resume from (already resolved to
    a step directory, and verified), whether to start over in a directory that holds another
    run, and on resume whether an unverifiable checkpoint (--allow-unverified) or changed
    training data (--data-changed) is accepted. ``deepspeed``: a DeepSpeed checkpoint the run
    continues (checked by neox.finetune); the run is a new run of its output directory."""

    recipe: Recipe
    resume: Path | None = None
    overwrite: bool = False
    allow_unverified: bool = False
    data_changed: bool = False
    deepspeed: Path | None = None


@dataclasses.dataclass(frozen=True)
class RankTask:
    """What each rank process is given."""

    request: RunRequest | None   # None under torchrun: the ranks agree it once the group exists
    run_id: str | None         # None under torchrun: rank 0 decides it after the group exists
    world_size: int
    port: int | None           # the store the launcher holds (``hold_rendezvous``); None: env://
    use_cuda: bool
    timeout: float
    nodes: int = 1


def describe_environment(use_cuda: bool, log: Any) -> None:
    n = torch.cuda.device_count() if use_cuda else 0
    for i in range(n):
        log(f"GPU {i}: {torch.cuda.get_device_name(i)}")
    log(f"n_gpus: {n}")
    log(f"NCCL available: {dist.is_nccl_available()}   gloo available: "
        f"{dist.is_gloo_available()}   MPI available: {dist.is_mpi_available()}")


# Layers are gathered and freed whole, over and over, in sizes the caching allocator cannot
# always reuse; expandable segments let it grow one mapping instead of fragmenting (PyTorch's
# own advice for such patterns). Set for the ranks unless the user chose a setting.
CUDA_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def cuda_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for CUDA ranks (nothing the user set is replaced)."""
    name, value = CUDA_ALLOC_CONF
    return {} if name in environ else {name: value}


def _take_output_dir(request: RunRequest, log: Any) -> tuple[OutputDirLock, str]:
    """Write test, lock, ownership: before any data is prepared. Returns the held lock and the
    run id."""
    directory = Path(request.recipe.output.output_dir)
    check_writable(directory)
    lock = OutputDirLock(directory)
    note = lock.acquire()
    try:
        if note:
            log(f"output: {note}")
        resume_id = checkpoint_run_id(request.resume) if request.resume is not None else None
        run_id = claim_output_dir(directory, resume_run_id=resume_id,
                                  resuming=request.resume is not None,
                                  overwrite=request.overwrite, log=log)
    except BaseException:
        lock.release()
        raise
    return lock, run_id


# -- the launcher ---------------------------------------------------------------------------------

def local_world_size(nproc: int, use_cuda: bool) -> int:
    """The processes the launcher starts: one per GPU up to ``nproc``, else ``nproc``."""
    return min(nproc, torch.cuda.device_count()) if use_cuda else nproc


def launch(request: RunRequest, config: LaunchConfig) -> int:
    """Runs the recipe on this machine: one process per GPU (NCCL), else ``config.nproc``
    CPU processes (gloo). Returns the exit code."""
    world_size = local_world_size(config.nproc, config.use_cuda)
    describe_environment(config.use_cuda, say)
    if config.use_cuda:  # read by each rank's CUDA allocator when it starts
        os.environ.update(cuda_environment(dict(os.environ)))
    try:  # held until the ranks have ended: no other process can take the port meanwhile
        store = hold_rendezvous(config.port, config.timeout)
    except OSError as e:  # before the output directory is touched
        print(f"error: rendezvous port {config.port}: {e}; give another --port, or 0 for a "
              f"free one", file=sys.stderr)
        return EXIT_REPORTED
    try:
        lock, run_id = _take_output_dir(request, say)
    except OutputDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REPORTED
    try:
        task = RankTask(request, run_id, world_size, store.port, config.use_cuda,
                        config.timeout, config.nodes)
        return _run_ranks(task)
    finally:
        lock.release()
        del store  # (the ranks have ended: the port is let go)


def _run_ranks(task: RankTask) -> int:
    return run_ranks(RANK_TARGET, task.world_size, task, marker=RANK_MARKER,
                     watch=lambda procs, links, signals: _watch(procs, links, signals,
                                                                task.timeout))


def _cause(codes: list[int | None], killed: set[int]) -> tuple[int, int] | None:
    """(rank, exit code) of the failure that explains the others: a rank that lost contact
    with another (exit 3) is a consequence, so any other failure is preferred; among equals the
    lowest rank. Ranks the launcher killed (``killed``) are consequences too. None while no
    rank has failed."""
    failed = [(rank, code) for rank, code in enumerate(codes)
              if code not in (None, 0) and rank not in killed]
    if not failed:
        return None
    causes = [f for f in failed if f[1] != EXIT_LOST_PEER]
    return (causes or failed)[0]


def _read_reports(links: list[socket.socket], open_links: set[int],
                  lost: dict[int, int], watching: set[int], timeout: float) -> None:
    """Waits at most ``timeout`` for a rank to report (``up``: its watcher runs, recorded in
    ``watching``; ``lost <rank>``: the rank it lost contact with, recorded in ``lost`` by
    reporter) or to end (its link reaches EOF)."""
    ready, _, _ = select.select([links[r] for r in open_links], [], [], timeout)
    for link in ready:
        rank = links.index(link)
        try:
            data = link.recv(4096)
        except OSError:
            data = b""
        if not data:
            open_links.discard(rank)
            continue
        for line in data.decode(errors="replace").splitlines():
            kind, _, value = line.partition(" ")
            if kind == "lost" and value.strip().isdigit():
                lost.setdefault(rank, int(value))
            elif kind == "up":
                watching.add(rank)


def _end_stopped_siblings(rank: int) -> None:
    """Under torchrun, once this rank lost contact with another (past --timeout): SIGKILL the
    workers of this rank's agent (its parent's children) that are stopped processes, and say
    which. torchrun's agent ends its remaining workers with SIGTERM, which a stopped process
    does not act on, and SIGKILLs them 30 s later: without this the job ended at --timeout +
    30 s, where neox's own launcher (``_watch``) ends it at --timeout. A stopped rank with no
    running sibling (one rank per node) is still the agent's to end, 30 s later."""
    parent = os.getppid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone, or not ours to read
        if ppid != parent or not _is_stopped(pid):
            continue
        other = next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), "?")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        print(f"error (rank {rank}): rank {other} (pid {pid}) of this node is a stopped "
              f"process (it stopped answering); killed it", file=sys.stderr, flush=True)


def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, ^Z, a debugger): it can answer no one."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False  # gone, or no /proc (not Linux)
    return state in ("T", "t")


def _watch(procs: list[subprocess.Popen], links: list[socket.socket], stop_signal: list[int],
           timeout: float) -> int:
    """Waits for every rank, ends the others when one fails or the launcher is told to stop,
    names the failure that explains the others and returns the run's exit code (``_Watch``)."""
    return _Watch(procs, links, stop_signal, timeout).run()


class _Watch:
    """What the launcher knows of its ranks while it waits for them, and what it does about it,
    one step per method, each looked at every 0.1 s:

    - ``_on_stop_signal``: told to stop, ranks still starting (no watcher yet) are killed at
      once, the others get ``STOP_GRACE_S`` to leave, then are killed;
    - ``_on_lost_contact``: once a rank lost contact with another, any rank that is a stopped
      process stopped answering and is killed at once (gloo's timeouts do not say whom they
      waited for); any rank still running ``LOST_GRACE_S`` later is killed and named;
    - ``_on_long_stopped``: a rank stopped for ``timeout`` seconds is killed, whether or not
      another rank said so yet;
    - ``_on_reported``: a rank named by the one that lost contact with it is killed
      ``REPORTED_GRACE_S`` later if still running;
    - ``_on_failure``: after another failure, the others get ``SHUTDOWN_GRACE_S`` to stop by
      themselves, then are terminated (``_end_the_rest``);
    - ``_exit_code``: once all have ended, the failure that explains the others, named."""

    def __init__(self, procs: list[subprocess.Popen], links: list[socket.socket],
                 stop_signal: list[int], timeout: float):
        self.procs, self.links, self.stop_signal, self.timeout = procs, links, stop_signal, timeout
        self.open_links = set(range(len(links)))
        self.lost: dict[int, int] = {}            # reporter -> the rank it lost contact with
        self.reported: dict[int, float] = {}      # rank named by a reporter -> when first seen
        self.stopped_since: dict[int, float] = {}  # rank seen a stopped process -> since when
        self.watching: set[int] = set()           # ranks whose watcher runs (they said "up")
        # Rank killed for not answering -> (who saw it, if one did; whether it was stopped).
        self.silent: dict[int, tuple[int | None, bool]] = {}
        self.lingering: list[int] = []            # ranks still running well after one gave up
        self.killed: set[int] = set()             # ranks this launcher ended
        self.deadline: float | None = None        # when the ranks still alive are ended
        self.first_lost: float | None = None      # when a rank first lost contact with another

    def run(self) -> int:
        while any(p.poll() is None for p in self.procs):
            if self.open_links:
                _read_reports(self.links, self.open_links, self.lost, self.watching, 0.1)
            else:
                time.sleep(0.1)
            now = time.monotonic()
            codes = [p.poll() for p in self.procs]
            self._on_stop_signal(codes, now)
            self._on_lost_contact(codes, now)
            if not self.stop_signal:
                self._on_long_stopped(codes, now)
            self._on_reported(codes, now)
            if self.deadline is None and _cause(codes, self.killed) is not None:
                self.deadline = now + SHUTDOWN_GRACE_S  # _on_failure
            if self.deadline is not None and now > self.deadline:
                self._end_the_rest(codes)
                break
        return self._exit_code()

    def _end(self, rank: int, how: str) -> None:
        if self.procs[rank].poll() is None:
            self.killed.add(rank)
            self.procs[rank].kill() if how == "kill" else self.procs[rank].terminate()

    def _on_stop_signal(self, codes: list[int | None], now: float) -> None:
        if not self.stop_signal:
            return
        self.deadline = min(self.deadline or math.inf, now + STOP_GRACE_S)
        for rank, code in enumerate(codes):
            if code is None and rank not in self.watching:
                self._end(rank, "kill")  # still importing: nothing to lose, nothing to tell it

    def _on_lost_contact(self, codes: list[int | None], now: float) -> None:
        if self.first_lost is None and EXIT_LOST_PEER in codes:
            self.first_lost = now
            self.deadline = min(self.deadline or math.inf, now + LOST_GRACE_S)
        if (self.lost or self.first_lost is not None) and not self.stop_signal:
            # SIGKILL: a stopped process ignores the rest.
            reporter = min(self.lost) if self.lost else codes.index(EXIT_LOST_PEER)
            for rank, code in enumerate(codes):
                if code is None and _is_stopped(self.procs[rank].pid):
                    self.silent.setdefault(rank, (reporter, True))
                    self._end(rank, "kill")

    def _on_long_stopped(self, codes: list[int | None], now: float) -> None:
        for rank, code in enumerate(codes):
            # Stopped as long as --timeout: the others' waits for it end now, or already have
            # (perhaps unseen: a wait queued behind another in gloo starts its own timeout).
            if code is None and _is_stopped(self.procs[rank].pid):
                if now - self.stopped_since.setdefault(rank, now) >= self.timeout:
                    self.silent.setdefault(rank, (None, True))
                    self._end(rank, "kill")
            else:
                self.stopped_since.pop(rank, None)

    def _on_reported(self, codes: list[int | None], now: float) -> None:
        for reporter, rank in self.lost.items():
            if rank != reporter and 0 <= rank < len(self.procs) and codes[rank] is None:
                # Alive, yet another rank gave up on it: silent, unless it was itself waiting
                # for the silent one and is about to exit (its own timeout, as long).
                if now - self.reported.setdefault(rank, now) >= REPORTED_GRACE_S:
                    self.silent.setdefault(rank, (reporter, False))
                    self._end(rank, "kill")

    def _end_the_rest(self, codes: list[int | None]) -> None:
        """Past the deadline: after a stop or a lost contact the ranks still running are
        killed; after another failure they are terminated, and killed ``SHUTDOWN_GRACE_S``
        later if still there."""
        if self.stop_signal or self.first_lost is not None:
            for rank, code in enumerate(codes):
                if code is None:
                    if self.first_lost is not None and not self.stop_signal:
                        # Still running well after another rank gave up waiting: it is the
                        # one that stopped answering, or waits for it.
                        self.lingering.append(rank)
                    self._end(rank, "kill")
        else:
            for rank, code in enumerate(codes):
                if code is None:
                    self._end(rank, "terminate")
            end_by = time.monotonic() + SHUTDOWN_GRACE_S
            while any(p.poll() is None for p in self.procs) and time.monotonic() < end_by:
                time.sleep(0.1)
            for rank in range(len(self.procs)):
                self._end(rank, "kill")
        for p in self.procs:
            p.wait()

    def _exit_code(self) -> int:
        procs = self.procs
        if self.stop_signal:
            if sys.stdout.isatty():  # rank 0's progress line, redrawn in place, is ended first
                print(flush=True)
            print(f"stopped by {signal.Signals(self.stop_signal[0]).name}", file=sys.stderr,
                  flush=True)
            return 128 + self.stop_signal[0]
        codes = [p.returncode for p in procs]
        # Read after every rank has ended (or been stopped): ranks often end between two
        # looks, and the first to be seen is not always the one that failed first.
        cause = _cause(codes, self.killed)
        if cause is None:
            return 0
        rank, code = cause
        if code == EXIT_LOST_PEER and (self.silent or self.lingering):
            self._name_the_silent(rank)  # no failure of its own explains it
            return EXIT_LOST_PEER
        if code != EXIT_REPORTED:  # 2: the rank said why, in one line
            print(f"error: rank {rank} (pid {procs[rank].pid}) {exit_description(code)}"
                  + ("" if len(procs) == 1 else "; the other ranks were stopped"),
                  file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code

    def _name_the_silent(self, rank: int) -> None:
        """The run failed because a rank stopped answering: names it (those found stopped
        first: the others may have waited for them), or the ranks that lingered."""
        procs, timeout = self.procs, self.timeout
        if self.silent:
            rank, (reporter, found_stopped) = min(self.silent.items(),
                                                  key=lambda item: (not item[1][1], item[0]))
            seen = (f" (a stopped process): stopped for {timeout:g} s (--timeout)"
                    if reporter is None else
                    f" (a stopped process): rank {reporter} gave up waiting after {timeout:g} s "
                    f"(--timeout)" if found_stopped else
                    f": rank {reporter} waited {timeout:g} s (--timeout) for it")
            print(f"error: rank {rank} (pid {procs[rank].pid}) stopped answering{seen}; the "
                  f"launcher killed it" + ("" if len(procs) <= 2 else " and stopped the other "
                                                                       "ranks")
                  + ("" if found_stopped else " (a stopped or hung process; if it was only "
                                              "slow, raise --timeout)"),
                  file=sys.stderr, flush=True)
        else:
            named = ", ".join(f"{r} (pid {procs[r].pid})" for r in self.lingering)
            print(f"error: rank {rank} lost contact with another rank after {timeout:g} s "
                  f"(--timeout); rank(s) {named} still ran {LOST_GRACE_S:g} s later: stopped "
                  f"or hung, or waiting for one that is; the launcher killed them",
                  file=sys.stderr, flush=True)


def _reported(leave_together: Callable[[], None] | None) -> int:
    """EXIT_REPORTED, once the ranks have left together where they do (``_run_rank``)."""
    if leave_together is not None:
        leave_together()
    return EXIT_REPORTED


# -- a rank ---------------------------------------------------------------------------------------

# Marks a rank's command line (``ps``, tests), after ``-c`` and the bootstrap.
RANK_MARKER = "neox-rank"
# What each rank runs once tied to the launcher (zerocore.tools.rank_processes's BOOTSTRAP).
RANK_TARGET = "neox.run.launch:_rank_process"


def _rank_process(rank: int, fd: int, launcher_pid: int) -> NoReturn:
    """A rank started by ``launch``: reads its task from the launcher, watches it, runs."""
    link = socket.socket(fileno=fd)
    task = receive(link)
    stop_heard = watch_launcher(rank, link, launcher_pid)  # a stop request is heard from now on

    def report_lost(lost: int) -> None:
        try:
            link.sendall(f"lost {lost}\n".encode())
        except OSError:
            pass

    code = _run_rank(rank, task, report_lost=report_lost, stop_heard=stop_heard)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave at once when the run failed: its objects still hold the process group, and tearing
    # it down under them at interpreter exit can abort the process (gloo: "terminate called
    # without an active exception"), which would bury the message.
    os._exit(code)


def run_under_torchrun(prepare: Callable[[], RunRequest], flags: Mapping[str, str],
                       config: LaunchConfig) -> NoReturn:
    """This process is rank RANK of torchrun's WORLD_SIZE processes; exits with the rank's code.
    prepare: this rank's checks and request, run once the ranks agree ``flags`` (this node's
    command line, ``same_recipe.given_flags``): see ``same_recipe.agree_request``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The node and its ranks, as torchrun's agent says them (None: not said, no agent).
    node, per_node = (int(os.environ[v]) if v in os.environ else None
                      for v in ("GROUP_RANK", "LOCAL_WORLD_SIZE"))
    if rank == 0:
        describe_environment(config.use_cuda, say)
    # torchrun's agent is the parent. ``python -m neox.finetune`` tied this process to it
    # before its imports (neox.commands.entry); again here for a caller of this function that
    # did not come through it (the tie is a no-op when made twice).
    set_parent_death_signal(signal.SIGTERM)
    if config.use_cuda:  # before this process allocates anything on the GPU
        os.environ.update(cuda_environment(dict(os.environ)))
    task = RankTask(None, None, world, None, config.use_cuda, config.timeout, config.nodes)
    code = _run_rank(rank, task, prepare=lambda: agree_request(flags, prepare, node=node,
                                                               ranks_per_node=per_node),
                     leave_together=_leave_together)
    if code == EXIT_LOST_PEER:
        _end_stopped_siblings(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    # As _rank_process, and after a success too: objects of the run (the engine's gloo pairs and
    # threads) can outlive the process group and abort the interpreter's exit ("terminate
    # called without an active exception"), which torchrun reports as the rank failing.
    os._exit(code)


def _leave_together() -> None:
    """Under torchrun, after a failure that every rank knows at once (agreed: a refused recipe,
    a diverged run) and once this rank has said why: waits (at most ``LEAVE_TOGETHER_S``) until
    every rank has said it too, then lets it leave. torchrun's agent terminates (SIGTERM) the
    other workers of its node the moment one exits non-zero, and the other agents end theirs
    once it has gone: a rank that left at once cut off the ranks still in the agreement's last
    all-gather (they lost contact: exit 3) or not yet past their line (killed by SIGTERM,
    silently). From here on a SIGTERM changes nothing: the rank has reported (exit 2) and
    leaves within the bound anyway, so it is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # An agreement on no values: it returns once every rank has come, or raises PeerLost
        # when one has not within the bound.
        zerocore.agree_values({}, what="neox.finetune", advice="leaving",
                              timeout_s=LEAVE_TOGETHER_S)
    except RuntimeError:  # PeerLost, or the backend's error
        pass  # a rank crashed instead (it said so) or has already left: leave too


def _run_rank(rank: int, task: RankTask,
              report_lost: Callable[[int], None] | None = None,
              stop_heard: Callable[[float], bool] | None = None,
              prepare: Callable[[], RunRequest] | None = None,
              leave_together: Callable[[], None] | None = None) -> int:
    """Sets up the device and the process group, runs the training, and turns what can go
    wrong into an exit code with one message. report_lost: told the rank this one lost contact
    with when zerocore's transport found it silent (the launcher kills that rank). stop_heard
    (watch_launcher's): asked before a lost contact is reported, as the rank that left may
    have left for the launcher's stop, which reaches this rank a moment later. prepare
    (torchrun): the request, agreed by the ranks (a collective) once the group exists.
    leave_together (torchrun): called after the line of a failure that every rank reports
    alike (its own, or ``prepare``'s: agreed), before this rank returns."""
    lock = None
    agreeing = False  # in ``prepare``: every failure of it is every rank's
    try:
        if task.use_cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        else:
            # Processes on one machine share its cores: more threads than cores only contend.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", task.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
            # The step's large tensors (the logits and their gradients) reuse the heap rather
            # than fresh pages each step: a third of a CPU run's time was page faults.
            keep_freed_memory()
        backend = "nccl" if task.use_cuda else "gloo"
        if task.port is None:  # torchrun's environment
            dist.init_process_group(backend, init_method="env://", rank=rank,
                                    world_size=task.world_size,
                                    timeout=datetime.timedelta(seconds=task.timeout))
            init = "env://"
        else:
            join_rendezvous(task.port, rank, task.world_size, backend, task.timeout)
            init = f"tcp://{RENDEZVOUS_HOST}:{task.port}"
        if rank == 0:
            print(f"Distributed: backend {backend}, world size {task.world_size}, init {init}",
                  flush=True)
        agreeing = prepare is not None
        request = task.request if prepare is None else prepare()
        agreeing = False
        run_id = task.run_id
        if run_id is None:  # torchrun: global rank 0 takes the directory, the others wait
            taken = zerocore.run_agreed(
                lambda: _take_output_dir(request, say) if rank == 0 else None)
            if taken is not None:
                lock, run_id = taken
            ids = [run_id]
            dist.broadcast_object_list(ids, src=0)
            run_id = ids[0]
        device = (torch.device("cuda", torch.cuda.current_device()) if task.use_cuda
                  else torch.device("cpu"))
        # The transport's waits end when the process group's do (--timeout).
        run_training(request.recipe, resume=request.resume, run_id=run_id, rank=rank,
                     world_size=task.world_size, device=device,
                     allow_unverified=request.allow_unverified,
                     data_changed=request.data_changed, deepspeed=request.deepspeed,
                     comm=zerocore.Comm(timeout=task.timeout), nodes=task.nodes)
    except RunFailed as e:  # reported in one line, agreed by every rank
        if e.message:
            print(f"error: {e.message}", file=sys.stderr, flush=True)
        return _reported(leave_together)
    except zerocore.PeerError:
        return _reported(leave_together)  # another rank reported the problem
    except zerocore.BuildError as e:
        # Raised on every rank alike, naming the first that failed: that one says it (two
        # ranks that both failed on a layer printed it twice, each before being stopped).
        if e.rank == rank:
            print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return _reported(leave_together)
    except (ValueError, FileNotFoundError, OSError) as e:  # user errors: one line
        # One write, newline included: the ranks of a node share its stderr, and an unbuffered
        # print writes the text and the newline apart, so two ranks' lines ran into each other.
        sys.stderr.write(f"error (rank {rank}): {e}\n")
        sys.stderr.flush()
        agreed = agreeing or isinstance(e, zerocore.ValuesDiffer)
        return _reported(leave_together if agreed else None)
    except Exception as e:
        if not zerocore.is_peer_loss(e):
            traceback.print_exc()
            return EXIT_CRASH
        if stop_heard is not None and stop_heard(STOP_HEARD_WAIT_S):
            return LEFT  # the launcher stopped the run, and says so once itself
        if (report_lost is not None and isinstance(e, zerocore.PeerLost) and e.silent
                and e.rank is not None):
            report_lost(e.rank)  # still there, but silent: the launcher is to kill it
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error (rank {rank}): lost contact with another rank ({first[:200]}); it failed "
              f"or was killed (see above)", file=sys.stderr, flush=True)
        return EXIT_LOST_PEER
    finally:
        if lock is not None:
            lock.release()
    dist.destroy_process_group()
    return 0
