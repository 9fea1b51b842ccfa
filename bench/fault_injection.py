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
  launcher exited (issue 20's bound: --timeout + 5 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
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
    exit_s: float | None = None  # a stopped rank: from the SIGSTOP until the launcher exited


def _message(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return (errors or lines or [""])[-1][:300]


def _start(out: Path, cache: Path, nproc: int, *more) -> tuple[subprocess.Popen, str]:
    mark = uuid.uuid4().hex
    argv = ["--cpu", "--data", EXCERPT, "--cache-dir", cache, "--seq-len", 16, "--batch-size",
            2, "--seed", 1, "--epochs", 50, "--output-dir", out, *more]  # never ends by itself
    if nproc != 2:
        argv += ["--nproc", nproc, "--oversubscribe"]
    return subprocess.Popen(_finetune(*argv), env=_env(mark), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True), mark


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
        if launcher.poll() is not None:
            raise RuntimeError(f"{name}: the run ended first: {launcher.communicate()[1]}")
        processes = len(run_processes(mark))
        os.kill(launcher.pid, sig)
        gone, left = _time_until_gone(mark, time.monotonic())
        # (communicate: the pipes stay open until the last process holding them is gone)
        _, stderr = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill_all(mark)
    return Ending(name, nproc, gone, left, launcher.returncode, _message(stderr), processes)


def stop_a_rank(workdir: Path, cache: Path, nproc: int) -> Ending:
    """SIGSTOPs rank 1 once the run has logged 2 steps (``--timeout STOP_TIMEOUT_S``), and
    times until the launcher exits and until no process of the run is left."""
    out = workdir / uuid.uuid4().hex
    launcher, mark = _start(out, cache, nproc, "--timeout", STOP_TIMEOUT_S)
    try:
        while len(_losses(out)) < 2:
            if launcher.poll() is not None:
                raise RuntimeError(f"the run ended before the stop: {launcher.communicate()[1]}")
            time.sleep(0.01)
        processes = len(run_processes(mark))
        os.kill(rank_pids(mark, launcher.pid)[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = launcher.communicate(timeout=300)
        exited = time.monotonic() - stopped
        gone, left = _time_until_gone(mark, stopped)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill_all(mark)
    return Ending(f"rank 1 SIGSTOPed in training, --timeout {STOP_TIMEOUT_S:g}", nproc, gone,
                  left, launcher.returncode, _message(stderr), processes, exited)


def endings(workdir: Path, repeats: int, log=lambda *a: None) -> list[Ending]:
    """Every ending scenario of the module docstring, ``repeats`` rounds of them all."""
    cache = workdir / "cache"
    plans = [(signal_during_start_up, (sig, moment, 2))
             for sig in (signal.SIGKILL, signal.SIGTERM) for moment in (0.2, 1.0, 5.0)]
    plans += [(signal_during_start_up, (sig, moment, 16))
              for sig in (signal.SIGKILL, signal.SIGTERM) for moment in ("spawned", 5.0)]
    plans += [(stop_a_rank, (nproc,)) for nproc in (2, 4)]
    found = []
    for _ in range(repeats):
        for fn, plan in plans:
            ending = fn(workdir, cache, *plan)
            log(json.dumps(dataclasses.asdict(ending)))
            found.append(ending)
    return found


def table(found: list[Ending]) -> str:
    """Markdown: one row per scenario over its runs (the median and the worst)."""
    rows = ["| fault | ranks | runs | processes at the fault (min-max) | until no process "
            "left, s: median / max | left at 2 s (max) | launcher exit after the stop, s: max "
            "| exit codes | message |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
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
    print(json.dumps(dataclasses.asdict(report), indent=1))
    print(f"kill trials {trials_s:.0f} s, all {time.perf_counter() - start:.0f} s")
    if found:
        print(table(found))
    ok = (report.kills == report.resumed_from_complete == report.exact_continuations
          and report.duplicate_metric_lines == 0 and report.orphans == 0
          and all(e.left_at_2s == 0 and e.gone_s < math.inf for e in found)
          and all(e.exit_s < STOP_BOUND_S for e in found if e.exit_s is not None))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
