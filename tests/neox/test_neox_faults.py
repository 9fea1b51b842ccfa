"""python -m neox.finetune tried as a hostile user and a crashing machine would: each test
reproduces one way a run could be lost, corrupted or left running, and checks that it is not.

- two runs on one output directory: the second refuses at once; the first completes intact;
- the launcher killed (SIGKILL, SIGTERM), in training and at several moments of start-up, with
  2 and 16 ranks: no process of the run is left 2 s after the signal; a rank is tied to its
  launcher before its first import; a killed rank is named with its signal; a stopped rank
  (SIGSTOP; 2 and 4 ranks) ends the run within --timeout + 5 s, named, and is killed, under
  neox's launcher and under two torchrun agents (2 x 2) alike;
- Ctrl-C while a command still imports torch: one line, ``stopped by SIGINT``, exit 130;
- impossible settings are refused before any process starts;
- a diverging run stops with a message and never saves non-finite weights; metrics stay JSON;
- flags given on --resume: optimisation flags apply (said in the log), identity flags refused;
- a kill during training, then --resume: every step appears once in the metrics, and the
  losses continue bit for bit as if never interrupted;
- a full disk, and an output path that cannot be written: one line naming the path and the
  errno, the previous checkpoint intact, no temporary directory left.
The small tiny-preset runs take a few seconds each on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from neox.finetune import main as finetune_main
from neox.run.launch import RANK_MARKER
from neox.run.run_dir import CHECKPOINTS, METRICS, RUN_FILE
from tests.support.processes import RUN_MARK, left_after, marked
from zerocore.tools import hold_rendezvous
from tests.support.two_nodes import LAUNCHER_VARIABLES, torchrun_command
from tests.support.neox_testing import (EXCERPT, REPO, assert_clean_error, call_main, cli_env,
                                        run_module, start_module)
from tests.support.two_nodes import start_two_nodes

# A small run: the tiny preset (4 blocks, 64 wide) on the excerpt, 2 sequences of 16 tokens per
# rank per step: about 1,100 steps per epoch, a few hundred steps a second on 2 ranks.
SMALL = ["--cpu", "--data", EXCERPT, "--seq-len", 16, "--batch-size", 2, "--seed", 1]
# Seconds a process of the run may outlive its launcher (the bound).
ORPHAN_DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One tokenizer and token cache for every run of this file."""
    return tmp_path_factory.mktemp("cache")


def args(cache: Path, out: Path, *more) -> list:
    return [*SMALL, "--cache-dir", cache, "--output-dir", out, *more]


