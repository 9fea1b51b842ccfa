"""neox.finetune under two torchrun agents on this machine, as two nodes of two ranks each
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1): the step time and the bytes
moved within and across the nodes per step, flat against ``--hybrid hsdp`` against HSDP with
``--quantize-gradients int8``, on a small GPT-NeoX shape (the tiny preset, fully trained).

Each round runs every layout once, in an order shuffled afresh per round (seeded), so that the
machine's other load reaches each alike; the step time is the median over rounds of each run's
median step (its first step left out: it warms the allocator and the transport). The bytes are
the run's own ``comm_report`` (its communication table), divided by its steps: exact whatever
the load. On one machine the "nodes" share memory and cores, so the time says what the layouts
cost in compute and synchronisation here, not what a network would make of their bytes.

    python bench/two_node_torchrun.py [--rounds 2] [--steps 6]

The agents are started by the tests' launcher (tests/support/two_nodes.py, one copy).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

sys.path.insert(0, str(harness.REPO))

from tests.support.two_nodes import run_two_nodes  # noqa: E402

LAYOUTS = {"flat": (), "HSDP": ("--hybrid", "hsdp"),
           "HSDP + qgZ int8": ("--hybrid", "hsdp", "--quantize-gradients", "int8")}
WORLD = 4


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(layout: str, args: argparse.Namespace, out: Path, cache: Path) -> dict:
    flags = ["--cpu", "--model", "tiny", "--finetune", "full", "--data",
             harness.REPO / "tests" / "data" / "shakespeare_excerpt.txt",
             "--cache-dir", cache, "--output-dir", out, "--seq-len", args.seq_len,
             "--batch-size", args.batch_size, "--grad-accum", args.grad_accum,
             "--max-steps", args.steps, "--epochs", 1000, "--sample-tokens", 0, "--lr", 1e-3,
             "--seed", 0,
             *LAYOUTS[layout]]
    before = uptime()
    agents = run_two_nodes(["-m", "neox.finetune", *flags], timeout=1200,
                           env=harness.child_env())
    if agents.codes != [0, 0]:
        raise SystemExit(f"{layout}: the agents exited {agents.codes}\n{agents.output[-4000:]}")
    tokens = WORLD * args.batch_size * args.grad_accum * args.seq_len  # per optimizer step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [tokens / r["tokens_per_s"] for r in records if "loss" in r]
    assert len(steps) == args.steps, (layout, len(steps))
    split = re.search(r"intra-node ([\d.]+) MiB, inter-node ([\d.]+) MiB", agents.output)
    ways = re.search(r"^  \((gather: [^)]*)\)$", agents.output, re.M).group(1)
    return dict(step_s=statistics.median(steps[1:]), loss=records[-1]["loss"],
                within=float(split.group(1)) / args.steps, across=float(split.group(2)) /
                args.steps, ways=ways, uptime=(before, uptime()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=2)
    args = p.parse_args()
    print(harness.header(f"bench/two_node_torchrun.py --rounds {args.rounds} --steps "
                         f"{args.steps}: tiny preset, full fine-tuning, {args.seq_len} tokens x "
                         f"{args.batch_size} sequences per rank, {args.grad_accum} micro-batches "
                         f"per step, 2 agents x 2 gloo ranks", packages=("torch",)))
    order = random.Random(0)
    results: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            names = list(LAYOUTS)
            order.shuffle(names)
            for name in names:
                start = time.perf_counter()
                got = run(name, args, Path(tmp) / f"{rnd}-{name.replace(' ', '')}",
                          Path(tmp) / "cache")
                results[name].append(got)
                print(f"# round {rnd + 1}, {name}: median step {got['step_s']:.3f} s, run "
                      f"{time.perf_counter() - start:.0f} s; uptime before: {got['uptime'][0]}; "
                      f"after: {got['uptime'][1]}", flush=True)
    flat = statistics.median(r["step_s"] for r in results["flat"])
    rows = []
    for name, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        # The bytes do not depend on the load: every round's are the same.
        assert len({(r["within"], r["across"]) for r in runs}) == 1, runs
        rows.append((name, f"{step:.3f}", f"{step / flat:.2f}",
                     " / ".join(f"{r['step_s']:.3f}" for r in runs),
                     f"{runs[0]['within']:.3f}", f"{runs[0]['across']:.3f}",
                     f"{runs[0]['loss']:.4f}", runs[0]["ways"]))
    print(harness.table(["layout", "step (s, median)", "vs flat", "per round (s)",
                         "within nodes / step (MiB)", "across nodes / step (MiB)",
                         "last loss", "ways (comm_report)"], rows, "lrrrrrrl"))


if __name__ == "__main__":
    main()
