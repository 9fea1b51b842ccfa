"""The one-step-delayed optimizer pass's effect on the loss (issue 44, item 2): neox's built-in
run (the tiny preset trained from scratch on tiny_shakespeare, 2 CPU ranks, 16 sequences of 128
tokens a rank a step) with the optimizer in host memory, once with the exact pass and once
delayed (``--offload-overlap exact|delayed``), the same seed and data; their training losses
step by step and their validation losses.

    python bench/delayed_curve.py --output /tmp/delayed-curve [--steps 150] [--compare-only]
                                  [--checkpoint HF_DIR]

Each run is ``python -m neox.finetune --cpu --offload optimizer --offload-overlap MODE
--max-steps STEPS --eval-every 50 --sample-tokens 0 --output-dir OUTPUT/MODE`` (the corpus and
tokenizer from the cache or ``--data-dir``'s default); with ``--checkpoint`` (a Hugging Face
directory, e.g. ``neox.export`` of a finished built-in run) it is a full fine-tune of those
weights (``--finetune full``, neox's fine-tuning defaults: lr 3e-4, no warm-up) instead of
training from scratch. ``--compare-only`` reads two finished runs' ``metrics.jsonl`` instead
of running them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import harness

MODES = ("exact", "delayed")
# The steps the table shows (and the last).
SHOWN = (1, 2, 3, 5, 10, 25, 50, 75, 100, 125, 150)


def run(mode: str, out: Path, steps: int, checkpoint: Path | None) -> None:
    cmd = [sys.executable, "-m", "neox.finetune", "--cpu", "--offload", "optimizer",
           "--offload-overlap", mode, "--max-steps", str(steps), "--eval-every", "50",
           "--sample-tokens", "0", "--output-dir", str(out / mode)]
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint), "--finetune", "full"]
    proc = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    model_line = next(line for line in proc.stdout.splitlines() if line.startswith("model:"))
    print(f"{mode}: {model_line}")


def metrics(out: Path, mode: str) -> tuple[dict[int, float], list[float]]:
    """(training loss by step, validation losses in order) of one run."""
    records = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().split(
        "\n") if line]
    train = {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return train, val


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, required=True, help="where the two runs go")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--checkpoint", type=Path, help="fine-tune these weights (a Hugging Face "
                   "directory) instead of training the tiny preset from scratch")
    p.add_argument("--compare-only", action="store_true",
                   help="compare two finished runs in --output")
    args = p.parse_args()
    what = (f"full fine-tune of {args.checkpoint}" if args.checkpoint else
            "neox built-in run, tiny preset from scratch, full")
    print(harness.header(f"{what}, fp32, 2 CPU ranks, optimizer in host memory, {args.steps} "
                         f"steps: exact against delayed", packages=("torch",)))
    if not args.compare_only:
        for mode in MODES:
            run(mode, args.output, args.steps, args.checkpoint)
    (exact, val_e), (delayed, val_d) = (metrics(args.output, m) for m in MODES)
    steps = sorted(set(exact) & set(delayed))
    diff = {s: delayed[s] - exact[s] for s in steps}
    rows = [(s, f"{exact[s]:.4f}", f"{delayed[s]:.4f}", f"{diff[s]:+.4f}",
             f"{diff[s] / exact[s]:+.2%}") for s in steps if s in SHOWN or s == steps[-1]]
    print(harness.table(["step", "loss exact", "loss delayed", "delayed - exact", "relative"],
                        rows, "rrrrr"))
    last = steps[-50:]
    print(f"steps {last[0]}-{last[-1]}: mean (delayed - exact) "
          f"{statistics.mean(diff[s] for s in last):+.4f}, mean |delayed - exact| "
          f"{statistics.mean(abs(diff[s]) for s in last):.4f}, mean exact loss "
          f"{statistics.mean(exact[s] for s in last):.4f}")
    print(f"validation losses: exact {', '.join(f'{v:.4f}' for v in val_e)}; delayed "
          f"{', '.join(f'{v:.4f}' for v in val_d)}")


if __name__ == "__main__":
    main()
