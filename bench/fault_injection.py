"""Fault injection: SIGKILL a fine-tuning run at random moments and resume it, and count what
survived.

    python bench/fault_injection.py --kills 20            # figures for bench/RESULTS.md

Each trial starts a small run (the tiny preset, 2 gloo ranks, a checkpoint after every step),
SIGKILLs its launcher once the run has logged a random number of steps (so the kill lands
anywhere: in a step, in a save, between them), checks that no rank outlives it, resumes from
the checkpoint folder and lets the run finish. Against one uninterrupted reference run it
reports:

- kills: launchers killed while training;
- resumed_from_complete: resumes that started from a complete, verified checkpoint;
- duplicate_metric_lines: steps that appear more than once in metrics.jsonl at the end;
- exact_continuations: finished runs whose every logged loss equals the reference's bit for
  bit (fp32 on the CPU: a resumed run must be indistinguishable from one never interrupted);
- orphans: rank processes still alive 5 s after their launcher was killed.
Target: kills = resumed_from_complete = exact_continuations = N, duplicates = orphans = 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXCERPT = REPO / "tests" / "data" / "shakespeare_excerpt.txt"
ORPHAN_DEADLINE_S = 5.0


@dataclasses.dataclass
class Report:
    trials: int = 0
    kills: int = 0
    resumed_from_complete: int = 0
    duplicate_metric_lines: int = 0
    exact_continuations: int = 0
    orphans: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(var, None)
    return env


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


def _rank_pids(launcher: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
        launcher = subprocess.Popen(_finetune(*_run_args(out, cache, steps, seed)), env=_env(),
                                    cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        ranks: list[int] = []
        while launcher.poll() is None and len(_losses(out)) < target:
            ranks = _rank_pids(launcher.pid) or ranks
            time.sleep(0.002)
        if launcher.poll() is not None:
            report.notes.append(f"trial {trial}: the run ended before the kill")
            continue
        ranks = _rank_pids(launcher.pid) or ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        report.kills += 1
        deadline = time.monotonic() + ORPHAN_DEADLINE_S
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        orphans = [p for p in ranks if _alive(p)]
        report.orphans += len(orphans)
        for p in orphans:
            os.kill(p, signal.SIGKILL)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="trials, one SIGKILL each")
    p.add_argument("--steps", type=int, default=60, help="steps of each run")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill points and the runs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = run_trials(Path(tmp), kills=args.kills, steps=args.steps, seed=args.seed,
                            log=print)
    print(json.dumps(dataclasses.asdict(report), indent=1))
    print(f"{time.perf_counter() - start:.0f} s")
    ok = (report.kills == report.resumed_from_complete == report.exact_continuations
          and report.duplicate_metric_lines == 0 and report.orphans == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
