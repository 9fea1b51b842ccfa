"""Fault injection: SIGKILL a fine-tuning run at random moments and resume it, and count what
survived; then signal the launcher during start-up and stop a rank, and time how each run ends.

    python bench/fault_injection.py --kills 20 --repeats 3   # figures for bench/RESULTS.md

Every process of a run is found by an environment variable this script gives the launcher
(``NEOX_FAULT_RUN=<random id>``), read from ``/proc/PID/environ``: every descendant inherits
it, whatever becomes of its parent (a rank whose launcher died is another process's child).
The ranks are those of them whose parent is the launcher.

Kill trials (``--kills``): each starts a small run (the tiny preset, 2 gloo ranks, a checkpoint
after every step), SIGKILLs its launcher once the run has logged a random number of steps (so
the kill lands anywhere: in a step, in a save, between them), checks that no process of the
run outlives it, resumes from the checkpoint folder and lets the run finish. Against one
uninterrupted reference run it reports:

- kills: launchers killed while training;
- resumed_from_complete: resumes that started from a complete, verified checkpoint;
- duplicate_metric_lines: steps that appear more than once in metrics.jsonl at the end;
- exact_continuations: finished runs whose every logged loss equals the reference's bit for
  bit (fp32 on the CPU: a resumed run must be indistinguishable from one never interrupted);
- orphans: processes of the run still alive 2 s after their launcher was killed.
Target: kills = resumed_from_complete = exact_continuations = N, duplicates = orphans = 0.

Ending scenarios (``--repeats`` runs of each; 0: none). For each run: the seconds from the
fault until no process of the run is alive, how many were alive 2 s after it (issue 20's
bound: none), the launcher's exit code and its last error line (or last line) on stderr:

- the launcher SIGKILLed or SIGTERMed 0.2, 1 and 5 s after it started (2 ranks: importing
  torch itself, then its ranks starting, importing and joining), and with 16 ranks
  (``--nproc 16 --oversubscribe``) as soon as all exist and 5 s after the start;
- rank 1 SIGSTOPed in training (2 and 4 ranks, ``--timeout 5``): also the seconds until the
  launcher exited (issue 20's bound: --timeout + 5 s);
- rank 1 SIGKILLed in training (2 and 4 ranks): also the seconds until the launcher exited
  (the same bound), whose error line must name the rank and its signal (``rank 1 (pid N) was
  killed by SIGKILL``);
- SIGINT to the run's whole process group in training (2 and 4 ranks), as a terminal's Ctrl-C
  sends it (``os.killpg``; the run is started in a session of its own, with SIGINT's default
  disposition): the ranks ignore it and leave when the launcher stops them, silently, so the
  launcher's ``stopped by SIGINT`` must be the only line on stderr (issue 33: the ranks'
  "exiting" lines interleaved);
- ``examples/finetune_hf_trainer.py`` (2 processes, started by it) SIGKILLed once its ranks
  train (its OUT/base saved): its ranks must go with it (issue 33: they lived 8 s).

Every ending also counts the non-empty lines on stderr.

Issue 33's new surfaces (``--repeats`` rounds too), on a finished 4-step run with checkpoints at
steps 2 and 4 (each trial on a copy of it):

- a resume in place (``--resume RUN/checkpoints/step-00000002 --output-dir RUN``) SIGINTed or
  SIGKILLed before it retrains (1 s after its start, at its "resumed from" line, at its
  "training 2 steps" line): metrics.jsonl and the checkpoints byte for byte as before, no
  process left 2 s after the signal; then the newest checkpoint (step 4) resumed to step 6:
  every step once, the first pass's lines of steps 1-4 unchanged;
- ``neox.export SOURCE OUT --overwrite`` onto its own input (RUN RUN, CKPT CKPT, an output
  inside the checkpoint, a checkpoint inside the output), with and without
  ``--trainable-only``: refused with exit 2 and one line, every file of the run as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

# tests/test_neox_faults.py loads this file by its path, with bench/ not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXCERPT = REPO / "tests" / "data" / "shakespeare_excerpt.txt"
# Seconds a process of the run may outlive its launcher (issue 20's bound).
ORPHAN_DEADLINE_S = 2.0
# The variable that marks every process of one run (see the module docstring).
RUN_MARK = "NEOX_FAULT_RUN"
# The stopped-rank scenarios' --timeout, and issue 20's bound on the launcher's exit after it.
STOP_TIMEOUT_S = 5.0
STOP_BOUND_S = STOP_TIMEOUT_S + 5.0


@dataclasses.dataclass
class Report:
    trials: int = 0
    kills: int = 0
    resumed_from_complete: int = 0
    duplicate_metric_lines: int = 0
    exact_continuations: int = 0
    orphans: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def _env(mark: str | None = None) -> dict[str, str]:
    return harness.child_env(**({RUN_MARK: mark} if mark else {}))


def _finetune(*args) -> list[str]:
    return [sys.executable, "-m", "neox.finetune", *map(str, args)]


def _run_args(out: Path, cache: Path, steps: int, seed: int) -> list:
    return ["--cpu", "--nproc", 2, "--data", EXCERPT, "--cache-dir", cache, "--seq-len", 16,
            "--batch-size", 2, "--seed", seed, "--max-steps", steps, "--save-every", 1,
            "--keep-last", 2, "--output-dir", out]


def _losses(out: Path) -> dict[int, list[float]]:
    """Every logged loss by step (a list, so that duplicates show)."""
    found: dict[int, list[float]] = {}
    path = out / "metrics.jsonl"
    if not path.is_file():
        return found
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            found.setdefault(record["step"], []).append(record["loss"])
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None once it is gone. The fields after the command
    (which may hold spaces) start after its last ')'."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def run_processes(mark: str) -> list[int]:
    """The live processes (zombies have exited) whose environment has ``RUN_MARK=mark``."""
    found, needle = [], f"{RUN_MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        stat = _stat(int(entry.name))
        if needle in environ.split(b"\0") and stat is not None and stat[0] != "Z":
            found.append(int(entry.name))
    return found


def rank_pids(mark: str, launcher: int) -> list[int]:
    """The ranks of run ``mark``: its processes whose parent is the launcher."""
    return sorted(p for p in run_processes(mark) if (_stat(p) or ("", 0))[1] == launcher)


def _time_until_gone(mark: str, since: float, limit: float = 120.0) -> tuple[float, int]:
    """Seconds from ``since`` until no process of run ``mark`` is alive (inf past ``limit``),
    and how many were alive ORPHAN_DEADLINE_S after ``since``."""
    at_deadline = None
    while True:
        now = time.monotonic()
        left = run_processes(mark)
        if at_deadline is None and now >= since + ORPHAN_DEADLINE_S:
            at_deadline = len(left)
        if not left:
            return now - since, at_deadline or 0
        if now > since + limit:
            return math.inf, at_deadline or 0
        time.sleep(0.01)


def _kill_all(mark: str) -> None:
    """SIGKILLs what is left of a run (so that a failed trial does not disturb the next)."""
    for pid in run_processes(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _complete(checkpoint: Path) -> bool:
    """Whether a checkpoint verifies (manifest, commit record, every rank file's checksum)."""
    from zerocore.checkpoint import CheckpointError, read_manifest, verify_files
    try:
        verify_files(checkpoint, read_manifest(checkpoint))
        return True
    except CheckpointError:
        return False


def run_trials(workdir: Path, *, kills: int, steps: int = 60, cache: Path | None = None,
               seed: int = 0, reference: Path | None = None, log=lambda *a: None) -> Report:
    """``kills`` trials of one SIGKILL each (see the module docstring). ``reference``: the
    output directory of an uninterrupted run of the same settings (``_run_args``; how often it
    saved does not matter), else one is made."""
    rng = random.Random(seed)
    cache = cache or workdir / "cache"
    report = Report()
    if reference is None:
        reference = workdir / "reference"
        done = subprocess.run(_finetune(*_run_args(reference, cache, steps, seed)), env=_env(),
                              cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the reference run failed:\n{done.stderr}")
    want = {step: values[0] for step, values in _losses(reference).items()}
    if sorted(want) != list(range(1, steps + 1)):
        raise ValueError(f"the reference run {reference} did not log steps 1..{steps}")
    for trial in range(kills):
        out = workdir / f"trial-{trial}"
        report.trials += 1
        # From step 2 on: step 1's checkpoint is committed before step 2 is logged, so a
        # resume always has something to start from.
        target = rng.randint(2, steps - 1)
        mark = uuid.uuid4().hex
        launcher = subprocess.Popen(_finetune(*_run_args(out, cache, steps, seed)),
                                    env=_env(mark), cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        while launcher.poll() is None and len(_losses(out)) < target:
            time.sleep(0.002)
        if launcher.poll() is not None:
            report.notes.append(f"trial {trial}: the run ended before the kill")
            continue
        launcher.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait()
        report.kills += 1
        report.orphans += _time_until_gone(mark, killed)[1]
        _kill_all(mark)
        logged = len(_losses(out))
        # What the resume should pick, verified now: the resumed run prunes old checkpoints.
        from zerocore.checkpoint import latest_checkpoint
        newest = latest_checkpoint(out / "checkpoints")
        newest_complete = newest is not None and _complete(newest)
        resume = subprocess.run(
            _finetune("--resume", out / "checkpoints", "--output-dir", out), env=_env(),
            cwd=REPO, capture_output=True, text=True)
        match = re.search(r"resumed from (\S+) at step (\d+)", resume.stdout)
        if resume.returncode != 0 or match is None:
            report.notes.append(f"trial {trial}: resume failed (exit {resume.returncode}): "
                                f"{resume.stderr.strip().splitlines()[-1:]}")
            continue
        if newest_complete and Path(match.group(1)) == newest:
            report.resumed_from_complete += 1
        got = _losses(out)
        report.duplicate_metric_lines += sum(len(v) - 1 for v in got.values())
        exact = sorted(got) == sorted(want) and all(got[s][0] == want[s] for s in want)
        report.exact_continuations += exact
        log(f"trial {trial}: killed after {logged} logged steps (target {target}), resumed "
            f"from step {match.group(2)}, {'exact' if exact else 'NOT exact'}")
    return report


# -- how a run ends ----------------------------------------------------------------------------

@dataclasses.dataclass
class Ending:
    """How one run ended after one fault."""
    scenario: str
    nproc: int
    gone_s: float            # from the fault until no process of the run was alive
    left_at_2s: int          # processes of the run alive ORPHAN_DEADLINE_S after the fault
    exit_code: int | None    # the launcher's (negative: killed by that signal)
    message: str             # its last error line on stderr (else its last line)
    processes: int = 0       # processes of the run (the launcher included) at the fault
    exit_s: float | None = None  # a rank's fault: from it until the launcher exited
    stderr_lines: int = 0    # non-empty lines on stderr, every process of the run's together


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _message(stderr: str) -> str:
    lines = _lines(stderr)
    errors = [line for line in lines if line.startswith("error")]
    return (errors or lines or [""])[-1][:300]


def _as_from_a_terminal() -> None:
    """In the child before it runs: a session (and process group) of its own, as a shell
    gives a command, so that ``os.killpg`` reaches the run and not this script; and SIGINT's
    default disposition (this script may have been started with it ignored, and children
    inherit that)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(out: Path, cache: Path, nproc: int, *more) -> tuple[subprocess.Popen, str]:
    mark = uuid.uuid4().hex
    argv = ["--cpu", "--data", EXCERPT, "--cache-dir", cache, "--seq-len", 16, "--batch-size",
            2, "--seed", 1, "--epochs", 50, "--output-dir", out, *more]  # never ends by itself
    if nproc != 2:
        argv += ["--nproc", nproc, "--oversubscribe"]
    return subprocess.Popen(_finetune(*argv), env=_env(mark), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal), mark


def _signal(launcher: subprocess.Popen, mark: str, sig: int, name: str,
            ) -> tuple[float, int, str]:
    """Sends ``sig`` to the launcher of run ``mark``: the seconds until no process of the run
    was left, how many were alive 2 s after the signal, and the launcher's stderr."""
    if launcher.poll() is not None:
        raise RuntimeError(f"{name}: the run ended first: {launcher.communicate()[1]}")
    os.kill(launcher.pid, sig)
    gone, left = _time_until_gone(mark, time.monotonic())
    # (communicate: the pipes stay open until the last process holding them is gone)
    _, stderr = launcher.communicate(timeout=300)
    return gone, left, stderr


def signal_during_start_up(workdir: Path, cache: Path, sig: int, moment: float | str,
                           nproc: int) -> Ending:
    """Signals the launcher ``moment`` seconds after it started, or ("spawned") as soon as all
    its ranks exist, and times how the run ends."""
    name = f"launcher {signal.Signals(sig).name} " + (
        "once every rank exists" if moment == "spawned" else f"{moment:g} s after its start")
    launcher, mark = _start(workdir / uuid.uuid4().hex, cache, nproc)
    try:
        started = time.monotonic()
        if moment == "spawned":
            while len(rank_pids(mark, launcher.pid)) < nproc and launcher.poll() is None:
                time.sleep(0.005)
        else:
            time.sleep(max(0.0, started + moment - time.monotonic()))
        processes = len(run_processes(mark))
        gone, left, stderr = _signal(launcher, mark, sig, name)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill_all(mark)
    return Ending(name, nproc, gone, left, launcher.returncode, _message(stderr), processes,
                  stderr_lines=len(_lines(stderr)))


def _fault_in_training(workdir: Path, cache: Path, nproc: int, name: str,
                       fault, *more) -> Ending:
    """Once the run has logged 2 steps, ``fault(launcher, mark)`` (the fault itself, sent at
    once); times until the launcher exits and until no process of the run is left."""
    out = workdir / uuid.uuid4().hex
    launcher, mark = _start(out, cache, nproc, *more)
    try:
        while len(_losses(out)) < 2:
            if launcher.poll() is not None:
                raise RuntimeError(f"{name}: the run ended first: {launcher.communicate()[1]}")
            time.sleep(0.01)
        processes = len(run_processes(mark))
        fault(launcher, mark)
        faulted = time.monotonic()
        _, stderr = launcher.communicate(timeout=300)
        exited = time.monotonic() - faulted
        gone, left = _time_until_gone(mark, faulted)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill_all(mark)
    return Ending(name, nproc, gone, left, launcher.returncode, _message(stderr), processes,
                  exited, len(_lines(stderr)))


def _signal_rank_1(sig: int):
    return lambda launcher, mark: os.kill(rank_pids(mark, launcher.pid)[1], sig)


def stop_a_rank(workdir: Path, cache: Path, nproc: int) -> Ending:
    """SIGSTOPs rank 1 in training (``--timeout STOP_TIMEOUT_S``)."""
    return _fault_in_training(workdir, cache, nproc,
                              f"rank 1 SIGSTOPed in training, --timeout {STOP_TIMEOUT_S:g}",
                              _signal_rank_1(signal.SIGSTOP), "--timeout", STOP_TIMEOUT_S)


def kill_a_rank(workdir: Path, cache: Path, nproc: int) -> Ending:
    """SIGKILLs rank 1 in training."""
    return _fault_in_training(workdir, cache, nproc, "rank 1 SIGKILLed in training",
                              _signal_rank_1(signal.SIGKILL))


def interrupt_the_group(workdir: Path, cache: Path, nproc: int) -> Ending:
    """SIGINT to the run's process group in training, as Ctrl-C on a terminal."""
    return _fault_in_training(workdir, cache, nproc,
                              "SIGINT to the process group in training (Ctrl-C)",
                              lambda launcher, mark: os.killpg(launcher.pid, signal.SIGINT))


TRAINER_EXAMPLE = REPO / "examples" / "finetune_hf_trainer.py"


def kill_the_trainer_example(workdir: Path, cache: Path) -> Ending:
    """SIGKILLs examples/finetune_hf_trainer.py once its 2 ranks train (rank 0 has saved
    OUT/base, which it does once the process group exists), and times until none is left."""
    out, mark = workdir / uuid.uuid4().hex, uuid.uuid4().hex
    main = subprocess.Popen([sys.executable, str(TRAINER_EXAMPLE), "--steps", "1000", "--out",
                             str(out)], env=_env(mark) | {"PYTHONWARNINGS": "ignore"},
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_as_from_a_terminal)
    name = "examples/finetune_hf_trainer.py SIGKILLed in training"
    try:
        while not (out / "base" / "config.json").is_file():
            if main.poll() is not None:
                raise RuntimeError(f"{name}: the example ended first: {main.communicate()[1]}")
            time.sleep(0.05)
        processes = len(run_processes(mark))
        gone, left, stderr = _signal(main, mark, signal.SIGKILL, name)
    finally:
        if main.poll() is None:
            main.kill()
        _kill_all(mark)
    return Ending(name, 2, gone, left, main.returncode, _message(stderr), processes,
                  stderr_lines=len(_lines(stderr)))


def _as_promised(e: Ending) -> bool:
    """What a scenario's ending must say: a killed rank named with its signal; Ctrl-C one
    line, the launcher's."""
    if e.scenario == "rank 1 SIGKILLed in training":
        return re.match(r"error: rank 1 \(pid \d+\) was killed by SIGKILL", e.message) is not None
    if e.scenario.startswith("SIGINT to the process group"):
        return e.stderr_lines == 1 and e.message == "stopped by SIGINT" and e.exit_code == 130
    return True


def endings(workdir: Path, repeats: int, log=lambda *a: None) -> list[Ending]:
    """Every ending scenario of the module docstring, ``repeats`` rounds of them all."""
    cache = workdir / "cache"
    plans = [(signal_during_start_up, (sig, moment, 2))
             for sig in (signal.SIGKILL, signal.SIGTERM) for moment in (0.2, 1.0, 5.0)]
    plans += [(signal_during_start_up, (sig, moment, 16))
              for sig in (signal.SIGKILL, signal.SIGTERM) for moment in ("spawned", 5.0)]
    plans += [(fn, (nproc,)) for fn in (stop_a_rank, kill_a_rank, interrupt_the_group)
              for nproc in (2, 4)]
    plans += [(kill_the_trainer_example, ())]
    found = []
    for _ in range(repeats):
        for fn, plan in plans:
            ending = fn(workdir, cache, *plan)
            log(json.dumps(dataclasses.asdict(ending)))
            found.append(ending)
    return found


# -- issue 33's new surfaces: a resume in place interrupted, an export onto its input --------

# Steps long enough (about 0.1 s each on 2 cores) that a signal sent at the "training" line
# lands before the resumed run has retrained its first step.
IN_PLACE = ["--cpu", "--nproc", 2, "--data", EXCERPT, "--seq-len", 64, "--batch-size", 8,
            "--seed", 1]
EARLIER = "step-00000002"
NEWEST = "step-00000004"
# What a trial finds in metrics.jsonl after the stop: as it was; or, where the signal came after
# the resumed run had retrained step 3 (then not a stop "before it retrains"), that line
# replaced by its new one (the same losses, another tokens/s) and the others as they were.
UNCHANGED = "byte for byte"
RETRAINED_FIRST = "step 3 retrained first; the other lines byte for byte"
# What resuming the newest checkpoint (step 4) to step 6 after the stop must give.
KEPT = "every step once, 1-4 kept"


def in_place_run(workdir: Path, cache: Path) -> Path:
    """The issue's run: 4 steps, checkpoints at steps 2 and 4."""
    out = workdir / "in-place-run"
    done = subprocess.run(_finetune(*IN_PLACE, "--cache-dir", cache, "--max-steps", 4,
                                    "--save-every", 2, "--output-dir", out),
                          env=_env(), cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the 4-step run failed:\n{done.stderr}")
    return out


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root``: its path below it, and the SHA-256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _metric_lines(out: Path) -> list[str]:
    return (out / "metrics.jsonl").read_text().splitlines(keepends=True)


@dataclasses.dataclass
class InPlace:
    """One resume in place stopped before it retrained, and the resume of the newest after."""
    scenario: str
    gone_s: float            # from the signal until no process of the run was alive
    left_at_2s: int
    exit_code: int | None
    message: str
    metrics: str             # "byte for byte", or how metrics.jsonl changed
    checkpoints_intact: bool  # every file under checkpoints/ byte for byte as before
    newest: str              # the resume of step 4 to step 6: "every step once, 1-4 kept", or not


def resume_in_place(workdir: Path, run: Path, sig: int, moment: str) -> InPlace:
    """Resumes step 2 of (a copy of) ``run`` in its own directory, sends ``sig`` at ``moment``
    ("1 s", or the first line starting with "resumed from" or "training"), checks what is left,
    then resumes the newest checkpoint to step 6."""
    out = Path(shutil.copytree(run, workdir / uuid.uuid4().hex))
    lines, checkpoints = _metric_lines(out), _snapshot(out / "checkpoints")
    mark = uuid.uuid4().hex
    name = f"{signal.Signals(sig).name} " + ("1 s after its start" if moment == "1 s" else
                                            f"at its {moment!r} line")
    # SIGINT as Ctrl-C on a terminal delivers it (to the command alone: its ranks do not exist
    # yet at the earliest moment, and ignore it later).
    proc = subprocess.Popen(_finetune("--resume", out / "checkpoints" / EARLIER, "--output-dir",
                                      out), env=_env(mark), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal)
    try:
        if moment == "1 s":
            time.sleep(1.0)
        else:
            for line in proc.stdout:  # rank 0's lines, flushed as printed
                if line.startswith(moment):
                    break
        gone, left, stderr = _signal(proc, mark, sig, name)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(mark)
    after = _metric_lines(out)
    if after == lines:
        metrics = UNCHANGED
    elif len(after) == len(lines) and after[:2] == lines[:2] and after[3:] == lines[3:]:
        metrics = RETRAINED_FIRST
    else:
        metrics = f"CHANGED: {len(lines)} lines before, {len(after)} after"
    intact = _snapshot(out / "checkpoints") == checkpoints
    newest = subprocess.run(_finetune("--resume", out / "checkpoints", "--output-dir", out,
                                      "--max-steps", 6), env=_env(), cwd=REPO,
                            capture_output=True, text=True)
    final = _metric_lines(out)
    steps = [json.loads(line)["step"] for line in final]
    if newest.returncode != 0:
        then = f"FAILED (exit {newest.returncode}): {_message(newest.stderr)}"
    elif f"resumed from {out / 'checkpoints' / NEWEST}" not in newest.stdout:
        then = "NOT resumed from step 4"
    elif steps != [1, 2, 3, 4, 5, 6] or final[:2] != lines[:2] or final[3] != lines[3] \
            or len(after) < 3 or final[2] != after[2]:
        then = f"LOST OR CHANGED lines: steps {steps}"
    else:
        then = KEPT
    return InPlace(name, gone, left, proc.returncode, _message(stderr).replace(str(out), "RUN"),
                   metrics, intact, then)


@dataclasses.dataclass
class ExportTry:
    """One ``neox.export SOURCE OUT --overwrite`` onto its own input."""
    scenario: str
    exit_code: int
    stderr_lines: int
    message: str
    intact: bool             # every file of the run byte for byte as before


EXPORTS_ONTO_INPUT = {  # scenario: (SOURCE, OUT) below the run's directory
    "RUN RUN": (".", "."), "CKPT CKPT": (f"checkpoints/{NEWEST}", f"checkpoints/{NEWEST}"),
    "RUN CKPT/export": (".", f"checkpoints/{NEWEST}/export"),
    "CKPT RUN": (f"checkpoints/{NEWEST}", ".")}


def export_onto_input(workdir: Path, run: Path, scenario: str, trainable_only: bool,
                      ) -> ExportTry:
    out = Path(shutil.copytree(run, workdir / uuid.uuid4().hex))
    source, target = EXPORTS_ONTO_INPUT[scenario]
    before = _snapshot(out)
    proc = subprocess.run([sys.executable, "-m", "neox.export", out / source, out / target,
                           "--overwrite", *(["--trainable-only"] if trainable_only else [])],
                          env=_env(), cwd=REPO, capture_output=True, text=True)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    name = scenario + (" --trainable-only" if trainable_only else "")
    return ExportTry(f"neox.export {name} --overwrite", proc.returncode, len(lines),
                     _message(proc.stderr).replace(str(out), "RUN"), _snapshot(out) == before)


def new_surfaces(workdir: Path, repeats: int, log=lambda *a: None,
                 ) -> tuple[list[InPlace], list[ExportTry]]:
    """Issue 33's scenarios of the module docstring, ``repeats`` rounds of them all."""
    run = in_place_run(workdir, workdir / "cache")
    stops, exports = [], []
    for _ in range(repeats):
        for sig in (signal.SIGINT, signal.SIGKILL):
            for moment in ("1 s", "resumed from", "training"):
                stops.append(resume_in_place(workdir, run, sig, moment))
                log(json.dumps(dataclasses.asdict(stops[-1])))
        for scenario in EXPORTS_ONTO_INPUT:
            for trainable_only in (False, True):
                exports.append(export_onto_input(workdir, run, scenario, trainable_only))
                log(json.dumps(dataclasses.asdict(exports[-1])))
    return stops, exports


def _grouped(found: list, key) -> dict:
    by: dict = {}
    for e in found:
        by.setdefault(key(e), []).append(e)
    return by


def in_place_table(found: list[InPlace]) -> str:
    rows = ["| resume of step 2 in place, stopped | runs | until no process left, s: median / "
            "max | left at 2 s (max) | exit codes | message | metrics.jsonl | checkpoints "
            "intact | then step 4 resumed to 6 |", "|---|---:|---:|---:|---|---|---|---|---|"]
    for scenario, group in _grouped(found, lambda e: e.scenario).items():
        gone = sorted(e.gone_s for e in group)
        rows.append(f"| {scenario} | {len(group)} | {gone[len(gone) // 2]:.2f} / {gone[-1]:.2f} "
                    f"| {max(e.left_at_2s for e in group)} | "
                    f"{', '.join(sorted({str(e.exit_code) for e in group}))} | "
                    + " / ".join(f"`{m}`" if m else "(none)"
                                 for m in sorted({e.message for e in group})) + " | "
                    f"{'; '.join(sorted({e.metrics for e in group}))} | "
                    f"{sum(e.checkpoints_intact for e in group)} of {len(group)} | "
                    f"{'; '.join(sorted({e.newest for e in group}))} |")
    return "\n".join(rows)


def export_table(found: list[ExportTry]) -> str:
    rows = ["| export onto its input | runs | exit codes | stderr lines | every file intact "
            "| message |", "|---|---:|---|---:|---|---|"]
    for scenario, group in _grouped(found, lambda e: e.scenario).items():
        said = sorted({e.message for e in group})
        rows.append(f"| `{scenario}` | {len(group)} | "
                    f"{', '.join(sorted({str(e.exit_code) for e in group}))} | "
                    f"{max(e.stderr_lines for e in group)} | "
                    f"{sum(e.intact for e in group)} of {len(group)} | "
                    + " / ".join(f"`{m}`" for m in said) + " |")
    return "\n".join(rows)


def table(found: list[Ending]) -> str:
    """Markdown: one row per scenario over its runs (the median and the worst)."""
    rows = ["| fault | ranks | runs | processes at the fault (min-max) | until no process "
            "left, s: median / max | left at 2 s (max) | launcher exit after the rank's fault, "
            "s: max | exit codes | stderr lines (max) | message |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    by: dict[tuple[str, int], list[Ending]] = {}
    for e in found:
        by.setdefault((e.scenario, e.nproc), []).append(e)
    for (scenario, nproc), group in by.items():
        gone = sorted(e.gone_s for e in group)
        exits = [e.exit_s for e in group if e.exit_s is not None]
        codes = ", ".join(sorted({str(e.exit_code) for e in group}))
        said = sorted({re.sub(r"pid \d+", "pid N", e.message) for e in group})
        counts = sorted(e.processes for e in group)
        rows.append(f"| {scenario} | {nproc} | {len(group)} | {counts[0]}-{counts[-1]} | "
                    f"{gone[len(gone) // 2]:.2f} / "
                    f"{gone[-1]:.2f} | {max(e.left_at_2s for e in group)} | "
                    f"{f'{max(exits):.2f}' if exits else '-'} | {codes} | "
                    f"{max(e.stderr_lines for e in group)} | "
                    + " / ".join(f"`{m}`" if m else "(none)" for m in said) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="kill trials, one SIGKILL each")
    p.add_argument("--steps", type=int, default=60, help="steps of each kill trial's run")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill points and the runs")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each ending scenario (0: none)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = (run_trials(Path(tmp), kills=args.kills, steps=args.steps, seed=args.seed,
                             log=print) if args.kills else Report())
        trials_s = time.perf_counter() - start
        found = endings(Path(tmp), args.repeats, log=print)
        endings_s = time.perf_counter() - start - trials_s
        stops, exports = (new_surfaces(Path(tmp), args.repeats, log=print) if args.repeats
                          else ([], []))
    print(json.dumps(dataclasses.asdict(report), indent=1))
    print(f"kill trials {trials_s:.0f} s, endings {endings_s:.0f} s, all "
          f"{time.perf_counter() - start:.0f} s")
    if found:
        print(table(found))
    if stops:
        print(in_place_table(stops))
        print(export_table(exports))
    ok = (report.kills == report.resumed_from_complete == report.exact_continuations
          and report.duplicate_metric_lines == 0 and report.orphans == 0
          and all(e.left_at_2s == 0 and e.gone_s < math.inf for e in found)
          and all(e.exit_s < STOP_BOUND_S for e in found if e.exit_s is not None)
          and all(_as_promised(e) for e in found)
          and all(e.left_at_2s == 0 and e.checkpoints_intact and e.newest == KEPT
                  and e.metrics in (UNCHANGED, RETRAINED_FIRST) for e in stops)
          and all(e.exit_code == 2 and e.stderr_lines == 1 and e.intact for e in exports))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
