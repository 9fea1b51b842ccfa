"""GPT-NeoX-20B's shape on the CPU: ``python -m neox.finetune --model gpt-neox-20b`` with one or
two real 20B blocks (the 50432 x 6144 embedding and readout, hidden 6144, MLP 24576, 64
heads), bf16, two gloo ranks, a few steps at a short sequence; each run measures its ranks'
peak memory over the steps after the first and prints it beside neox.plan's prediction
(``--measure-memory``).

    python bench/neox_20b_cpu.py                       # the four runs of bench/RESULTS.md
    python bench/neox_20b_cpu.py --runs biases:0       # one of them

Prints one Markdown table: time to build (the model built layer by layer, no rank ever holding
more than one layer in full), median time per training step (steps after the first), each
rank's measured peak (tensors) and peak resident set, and the planned peak. Each run uses about
3-4 GB per rank: 24 GB machines run them one at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RUNS = ("biases:0", "lora:0", "biases:0,43", "lora:0,43")

_MEASURED = re.compile(r"rank (\d+): measured ([\d,.]+) MiB \(([\d,.]+) model state \+ "
                       r"([\d,.]+) at the peak\), planned / measured ([\d.]+); peak RSS "
                       r"([\d,]+) MiB in these steps, ([\d,]+) MiB in the run")
_PLANNED = re.compile(r"planned by neox.plan: ([\d,.]+) MiB, peak at ([^)]+)\)")
_BUILT = re.compile(r"built in ([\d.]+) s")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def run_one(mode: str, blocks: str, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"{mode}-{blocks.replace(',', '_')}"
    cmd = [sys.executable, "-m", "neox.finetune", "--cpu", "--nproc", "2", "--model",
           "gpt-neox-20b", "--dtype", "bf16", "--filter-layers", blocks, "--finetune", mode,
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--max-steps", str(args.steps), "--val-fraction", str(args.val_fraction),
           "--sample-tokens", "0", "--measure-memory", "--output-dir", str(out), "--overwrite"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=harness.child_env(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log = proc.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = 2 * args.batch_size * args.seq_len
    times = [tokens / s["tokens_per_s"] for s in steps if "tokens_per_s" in s][1:]
    ranks = [m.groups() for m in _MEASURED.finditer(log)]
    planned = _PLANNED.search(log)
    if len(ranks) != 2 or planned is None:
        raise SystemExit(f"no memory lines in the output of {' '.join(cmd)}:\n{log[-3000:]}")
    return {"mode": mode, "blocks": blocks, "build_s": float(_BUILT.search(log).group(1)),
            "step_s": statistics.median(times), "wall_s": wall,
            "planned": _number(planned.group(1)), "peak_at": planned.group(2),
            "measured": [_number(r[1]) for r in ranks], "ratio": [float(r[4]) for r in ranks],
            "rss_steps": [_number(r[5]) for r in ranks], "rss_run": [_number(r[6]) for r in ranks]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS),
                   help="MODE:BLOCKS, e.g. lora:0,43 (default: the four of RESULTS.md)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--val-fraction", type=float, default=0.005,
                   help="a small validation split: each evaluation forward gathers the whole "
                        "1.1 B-parameter model")
    args = p.parse_args()
    for run in args.runs:
        if ":" not in run:
            p.error(f"--runs {run!r}: expected MODE:BLOCKS, e.g. biases:0")
    print(harness.header(f"seq {args.seq_len}, batch {args.batch_size} per rank, {args.steps} "
                         f"steps", packages=("torch",)))
    # The table's head, then each row as it comes (a run takes minutes).
    print(harness.table(("mode", "blocks", "build s", "step s (median of steps 2..)",
                         "planned MiB", "measured MiB (rank 0 / 1)", "planned / measured",
                         "peak RSS MiB in the steps", "peak RSS MiB in the run", "peak at"),
                        (), "llrrrlllll"))
    with tempfile.TemporaryDirectory(prefix="neox20b-") as tmp:
        for run in args.runs:
            mode, blocks = run.split(":", 1)
            r = run_one(mode, blocks, args, Path(tmp))
            print(f"| {r['mode']} | {r['blocks']} | {r['build_s']:.1f} | {r['step_s']:.2f} | "
                  f"{r['planned']:,.0f} | {' / '.join(f'{m:,.0f}' for m in r['measured'])} | "
                  f"{' / '.join(f'{x:.3f}' for x in r['ratio'])} | "
                  f"{' / '.join(f'{x:,.0f}' for x in r['rss_steps'])} | "
                  f"{' / '.join(f'{x:,.0f}' for x in r['rss_run'])} | {r['peak_at']} |",
                  flush=True)
    print(f"# load average at the end {harness.load_average():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