def finetune(cache: Path, out: Path, *more, **kwargs) -> subprocess.CompletedProcess:
    return run_module("neox.finetune", *args(cache, out, *more), **kwargs)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / METRICS).read_text().splitlines()
            if "loss" in json.loads(line)]


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the run has logged ``n`` training steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (out / METRICS).is_file() and len(metric_steps(out)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach step {n} in {timeout} s")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Fields after the command (which may hold spaces) start after the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_pids(launcher: int) -> list[int]:
    """The rank processes the launcher ``launcher`` started (their command line says so)."""
    return sorted(p for p in children(launcher) if _cmdline(p).split(b"\0")[3:4] == [
        RANK_MARKER.encode()])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_marked(*argv) -> tuple[subprocess.Popen, str]:
    """``python -m neox.finetune argv...`` in the background, its processes marked."""
    mark = uuid.uuid4().hex
    env = dict(cli_env(), **{RUN_MARK: mark})
    proc = subprocess.Popen([sys.executable, "-m", "neox.finetune", *map(str, argv)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, mark


def _call_main(capture, *argv) -> subprocess.CompletedProcess:
    """neox.finetune.main in this process (checks that run before any process starts)."""
    return call_main(finetune_main, capture, *argv)


# -- one run per output directory --------------------------------------------------------------

@pytest.mark.e2e
def test_a_second_run_on_a_directory_in_use_is_refused(cache, tmp_path, capsys):
    out = tmp_path / "out"
    first = start_module("neox.finetune", *args(cache, out, "--max-steps", 60,
                                                "--save-every", 20))
    try:
        wait_for_steps(out, 1, first)
        # In this process: the refusal comes before any rank would start.
        second = _call_main(capsys, *args(cache, out, "--max-steps", 3))
        assert_clean_error(second, "is in use by another run (pid ")
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    assert metric_steps(out) == list(range(1, 61))  # intact: every step once
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == [
        "step-00000020", "step-00000040", "step-00000060"]


@pytest.mark.e2e
def test_a_fresh_run_refuses_another_runs_outputs_unless_told(cache, four_steps, tmp_path,
                                                             capsys):
    out = Path(shutil.copytree(four_steps, tmp_path / "out"))
    owner = json.loads((out / RUN_FILE).read_text())["run_id"]
    refused = _call_main(capsys, *args(cache, out, "--max-steps", 2))  # before any process
    assert_clean_error(refused, f"holds another run (run {owner}")
    assert "--overwrite" in refused.stderr and "--resume" in refused.stderr
    again = finetune(cache, out, "--max-steps", 3, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert json.loads((out / RUN_FILE).read_text())["run_id"] != owner
    assert metric_steps(out) == [1, 2, 3]


# -- no orphans -----------------------------------------------------------------------------------

# The bound: no process of the run may be left this many seconds after the launcher got
# SIGKILL or SIGTERM. Measured from the signal (SIGTERM: the launcher's own shutdown included).
# What the run needs to meet it: the kernel's parent-death SIGKILL is immediate; after SIGTERM
# the ranks' watchers leave at once and the launcher kills the rest after STOP_GRACE_S (1 s).


def _gone_within_orphan_deadline(mark: str, signalled: float) -> list[int]:
    """The processes marked ``mark`` still alive ORPHAN_DEADLINE_S after ``signalled``."""
    return left_after(mark, max(0.0, signalled + ORPHAN_DEADLINE_S - time.monotonic()))


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=["SIGKILL", "SIGTERM", "SIGINT"])
def test_ranks_do_not_outlive_their_launcher(cache, tmp_path, sig):
    out = tmp_path / "out"
    launcher, mark = start_marked(*args(cache, out, "--epochs", 50))

    def training() -> None:
        wait_for_steps(out, 2, launcher)
        ranks = rank_pids(launcher.pid)
        assert len(ranks) == 2, ranks
    left, stderr = _signal_launcher(launcher, mark, sig, when=training)
    assert not left, f"{len(left)} processes left {ORPHAN_DEADLINE_S} s after the {sig!r}"
    if sig != signal.SIGKILL:
        assert launcher.returncode == 128 + sig
        # One line, the launcher's: the ranks leave silently (each rank's "exiting" line
        # interleaved with the others' and the progress line).
        assert stderr.strip().splitlines() == [f"stopped by {sig.name}"], stderr


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["finetune", "export", "evaluate", "generate", "plan"])
def test_ctrl_c_while_a_command_imports_torch_is_one_line(tmp_path, command):
    # Importing torch takes the first seconds of every command (6 s on a busy 2-core machine),
    # before the launcher's own handling of SIGINT exists. A stand-in torch, ahead of the real
    # one on the path, interrupts its own import as Ctrl-C would at that moment, every time
    # (a signal sent after a delay would land there only on a slow enough machine).
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-m", f"neox.{command}", "--help"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        128 + signal.SIGINT, "stopped by SIGINT\n", "")


@pytest.mark.e2e
def test_a_killed_rank_is_named_with_its_signal(cache, tmp_path):
    out = tmp_path / "out"
    launcher = start_module("neox.finetune", *args(cache, out, "--epochs", 50))
    try:
        wait_for_steps(out, 2, launcher)
        ranks = rank_pids(launcher.pid)
        os.kill(ranks[1], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL
    assert f"(pid {ranks[1]}) was killed by SIGKILL" in stderr
    assert "Traceback" not in stderr, stderr


# When the test signals the launcher during start-up: seconds after the launcher started (0.2 s
# and 1 s: the launcher importing torch, or its ranks starting on a quiet machine; 5 s: the
# ranks importing torch or joining the group; at load 6 on 2 cores the ranks existed at 5 s
# and not yet at 1 s: bench/RESULTS.md), or "spawned": as soon as every rank process exists
# (each in the interpreter's start-up or its imports). The run is long (50
# epochs), so that it is always still starting or training when the signal comes.
START_UP_MOMENTS = [0.2, 1.0, 5.0, "spawned"]


def _kill_during_start_up(cache, out, sig, moment, nproc: int) -> tuple[list[int], str]:
    more = ["--nproc", nproc, "--oversubscribe"] if nproc > 2 else []
    launcher, mark = start_marked(*args(cache, out, "--epochs", 50, *more))

    def the_moment() -> None:
        if moment == "spawned":
            deadline = time.monotonic() + 120
            while len(rank_pids(launcher.pid)) < nproc:
                assert launcher.poll() is None and time.monotonic() < deadline, \
                    launcher.communicate()
                time.sleep(0.01)
        else:
            time.sleep(moment)
        assert launcher.poll() is None, launcher.communicate()
    return _signal_launcher(launcher, mark, sig, when=the_moment)


def _signal_launcher(launcher, mark, sig, *, when) -> tuple[list[int], str]:
    """Waits for the moment (``when()``), sends ``sig`` to the launcher, and returns the run's
    processes still alive ORPHAN_DEADLINE_S after it, and the launcher's stderr; whatever
    happens, nothing of the run is left running afterwards."""
    try:
        when()
        os.kill(launcher.pid, sig)
        left = _gone_within_orphan_deadline(mark, time.monotonic())
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in marked(mark):  # (so that a failure does not leave them running)
            os.kill(pid, signal.SIGKILL)
    return left, stderr


@pytest.mark.e2e
@pytest.mark.parametrize("moment", START_UP_MOMENTS, ids=lambda m: f"{m}s" if m != "spawned"
                         else m)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_process_outlives_a_launcher_killed_during_start_up(cache, tmp_path, sig, moment):
    left, stderr = _kill_during_start_up(cache, tmp_path / "out", sig, moment, nproc=2)
    assert not left, f"{len(left)} processes left {ORPHAN_DEADLINE_S} s after the launcher died"
    assert "Traceback" not in stderr, stderr


@pytest.mark.e2e
@pytest.mark.parametrize("moment", ["spawned", 5.0], ids=["spawned", "5.0s"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_process_of_16_ranks_outlives_a_launcher_killed_as_they_start(cache, tmp_path, sig,
                                                                        moment):
    left, stderr = _kill_during_start_up(cache, tmp_path / "out", sig, moment, nproc=16)
    assert not left, f"{len(left)} processes left {ORPHAN_DEADLINE_S} s after the launcher died"
    assert "Traceback" not in stderr, stderr


# A stand-in for the launcher, for the test below: starts one rank with the launcher's own
# bootstrap (argv: the bootstrap, the rank marker, the import path for the rank as JSON, the
# rank's target, when to die), prints the rank's pid, and SIGKILLs itself at once or once the
# rank is importing.
_FAKE_LAUNCHER = """\
import os, signal, socket, subprocess, sys, time
bootstrap, marker, path, target, when, flag = sys.argv[1:]
mine, theirs = socket.socketpair()
rank = subprocess.Popen([sys.executable, "-c", bootstrap, marker, str(os.getpid()),
                         str(theirs.fileno()), "0", path, target], pass_fds=(theirs.fileno(),))
print(rank.pid, flush=True)
while when == "importing" and not os.path.exists(flag):
    time.sleep(0.001)
os.kill(os.getpid(), signal.SIGKILL)
"""

# What the rank imports first after tying itself to the launcher (``neox.run.launch``, which
# imports torch), replaced for this test by a module that says so and then takes forever.
_SLOW_IMPORT = """\
import os, sys, time
open(os.environ["NEOX_TEST_FLAG"], "w").close()
time.sleep(600)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("when", ["at-once", "importing"])
def test_a_rank_is_tied_to_its_launcher_before_its_imports(tmp_path, when):
    from neox.run.launch import RANK_TARGET
    from zerocore.tools.rank_processes import BOOTSTRAP
    stub = tmp_path / "stub" / "neox" / "run"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("")
    (stub / "launch.py").write_text(_SLOW_IMPORT)
    flag = tmp_path / "importing"
    path = json.dumps([str(stub.parent.parent)] + [p for p in sys.path if p and Path(p) != REPO])
    mark = uuid.uuid4().hex
    env = dict(cli_env(), NEOX_TEST_FLAG=str(flag), **{RUN_MARK: mark})
    fake = subprocess.Popen([sys.executable, "-c", _FAKE_LAUNCHER, BOOTSTRAP, RANK_MARKER, path,
                             RANK_TARGET, when, str(flag)], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        rank = int(fake.stdout.readline())
        fake.wait(timeout=120)
        died = time.monotonic()
        assert fake.returncode == -signal.SIGKILL
        left = _gone_within_orphan_deadline(mark, died)
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the rank (pid {rank}) outlived its launcher by {ORPHAN_DEADLINE_S} s"
    if when == "importing":  # it was in its first import when the launcher died
        assert flag.exists()


# Seconds after the ranks started at which both torchrun agents are SIGKILLed, 0.5 s apart, and
# 6 s (the issue's): the ranks are then importing torch (seconds here: training starts tens of
# seconds later on this 2-core machine). Not at 0: a rank whose agent dies in the interpreter's
# own start-up, before it can ask for its parent, is the one case left open (docs/decisions.md).
AGENT_KILL_MOMENTS = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 6.0]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _torchrun_ranks(mark: str, agents: set[int]) -> list[int]:
    """The processes marked ``mark`` that the agents started and that run their own program
    by now (a child not yet past its exec still has the agent's command line)."""
    return [pid for pid in marked(mark) if _parent(pid) in agents
            and b"torch.distributed.run" not in _cmdline(pid)]


@pytest.mark.e2e
@pytest.mark.parametrize("moment", AGENT_KILL_MOMENTS, ids=lambda m: f"{m}s")
def test_no_rank_outlives_torchrun_agents_killed_during_start_up(cache, tmp_path, moment):
    """Two torchrun agents (one rank each) killed as their ranks start: no rank is left
    ORPHAN_DEADLINE_S later (each is tied to its agent before its first heavy import)."""
    mark = uuid.uuid4().hex
    agents = start_two_nodes(["-m", "neox.finetune", *args(cache, tmp_path / "out", "--epochs",
                                                           50)],
                             nproc=1, env=dict(cli_env(), **{RUN_MARK: mark}))
    pids = {agent.pid for agent in agents}
    try:
        deadline = time.monotonic() + 120
        while len(_torchrun_ranks(mark, pids)) < 2:
            assert all(a.poll() is None for a in agents), [a.communicate() for a in agents]
            assert time.monotonic() < deadline, "the agents started no ranks"
            time.sleep(0.01)
        time.sleep(moment)
        for agent in agents:
            agent.kill()
        died = time.monotonic()
        for agent in agents:
            agent.wait()
        left = _gone_within_orphan_deadline(mark, died)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
            agent.stdout.close()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} ranks left {ORPHAN_DEADLINE_S} s after their agents died"


# The stopped-rank runs wait STOP_TIMEOUT_S (--timeout). The bound on the time from the
# stop to the end of the run (the launcher and every rank gone) is --timeout + 5 s: a survivor
# gives up after --timeout, the launcher kills the silent rank at once (named by the survivor,
# or found stopped when gloo's own timeout came first) and the survivors exit at once; 5 s is
# the slack for a loaded 2-core machine and the launcher's 0.1 s polling.
STOP_TIMEOUT_S = 5.0
STOP_BOUND_S = STOP_TIMEOUT_S + 5.0


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_stopped_rank_ends_the_run_named_and_killed(cache, tmp_path, nproc):
    out = tmp_path / "out"
    more = ["--nproc", nproc, "--oversubscribe"] if nproc > 2 else []
    launcher, mark = start_marked(*args(cache, out, "--epochs", 50, "--timeout",
                                        STOP_TIMEOUT_S, *more))
    try:
        wait_for_steps(out, 2, launcher)
        ranks = rank_pids(launcher.pid)
        assert len(ranks) == nproc, ranks
        os.kill(ranks[1], signal.SIGSTOP)  # as a debugger, ^Z or a frozen container would
        stopped = time.monotonic()
        _, stderr = launcher.communicate(timeout=STOP_BOUND_S + 120)
        left = left_after(mark, max(0.0, stopped + STOP_BOUND_S - time.monotonic()))
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert not left, "the stopped rank (or another process of the run) is still there"
    assert took < STOP_BOUND_S, (took, stderr)
    assert launcher.returncode == 3, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    # (": rank 0 waited 5 s (--timeout) for it" where zerocore's transport waited for it; " (a
    # stopped process): rank 0 gave up waiting after 5 s" where a gloo collective timed out;
    # " (a stopped process): stopped for 5 s" where the launcher saw it before any rank said.)
    assert errors[0].startswith(f"error: rank 1 (pid {ranks[1]}) stopped answering"), stderr
    assert f" {STOP_TIMEOUT_S:g} s (--timeout)" in errors[0], stderr
    assert "; the launcher killed it" in errors[0], stderr
    assert "Traceback" not in stderr, stderr


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


@pytest.mark.e2e
def test_a_stopped_rank_under_torchrun_ends_the_job_as_fast(cache, tmp_path):
    # torchrun's agent ends a failed job's other workers with SIGTERM, which a stopped process
    # does not act on, and SIGKILLs them 30 s later (the job ended at --timeout + 31 s): the
    # stopped rank's sibling, itself out of contact after --timeout, kills it.
    out = tmp_path / "out"
    mark = uuid.uuid4().hex
    env = {k: v for k, v in cli_env().items() if k not in LAUNCHER_VARIABLES}
    env[RUN_MARK] = mark
    store = hold_rendezvous()  # the agents meet on it (tests/support/two_nodes.py says why)
    command = torchrun_command(store.port, ["-m", "neox.finetune", *args(
        cache, out, "--epochs", 50, "--timeout", STOP_TIMEOUT_S)])
    agents = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        wait_for_steps(out, 2, agents[0], timeout=400)
        rank1 = next(p for a in agents for p in children(a.pid) if b"RANK=1" in _environ(p))
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        printed = "".join(a.communicate(timeout=STOP_BOUND_S + 120)[0] for a in agents)
        took = time.monotonic() - stopped
        left = left_after(mark, max(0.0, stopped + STOP_BOUND_S - time.monotonic()))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert not left, "the stopped rank (or another process of the job) is still there"
    assert took < STOP_BOUND_S, (took, printed[-6000:])
    assert f"rank 1 (pid {rank1}) of this node is a stopped process (it stopped answering); " \
           f"killed it" in printed, printed[-6000:]


# -- impossible settings -------------------------------------------------------------------------

@pytest.mark.parametrize("flags, phrase", [
    (["--nproc", "100"], "--nproc 100: this machine has"),
    (["--clip", "-1"], "--clip must be a finite number >= 0"),
    (["--lr", "inf"], "argument --lr: must be a finite number"),
    (["--lr", "nan"], "argument --lr: must be a finite number"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
    (["--betas", "0.9", "1.0"], "--betas must be two numbers in [0, 1)"),
    (["--eps", "0"], "--eps must be a finite number > 0"),
    (["--timeout", "0"], "--timeout 0: must be more than 0"),
    (["--timeout", "-5"], "--timeout -5: must be more than 0"),
    (["--port", "70000"], "--port 70000"),
    (["--keep-last", "0"], "--keep-last must be >= 1, got 0"),
    (["--lora-alpha", "0"], "--lora-alpha: LoRA alpha must be"),
    (["--filter-layers", "0-1000000000"], "block 0-1000000000 is out of range"),
    (["--filter-layers", "5-2"], "'5-2' is a reversed range"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
])
def test_impossible_settings_are_refused_before_any_process_starts(capsys, tmp_path, flags,
                                                                   phrase):
    proc = _call_main(capsys, *SMALL, "--output-dir", tmp_path / "out", *flags)
    assert proc.returncode == 2
    assert phrase in proc.stderr, proc.stderr
    assert len(proc.stderr) < 2000  # a message, not a dump (the old code printed 88 MB)
    assert not (tmp_path / "out").exists()  # nothing written, no process started
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag, where", [("--cache-dir", "a-file"), ("--cache-dir", "a-file/sub"),
                                         ("--data-dir", "a-file")])
def test_a_file_given_as_a_directory_is_refused(capsys, tmp_path, flag, where):
    (tmp_path / "a-file").write_text("")
    proc = _call_main(capsys, *SMALL, flag, tmp_path / where, "--output-dir", tmp_path / "out")
    assert_clean_error(proc, f"{flag} {tmp_path / where}: ")
    assert "is a file, not a directory" in proc.stderr and proc.returncode == 2
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_directory_is_found_before_the_data(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _call_main(capsys, *SMALL, "--output-dir", blocker / "out")
    assert proc.returncode == 2
    assert f"cannot write {blocker}" in proc.stderr and "[Errno 20]" in proc.stderr
    assert "corpus:" not in proc.stdout  # before any data was prepared


# -- divergence -----------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_diverging_run_stops_and_saves_nothing_non_finite(cache, tmp_path):
    import torch
    out = tmp_path / "out"
    proc = finetune(cache, out, "--finetune", "full", "--lr", "1e5", "--clip", "0",
                    "--save-every", "1", "--max-steps", "50")
    assert_clean_error(proc, "training diverged")
    lines = (out / METRICS).read_text().splitlines()
    records = [json.loads(line) for line in lines]  # valid JSON, NaN written as null
    assert len(records) < 50
    for ckpt in (out / CHECKPOINTS).glob("step-*"):
        for rank_file in ckpt.glob("rank-*.pt"):
            state = torch.load(rank_file, weights_only=True)
            for layer in state["layers"].values():
                if "master" in layer:
                    assert torch.isfinite(layer["master"]).all(), rank_file


# -- resume ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_steps(cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("four") / "out"
    proc = finetune(cache, out, "--max-steps", 4, "--save-every", 2)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.e2e
def test_resume_applies_given_optimisation_flags(cache, four_steps, tmp_path):
    out = Path(shutil.copytree(four_steps, tmp_path / "out"))
    # Two step directories that are not checkpoints: what a killed save leaves (only zerocore's
    # files, no manifest), and a user's folder that happens to have such a name.
    (out / CHECKPOINTS / "step-00000009").mkdir()
    (out / CHECKPOINTS / "step-00000009" / "rank-00000.pt").write_bytes(b"partial")
    (out / CHECKPOINTS / "step-00000010").mkdir()
    (out / CHECKPOINTS / "step-00000010" / "notes.txt").write_text("mine")
    proc = run_module("neox.finetune", "--resume", out / CHECKPOINTS, "--output-dir", out,
                      "--max-steps", 6, "--lr", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert "step-00000009 is not a complete checkpoint" in proc.stdout
    assert "step-00000010 is not a complete checkpoint" in proc.stdout
    assert "resumed from " + str(out / CHECKPOINTS / "step-00000004") in proc.stdout
    assert not (out / CHECKPOINTS / "step-00000009").exists()     # removed by the next save
    assert (out / CHECKPOINTS / "step-00000010" / "notes.txt").read_text() == "mine"
    # (The fixture trained from scratch: --lr 0.002 with 5 warm-up steps.)
    assert "resume: --lr 0.01 overrides the checkpoint's 0.002" in proc.stdout
    assert "resume: --max-steps 6 overrides the checkpoint's 4" in proc.stdout
    records = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    lrs = [r["lr"] for r in records if "loss" in r]
    # LambdaLR multiplies: lr * min(1, (step + 1) / warmup) after each step.
    assert lrs[:4] == [0.002 * min(1.0, s / 5) for s in (2, 3, 4, 5)]
    assert lrs[4:] == [0.01, 0.01]
    manifest = json.loads((out / CHECKPOINTS / "step-00000006" / "manifest.json").read_text())
    assert manifest["extra"]["recipe"]["optim"]["lr"] == 0.01


def _lines(out: Path) -> list[str]:
    return (out / METRICS).read_text().splitlines(keepends=True)


@pytest.mark.e2e
def test_resuming_an_earlier_checkpoint_in_place_that_trains_nothing_changes_no_metric(
        four_steps, tmp_path):
    """Resume step 2 of a 4-step run in its own directory, with nothing to train
    (--max-steps 2): metrics.jsonl is as it was, byte for byte (the lines of steps 3-4 are
    replaced only when those steps are trained again)."""
    out = Path(shutil.copytree(four_steps, tmp_path / "out"))
    before = (out / METRICS).read_bytes()
    proc = run_module("neox.finetune", "--resume", out / CHECKPOINTS / "step-00000002",
                      "--output-dir", out, "--max-steps", 2)
    assert proc.returncode == 0, proc.stderr
    assert "training 0 steps" in proc.stdout
    assert (out / METRICS).read_bytes() == before


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_an_interrupted_resume_in_place_loses_no_metric_line(four_steps, tmp_path, sig):
    """The issue's sequence: resume step 2 in the run's own directory and stop it as it
    starts to train; then resume the newest checkpoint (step 4, of the first pass): every step
    once, and the lines of steps 1, 2 and 4 as the first pass wrote them, byte for byte (step
    3's too unless the stop came after it was trained again)."""
    out = Path(shutil.copytree(four_steps, tmp_path / "out"))
    before = _lines(out)
    proc, mark = start_marked("--resume", out / CHECKPOINTS / "step-00000002", "--output-dir",
                              out)
    try:
        for line in proc.stdout:  # rank 0's lines, flushed as printed
            if line.startswith("training 2 steps"):
                proc.send_signal(sig)
                break
        else:
            raise AssertionError(f"the resumed run did not start training: {proc.communicate()}")
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert left_after(mark, ORPHAN_DEADLINE_S) == []
    after = _lines(out)
    assert metric_steps(out) == [1, 2, 3, 4]
    assert after[:2] == before[:2] and after[3] == before[3]
    proc = run_module("neox.finetune", "--resume", out / CHECKPOINTS, "--output-dir", out,
                      "--max-steps", 6)
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {out / CHECKPOINTS / 'step-00000004'}" in proc.stdout
    final = _lines(out)
    assert metric_steps(out) == [1, 2, 3, 4, 5, 6]
    assert final[:2] == before[:2] and final[2] == after[2] and final[3] == before[3]


@pytest.mark.e2e
@pytest.mark.parametrize("flags, phrase", [
    (["--finetune", "lora"], "--finetune lora differs from the checkpoint's full"),
    (["--seed", "9"], "--seed 9 differs from the checkpoint's 1"),
    (["--seq-len", "32"], "--seq-len 32 differs from the checkpoint's 16"),
])
def test_resume_refuses_flags_that_change_what_is_trained(capsys, four_steps, flags, phrase):
    proc = _call_main(capsys, "--resume", four_steps / CHECKPOINTS, *flags)
    assert proc.returncode == 2 and phrase in proc.stderr, proc.stderr


def _load_fault_injection():
    spec = importlib.util.spec_from_file_location("fault_injection",
                                                  REPO / "bench" / "fault_injection.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_a_kill_then_resume_keeps_every_step_once_and_is_bitwise_exact(cache, four_steps,
                                                                      tmp_path):
    # The fault-injection benchmark's own trial, with one kill (bench/fault_injection.py runs
    # many and reports the figures in bench/RESULTS.md), against the uninterrupted run of the
    # same settings that the fixture made.
    faults = _load_fault_injection()
    report = faults.run_trials(tmp_path, kills=1, steps=4, cache=cache, seed=1,
                               reference=four_steps)
    assert report.kills == 1 and report.resumed_from_complete == 1
    assert report.duplicate_metric_lines == 0
    assert report.exact_continuations == 1, report


# -- full disks and unwritable paths --------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs, or a skip where mounting is not allowed (not root, a container without
    CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path, leave: int) -> None:
    """Fills ``disk`` until ``leave`` bytes are free."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


@pytest.mark.e2e
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(
        cache, four_steps, small_disk):
    import zerocore
    out = Path(shutil.copytree(four_steps, small_disk / "out"))
    _fill(small_disk, leave=16 * 1024)  # room for metrics lines, not for a checkpoint
    proc = run_module("neox.finetune", "--resume", out / CHECKPOINTS, "--output-dir", out,
                      "--max-steps", 6, "--save-every", 1)
    assert_clean_error(proc, "No space left on device")
    assert "[Errno 28]" in proc.stderr and str(out / CHECKPOINTS) in proc.stderr
    left = [p.name for p in (out / CHECKPOINTS).iterdir()]
    assert not [n for n in left if ".tmp" in n or ".deleting" in n], left
    # The last good checkpoint is still whole: fully verified (manifest, commit, rank files).
    latest = zerocore.latest_checkpoint(out / CHECKPOINTS)
    assert latest.name == "step-00000004"
    zerocore.open_checkpoint(latest)


@pytest.mark.e2e
def test_a_completely_full_disk_is_found_before_the_run_starts(four_steps, small_disk,
                                                               capsys):
    out = Path(shutil.copytree(four_steps, small_disk / "out"))
    _fill(small_disk, leave=0)
    proc = _call_main(capsys, "--resume", out / CHECKPOINTS, "--output-dir", out,
                      "--max-steps", 6)
    assert_clean_error(proc, f"--output-dir {out}: cannot write {out}")
    assert "[Errno 28] No space left on device" in proc.stderr
    assert "corpus:" not in proc.stdout and "tokenizer:" not in proc.stdout


@pytest.mark.e2e
def test_an_unwritable_result_file_is_one_line(cache, tmp_path):
    out = tmp_path / "out"
    (out / "trainable.safetensors").mkdir(parents=True)  # a directory where the file goes
    (out / "trainable.safetensors" / "x").write_text("")
    proc = finetune(cache, out, "--max-steps", 2)
    assert_clean_error(proc, f"cannot write {out / 'trainable.safetensors'}")
    assert "[Errno" in proc.stderr


# -- a manifest edited by hand --------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_checkpoint(cache, tmp_path_factory) -> Path:
    """A 2-rank LoRA checkpoint: layers with several trainable slots, two rank files."""
    out = tmp_path_factory.mktemp("lora") / "out"
    proc = finetune(cache, out, "--nproc", 2, "--finetune", "lora", "--filter-layers", "0,2",
                    "--max-steps", 2)
    assert proc.returncode == 0, proc.stderr
    return out / CHECKPOINTS / "step-00000002"


def _first_trainable(m: dict) -> dict:
    return next(layer["trainable"] for layer in m["layers"] if layer["trainable"] is not None)


def _swap_slots(m: dict) -> None:
    slots = _first_trainable(m)["slots"]
    slots[0][2], slots[1][2] = slots[1][2], slots[0][2]


def _unpicklable_rank_file(ckpt: Path, m: dict) -> None:
    import hashlib
    data = b"\x80\x05not a pickle at all"
    (ckpt / "rank-00001.pt").write_bytes(data)
    m["files"]["rank-00001.pt"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                   "bytes": len(data)}


MANIFEST_EDITS = {
    "world_size 2 -> 1": lambda ckpt, m: m.update(world_size=1),
    "world_size 0": lambda ckpt, m: m.update(world_size=0),
    "world_size -1": lambda ckpt, m: m.update(world_size=-1),
    "world_size 3": lambda ckpt, m: m.update(world_size=3),
    "an offset moved": lambda ckpt, m: _first_trainable(m)["slots"][1].__setitem__(2, 64),
    "two slots swapped": lambda ckpt, m: _swap_slots(m),
    "no layers": lambda ckpt, m: m.pop("layers"),
    "a string for a number": lambda ckpt, m: m.update(step="two"),
    "padded_numel changed": lambda ckpt, m: _first_trainable(m).update(padded_numel=4096),
    "extra.step removed": lambda ckpt, m: m["extra"].pop("step"),
    "a rank file that does not unpickle": _unpicklable_rank_file,
}


def _edited(src: Path, dst: Path, edit, *, recommit: bool) -> Path:
    from zerocore.checkpoint.manifest import COMMIT, MANIFEST, commit_record
    ckpt = Path(shutil.copytree(src, dst))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    edit(ckpt, manifest)
    data = json.dumps(manifest, indent=1).encode()
    (ckpt / MANIFEST).write_bytes(data)
    if recommit:  # as a careful forger would: the schema checks must catch it, not the checksum
        (ckpt / COMMIT).write_bytes(commit_record(data))
    return ckpt


def _one_line(code: int, err: str) -> str:
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.e2e
@pytest.mark.parametrize("edit", [e for e in MANIFEST_EDITS if e != "extra.step removed"])
def test_an_edited_manifest_is_refused_by_export_and_consolidate(lora_checkpoint, tmp_path,
                                                                 capsys, edit):
    from neox import export
    from zerocore import consolidate
    for recommit in (False, True):
        ckpt = _edited(lora_checkpoint, tmp_path / f"ckpt-{recommit}", MANIFEST_EDITS[edit],
                       recommit=recommit)
        for tool, out in ((export.main, "exported"), (consolidate.main, "consolidated")):
            code = tool([str(ckpt), str(tmp_path / f"{out}-{recommit}")])
            _, err = capsys.readouterr()
            line = _one_line(code, err)
            assert str(ckpt) in line, line
            assert not (tmp_path / f"{out}-{recommit}").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_an_edited_manifest_is_refused_on_resume(lora_checkpoint, tmp_path, capfd, edit):
    # (extra.step is neox's own state: export and consolidate do not need it; a resume does.)
    ckpt = _edited(lora_checkpoint, tmp_path / "checkpoints" / lora_checkpoint.name,
                   MANIFEST_EDITS[edit], recommit=True)
    # capfd: what the ranks this may start print reaches the test too.
    proc = _call_main(capfd, "--resume", ckpt, "--output-dir", tmp_path / "out",
                      "--max-steps", 4)
    line = _one_line(proc.returncode, proc.stderr)
    assert str(ckpt) in line, line
    assert not (tmp_path / "out" / CHECKPOINTS).exists()  # nothing saved over anything
