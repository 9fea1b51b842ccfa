"""The overlapped optimizer pass (issue 44, item 1) on this machine's disk: the NVMe-offloaded
step over the in-memory step, with the pass inside ``step()`` (``Offload(overlap="off")``, the
"before") and overlapping the next forward (``"exact"``, the "after"), and an A/A control.
``--compare delayed`` (item 2): the one-step-delayed pass against the exact one, on NVMe and
in host memory (``cpu-exact``, ``cpu-delayed``: ``Offload(optimizer="cpu")``, the parameters
in a mirror); the delayed runs' losses are not the in-memory run's (each forward computes with
the weights from before the last update). ``--compare read-ahead``: both overlapped,
``nvme-no-ahead`` with the next pass's first chunks read when the pass starts
(``NvmeStore.read_ahead_passes`` off: the pass as before the read-ahead) and ``nvme-ahead``
with them read as the previous pass ends.

    python bench/overlap_step.py --path /work/nvme-scratch [--model pythia-70m] [--rounds 3]
                                 [--blocks N] [--compare pass|delayed|read-ahead|default|aa]
                                 [--pool-mib N]

One gloo rank on the CPU; neox's preset (random weights; ``--blocks N``: its first N blocks
only) full-fine-tuned in fp32 with zerocore's AdamW, 2 sequences x 64 tokens a step, the
default pool (``--pool-mib``: another). Four models live side by side in the one process:
``memory`` and ``memory-aa`` (no offload: the same run twice, the control), ``nvme-off`` and
``nvme-exact`` (``Offload(optimizer="nvme", params="cpu")``, the moments on the disk; in fp32
the masters are the parameters' copies in host memory). Each round runs every variant once,
in a shuffled order (``harness.Interleaved``): 8 consecutive steps of its own model, the last
one's pass waited for inside the round (``optimizer.settle()``), so no variant's pass runs
during another's steps. Reported: the median tokens/s of steps 3-8 of each call (the issue's
measure), their median over the timed rounds, the ratios memory / nvme round by round, and
whether every variant's losses equal ``memory``'s bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time
from pathlib import Path

import torch

import harness
import zerocore
from neox.config import PRESETS
from neox.model import build_layers
from neox.run.step import micro_batch_loss

STEPS = 8            # steps per call
TIMED = slice(2, 8)  # steps 3-8
ROWS, SEQ = 2, 64


# The variants of each comparison (the first two: the in-memory run and its A/A control).
COMPARE = {"pass": ["memory", "memory-aa", "nvme-off", "nvme-exact"],
           "delayed": ["memory", "memory-aa", "nvme-exact", "nvme-delayed", "cpu-exact",
                       "cpu-delayed"],
           "read-ahead": ["memory", "memory-aa", "nvme-no-ahead", "nvme-ahead"],
           # For a model of which this machine holds only two copies (the whole pythia-410m:
           # about 6.5 GB in memory, 4.3 GB with the moments on NVMe): the default engine
           # against the in-memory run, with no A/A model; the spread of the round-by-round
           # ratios is then the only measure of the noise.
           "default": ["memory", "nvme-ahead"],
           # Its A/A control, run as a separate call between "default" calls: the in-memory run
           # against a second one, the two copies this machine holds.
           "aa": ["memory", "memory-aa"]}


def offload_of(label: str, path: str, pool: int | None = None) -> zerocore.Offload:
    """``memory``; ``<home>-<overlap>``: the optimizer on NVMe (the parameters on the host) or
    in host memory (the parameters in a mirror), its pass ``overlap``; NVMe's pool ``pool``
    bytes (None: the default)."""
    if label.startswith("memory"):
        return zerocore.Offload()
    home, overlap = label.split("-", 1)
    overlap = "exact" if overlap in ("no-ahead", "ahead") else overlap
    if home == "cpu":
        return zerocore.Offload(optimizer="cpu", overlap=overlap)
    sized = {} if pool is None else {"pool_bytes": pool}
    return zerocore.Offload(optimizer="nvme", params="cpu", path=path, overlap=overlap,
                            **sized)


class Run:
    """One variant's model, optimizer and step count."""

    def __init__(self, config, label: str, path: str, blocks: int | None,
                 pool: int | None = None):
        layers = build_layers(config, generator=torch.Generator().manual_seed(0),
                              filter_layers=None if blocks is None else range(blocks))
        self.model = zerocore.shard(layers, offload=offload_of(label, path, pool))
        if label == "nvme-no-ahead":
            for store in self._stores():
                store.read_ahead_passes = False
        self.opt = zerocore.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.vocab = config.vocab_size
        self.step = 0
        self.losses: list[bytes] = []
        self.passes: list = []   # each call's last pass (NVMe runs): its PassTimes

    def __call__(self, round_: int) -> float:
        """``STEPS`` steps; the median tokens/s of steps 3-8."""
        times = []
        for i in range(STEPS):
            g = torch.Generator().manual_seed(self.step)
            ids = torch.randint(0, self.vocab, (ROWS, SEQ + 1), generator=g)
            t0 = time.perf_counter()
            loss, _ = micro_batch_loss(self.model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if i == STEPS - 1:
                self.opt.settle()  # (this call's last pass is this call's time)
            times.append(time.perf_counter() - t0)
            self.losses.append(struct.pack("<d", loss.item()))
            self.step += 1
        self.passes += [store.last_pass for store in self._stores()]
        return statistics.median(ROWS * SEQ / t for t in times[TIMED])

    def _stores(self) -> list:
        stores = {id(s.nvme.store): s.nvme.store for s in self.model.trainable_shards()
                  if s.nvme is not None}
        return list(stores.values())

    def last_pass(self) -> str:
        """The last pass's chunks found read ahead, and its reads in MiB (NVMe runs)."""
        passes = [store.last_pass for store in self._stores()]
        if not passes:
            return "-"
        return (f"{sum(p.chunks_read_ahead for p in passes)} of "
                f"{sum(p.read_bytes for p in passes) / 2**20:.0f} MiB")

    def pass_seconds(self) -> str:
        """The median, over the calls, of their last pass's seconds, and of its seconds
        waiting for reads (NVMe runs)."""
        if not self.passes:
            return "-"
        return (f"{statistics.median(p.total_s for p in self.passes):.2f} / "
                f"{statistics.median(p.read_wait_s for p in self.passes):.2f}")


def rank_main(rank: int, world: int, args: argparse.Namespace) -> str:
    config = PRESETS[args.model]
    labels = COMPARE[args.compare]
    pool = None if args.pool_mib is None else args.pool_mib * 2**20
    runs = {label: Run(config, label, str(args.path), args.blocks, pool) for label in labels}
    before = harness.load_average()
    # (pass and read-ahead: the orders of their records)
    seed = "delayed" if args.compare == "delayed" else "overlap"
    rounds = harness.Interleaved(runs, warmup=1, seed=seed).run(args.rounds)
    after = harness.load_average()
    tok = {label: rounds.values[label] for label in labels}
    rows = [(label, f"{statistics.median(tok[label]):.0f}",
             " ".join(f"{v:.0f}" for v in tok[label]),
             " ".join(f"{a / b:.2f}" for a, b in zip(tok["memory"], tok[label])),
             runs[label].losses == runs["memory"].losses, runs[label].last_pass(),
             runs[label].pass_seconds())
            for label in labels]
    pools = sorted({(store.pool_bytes // 2**20, store.pool_chosen)
                    for run in runs.values() for store in run._stores()})
    pool_line = "NVMe pool: " + (", ".join(
        f"{mib} MiB ({'chosen from the host' if chosen else 'given'})"
        for mib, chosen in pools) or "none")
    return "\n".join([
        f"load average (1 min) before {before:.2f}, after {after:.2f}", pool_line,
        harness.table(["run", "tokens/s (median of rounds)", "each timed round",
                       "memory / run, round by round", "losses bitwise = memory's",
                       "last pass: chunks found read ahead, of its reads",
                       "a call's last pass: s / s waiting for reads (median)"],
                      rows, "lrrrlrr")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", type=Path, required=True, help="the scratch directory (a disk)")
    p.add_argument("--model", choices=sorted(PRESETS), default="pythia-70m")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (one warm-up first)")
    p.add_argument("--pool-mib", type=int, default=None,
                   help="NVMe's pool in MiB (default: Offload's, chosen from the host's memory)")
    p.add_argument("--blocks", type=int, default=None,
                   help="keep the preset's first N blocks only (a large model within memory)")
    p.add_argument("--compare", choices=sorted(COMPARE), default="pass",
                   help="pass: the pass inside the step against exact; delayed: delayed "
                        "against exact, on NVMe and in host memory; read-ahead: the NVMe pass "
                        "without and with the next pass's first chunks read ahead; default: "
                        "the default engine on NVMe against the in-memory run, no A/A model "
                        "(for a model this machine holds only two copies of); aa: that "
                        "case's A/A control, the in-memory run against a second one, to run "
                        "between default calls")
    args = p.parse_args()
    kept = "" if args.blocks is None else f" (its first {args.blocks} blocks)"
    pool_text = ("the default pool (chosen from the host's memory)" if args.pool_mib is None
                 else f"a pool of {args.pool_mib} MiB")
    print(harness.header(f"{args.model}{kept}, full fine-tuning, fp32, one rank on the CPU, "
                         f"{ROWS} x {SEQ} tokens a step, {STEPS} steps a call (steps 3-8 "
                         f"timed), {pool_text}; scratch in {args.path}", packages=("torch",)))
    print(harness.run_ranks(rank_main, 1, args)[0])


if __name__ == "__main__":
    main()
