"""What a quantized frozen base costs in quality, and what a LoRA fine-tune on top of it wins
back (issue 41, item 6): validation perplexity of a GPT-NeoX trained here to a real loss, with
its weights in the compute dtype, int8, NF4 and fp8, before and after a LoRA fine-tune on top
of each.

1. **The base**: neox.finetune's built-in run (the tiny preset trained from scratch on
   tiny_shakespeare, ``--finetune full``), ``--base-epochs`` epochs, exported with
   ``--export-hf``. Its final validation line is the compute-dtype base's perplexity as the
   engine computed it.
2. **Before**: the exported base with every weight replaced by its round trip through
   ``zerocore.kernels.reference.round_trip`` at the format's default block
   (``zerocore.FROZEN_FORMATS``): what a ``--finetune lora --frozen-weights F`` run computes
   with, since LoRA freezes every base weight and the engine quantizes each frozen parameter
   alone on whole blocks (tests/engine/test_frozen_quantized.py holds the engine to this
   round trip at world sizes 1-3). Evaluated by neox.evaluate's ``evaluate_windows`` on the
   base run's own validation windows (``run_validation_windows``).
3. **After**: ``neox.finetune --checkpoint BASE/hf --finetune lora --frozen-weights F``, the
   same steps, seed, data and learning rate for each F; its final validation line (the engine
   with its quantized base, 2 gloo ranks, the same validation windows: the split is the text's
   last ``--val-fraction`` of windows, checked here) is the figure.

Also reported: the perplexity of the best unigram model, fitted to the validation tokens
themselves (a lower bound for any unigram model), so "a real loss" is a number.

    python bench/frozen_quality.py --data-dir ../shared/data --out runs/frozen-quality

``--base DIR`` reuses a finished base run (its ``hf/`` export) instead of training one.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FORMATS = ("compute", "int8", "nf4", "fp8")


def finetune(args: list, log: Path) -> None:
    """``python -m neox.finetune ARGS``, its output in ``log``; stops the bench if it fails."""
    cmd = [sys.executable, "-m", "neox.finetune", *map(str, args)]
    print(f"$ python {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=harness.child_env(), stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"failed ({code}); its output: {log}")
    print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)


def last_validation(run: Path) -> float:
    """The validation loss of a run's last step (neox.finetune's metrics.jsonl)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return lines[-1]["val_loss"]


def unigram_perplexity(targets: torch.Tensor) -> float:
    """exp of the entropy of the tokens' own frequencies: no unigram model does better."""
    counts = torch.bincount(targets.flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return math.exp(-(p * p.log()).sum().item())


def round_tripped(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A copy of ``model`` whose every weight is what ``FrozenWeights(dtype)`` computes with."""
    import zerocore
    from zerocore.kernels.reference import round_trip
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(round_trip(p, dtype, zerocore.FROZEN_FORMATS[dtype]).to(p.dtype))
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a new directory for the runs")
    p.add_argument("--data-dir", type=Path, default=None, help="neox.finetune's --data-dir")
    p.add_argument("--base", type=Path, default=None,
                   help="a finished base run (with --export-hf) to reuse instead of training")
    p.add_argument("--base-epochs", type=int, default=6)
    p.add_argument("--lora-epochs", type=int, default=1)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from neox.run.evaluation import evaluate_windows, run_corpus, run_validation_windows
    from neox.run.inference import ModelSource, load_model

    data = ["--data-dir", args.data_dir] if args.data_dir is not None else []
    args.out.mkdir(parents=True, exist_ok=True)
    print(harness.header(f"base: built-in run, {args.base_epochs} epochs; LoRA: "
                         f"{args.lora_epochs} epoch(s), lr {args.lora_lr}, seed {args.seed}",
                         packages=("torch",)), flush=True)
    base = args.base or args.out / "base"
    if args.base is None:
        finetune([*data, "--epochs", args.base_epochs, "--seed", args.seed, "--export-hf",
                  "--sample-tokens", 0, "--output-dir", base], args.out / "base.log")

    run = load_model(ModelSource(checkpoint=base, device="cpu"))
    inputs, targets = run_validation_windows(run, run_corpus(run))
    exported = load_model(ModelSource(checkpoint=base / "hf", device="cpu")).model
    before = {}
    for fmt in FORMATS:
        model = exported if fmt == "compute" else round_tripped(exported, fmt)
        with torch.no_grad():
            before[fmt] = evaluate_windows(model, inputs, targets, batch_size=16,
                                           device=torch.device("cpu"))["loss"]

    after = {}
    for fmt in FORMATS:
        lora = args.out / f"lora-{fmt}"
        finetune([*data, "--checkpoint", base / "hf", "--finetune", "lora", "--frozen-weights",
                  fmt, "--epochs", args.lora_epochs, "--lr", args.lora_lr, "--seed", args.seed,
                  "--sample-tokens", 0, "--output-dir", lora], args.out / f"lora-{fmt}.log")
        tuned = load_model(ModelSource(checkpoint=lora, device="cpu"))
        same = torch.equal(run_validation_windows(tuned, run_corpus(tuned))[1], targets)
        if not same:
            raise SystemExit(f"{lora}'s validation windows are not the base run's")
        after[fmt] = last_validation(lora)

    print(f"\nvalidation: {targets.numel():,} tokens ({targets.shape[0]} windows of "
          f"{targets.shape[1]}), the same for every row; load average "
          f"{harness.load_average():.2f} at the end")
    print(f"base run's own last validation (the engine, 2 ranks): perplexity "
          f"{math.exp(last_validation(base)):.2f}; best unigram model: "
          f"{unigram_perplexity(targets):.1f}\n")
    rows = [(fmt if fmt != "compute" else "compute (fp32)", f"{math.exp(before[fmt]):.2f}",
             f"{math.exp(before[fmt]) / math.exp(before['compute']):.4f}",
             f"{math.exp(after[fmt]):.2f}",
             f"{math.exp(after[fmt]) / math.exp(after['compute']):.4f}") for fmt in FORMATS]
    print(harness.table(("frozen base", "perplexity, base", "/ compute",
                         "perplexity after LoRA", "/ compute"), rows, "lrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
