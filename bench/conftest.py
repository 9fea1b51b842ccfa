"""pytest plumbing for the kernel benchmarks: an ``interleaved_bench`` fixture that times every
variant of one operation (zerocore, the torch baselines, a plain copy) interleaved in the same
process (harness.Interleaved's rounds, driven by pytest-benchmark), and end-of-run tables:
zerocore against the fastest torch baseline, and every variant's median, spread, GB/s and
per-round ratio to zerocore.

Ratios are taken round by round between calls made moments apart, never between runs made at
different times (this machine's bandwidth drifts between runs, and other work comes and goes).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable

import pytest
import torch

import harness
from harness import quartiles

# Timed rounds, after WARMUP untimed ones; every round calls each variant once. The medians of 30
# rounds were stable to a few per cent on the idle 2-core development machine; the CPU run takes
# about a minute, plus torch.compile's first compilations (cached across runs).
ROUNDS = 30
WARMUP = 3
# On a GPU one call of a 2^24-element op takes ~0.1 ms, comparable to a host synchronisation, so
# each timed round runs the op this many times and synchronises once.
CUDA_CALLS_PER_ROUND = 20

COPY_VARIANT = "copy (ceiling)"
# The CPU Adam's ceiling (bench_kernels.py, test_cpu_adam): b.add_(a) on fp32 tensors of the
# shard's size reads two arrays and writes one back in place, the access pattern of the Adam
# step's state arrays (a plain copy writes to lines it never read).
RMW_VARIANT = "RMW b.add_(a) (ceiling)"
# The low-bit dequantizations' second ceiling (bench_kernels.py, test_dequant_lowbit): a copy of
# a tensor of the output's size and dtype, what the weights would cost to move were they held in
# the compute dtype.
OUTPUT_COPY_VARIANT = "copy of the output (ceiling)"
CEILING_VARIANTS = (COPY_VARIANT, RMW_VARIANT, OUTPUT_COPY_VARIANT)
ZEROCORE_VARIANT = "zerocore"


@dataclasses.dataclass(frozen=True)
class Row:
    group: str    # the operation and its dtypes, e.g. "pack fp32->fp16 [cpu]"
    variant: str  # who does it: "zerocore", a baseline, or one of CEILING_VARIANTS
    nbytes: int   # bytes this variant must move (read + written)
    times_s: tuple[float, ...]        # one time per timed round
    # per round: this variant's time / zerocore's time in the same round (None: no zerocore)
    ratios: tuple[float, ...] | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9

    @property
    def is_baseline(self) -> bool:
        """What users run instead (torch, or DeepSpeed): neither a zerocore variant ("zerocore",
        "zerocore avx2", ...) nor a ceiling."""
        return (not self.variant.startswith(ZEROCORE_VARIANT)
                and self.variant not in CEILING_VARIANTS)


_ROWS = pytest.StashKey[list]()
_NOTES = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption("--kernel-table", default=None, metavar="PATH",
                     help="bench_kernels.py: also write the end-of-run tables as Markdown to PATH")
    # bench_fsdp.py's choices (a test module cannot add options itself).
    parser.addoption("--sizes", default="6x256,12x256,6x512",
                     help="bench_fsdp.py: model sizes to run, comma-separated (blocks x width)")
    parser.addoption("--engines", default="fsdp2,zerocore,deepspeed,unsharded,"
                                          "deepspeed-per-layer",
                     help="bench_fsdp.py: engines to run at each size, in this order, "
                          "comma-separated (also: zerocore-no-keep-last, zerocore-offload, "
                          "zerocore-gloo, zerocore-exchange, zerocore-read-gathers, "
                          "zerocore-before)")
    parser.addoption("--zerocore-before", default=None, metavar="PATH",
                     help="bench_fsdp.py: a checkout (with zerocore._C built) whose engine runs "
                          "as 'zerocore-before', for A/B runs of an engine change")


_CPU_AT_START = pytest.StashKey[tuple]()


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds used by the whole machine, by this process) so far; None off Linux."""
    busy = harness.machine_busy_s()
    if busy is None:
        return None
    t = os.times()
    return busy, t.user + t.system


def pytest_configure(config):
    config.stash[_ROWS] = []
    config.stash[_NOTES] = []
    config.stash[_CPU_AT_START] = (time.monotonic(), _cpu_seconds())


def _other_load(config) -> str:
    """How many cores other processes kept busy during the run: the figures are only meaningful
    when this is near zero, since every kernel here uses all cores."""
    wall0, cpu0 = config.stash[_CPU_AT_START]
    cpu1 = _cpu_seconds()
    if cpu0 is None or cpu1 is None:
        return "unknown"
    other = (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])
    return f"{max(other, 0.0) / (time.monotonic() - wall0):.2f} cores"


@pytest.fixture
def bench_note(request):
    """``bench_note(text)``: a line printed (once) under the end-of-run tables, e.g. why some
    rows are missing. A skip would not do: --benchmark-only skips tests that time nothing."""
    def note(text: str) -> None:
        if text not in request.config.stash[_NOTES]:
            request.config.stash[_NOTES].append(text)
    return note


@pytest.fixture
def interleaved_bench(benchmark, request):
    """``interleaved_bench(variants, group=..., nbytes=..., device=...[, variant_bytes=...])``
    times every variant of
    one operation (a dict name -> callable; "zerocore" among them) interleaved: each round
    calls every variant once, in an order shuffled afresh per round, so that a drift of the
    machine's speed (other work, frequency, the allocator's state) reaches every variant alike
    and each zerocore time has baseline times taken moments before and after it.
    pytest-benchmark times the whole round; each variant's own time comes from perf_counter
    around its call. Rows for the summary tables go to the session's stash."""

    def run(variants: dict[str, Callable[[], object]], *, group: str, nbytes: int,
            device: str, variant_bytes: dict[str, int] | None = None,
            threads: int | None = None) -> None:
        """nbytes: what the operation moves; variant_bytes: the variants that move another amount
        (a ceiling measured at the operation's size rather than its bytes). threads: the torch
        thread count of the timed calls, restored after."""
        group = f"{group} [{device}]"
        calls = CUDA_CALLS_PER_ROUND if device == "cuda" else 1
        names = list(variants)
        variant_bytes = variant_bytes or {}

        def repeated(fn: Callable[[], object]) -> Callable[[int], None]:
            def call(_round: int) -> None:
                for _ in range(calls):
                    fn()
            return call

        sync = (lambda *_: torch.cuda.synchronize()) if device == "cuda" else None
        # Seeded by the group's name: the same orders in every run of the benchmark.
        rounds = harness.Interleaved({n: repeated(variants[n]) for n in names}, warmup=WARMUP,
                                     seed=group, before=sync, settle=sync)

        benchmark.group = group
        benchmark.name = f"{group} :: interleaved round of {len(names)} variants"
        benchmark.extra_info.update(group=group, variants=names, bytes=nbytes,
                                    calls_per_round=calls)
        old_threads = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            benchmark.pedantic(rounds.round, rounds=ROUNDS, warmup_rounds=WARMUP)
        finally:
            torch.set_num_threads(old_threads)
        if benchmark.stats is None:  # --benchmark-disable: nothing was timed
            return
        timed = {n: tuple(t / calls for t in ts) for n, ts in rounds.result().times_s.items()}
        ours = timed.get(ZEROCORE_VARIANT)
        for name in names:
            ratios = (tuple(t / z for t, z in zip(timed[name], ours))
                      if ours is not None else None)
            row = Row(group, name, variant_bytes.get(name, nbytes), timed[name], ratios)
            benchmark.extra_info[f"{name} median ms"] = round(1e3 * row.median_s, 4)
            request.config.stash[_ROWS].append(row)

    return run


def _groups(rows: list[Row]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    return groups


def _ratio_text(r: Row) -> str:
    if r.ratios is None:
        return "-"
    lo, mid, hi = quartiles(r.ratios)
    return f"{mid:.2f}x [{lo:.2f}-{hi:.2f}]"


def _per_round_fraction(r: Row, ceiling: Row) -> str:
    """This variant's GB/s over the ceiling's, taken round by round (the two calls moments
    apart), as median [IQR]: steadier than the ratio of medians when other work comes and goes."""
    f = [(r.nbytes / t) / (ceiling.nbytes / c) for t, c in zip(r.times_s, ceiling.times_s)]
    lo, mid, hi = quartiles(f)
    return f"{100 * mid:.0f}% [{100 * lo:.0f}-{100 * hi:.0f}]"


def _table(rows: list[Row]) -> list[str]:
    lines = [
        "| operation | variant | median ms | IQR ms | min ms | GB/s | % of ceiling | "
        "% of ceiling, per round: median [IQR] | time / zerocore's, per round: median [IQR] |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group, members in _groups(rows).items():
        copy = next((r for r in members if r.variant in CEILING_VARIANTS), None)
        for r in members:
            lo, _, hi = quartiles(r.times_s)
            frac = f"{100 * r.gbps / copy.gbps:.0f}%" if copy else "-"
            per_round = _per_round_fraction(r, copy) if copy else "-"
            lines.append(f"| {group} | {r.variant} | {1e3 * r.median_s:.3f} | "
                         f"{1e3 * lo:.3f}-{1e3 * hi:.3f} | {1e3 * r.min_s:.3f} | "
                         f"{r.gbps:.1f} | {frac} | {per_round} | {_ratio_text(r)} |")
    return lines


def _reference_table(rows: list[Row]) -> list[str]:
    """Per operation: zerocore against the fastest baseline of that run (by median), the
    reference a speed-up is quoted against."""
    lines = ["| operation | zerocore median ms | fastest baseline | its median ms | "
             "speed-up, per round: median [IQR] | rounds zerocore was faster |",
             "|---|---:|---|---:|---:|---:|"]
    for group, members in _groups(rows).items():
        ours = next((r for r in members if r.variant == ZEROCORE_VARIANT), None)
        baselines = [r for r in members if r.is_baseline]
        if ours is None or not baselines:
            continue
        best = min(baselines, key=lambda r: r.median_s)
        wins = sum(1 for x in best.ratios if x > 1.0)
        lines.append(f"| {group} | {1e3 * ours.median_s:.3f} | {best.variant} | "
                     f"{1e3 * best.median_s:.3f} | {_ratio_text(best)} | "
                     f"{wins}/{len(best.ratios)} |")
    return lines


def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(_ROWS, [])
    if not rows:
        return
    intro = (f"Every operation's variants ran interleaved: {ROUNDS} timed rounds (after "
             f"{WARMUP} warm-up rounds), each calling every variant once in a shuffled order. "
             f"GB/s counts the bytes each variant must move (read + written), from the median; "
             f"'% of ceiling' compares GB/s with a plain copy of as many bytes (or, for the CPU "
             f"Adam, b.add_(a) on the shard's size); 'time / zerocore's' is "
             f"taken round by round (> 1: zerocore was faster in that round), then summarised.")
    load = f"Other processes kept {_other_load(config)} busy on average during the run."
    meta = (f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} at the end of the run.")
    lines = _table(rows) + [""] + config.stash.get(_NOTES, [])
    ref = _reference_table(rows)
    terminalreporter.section("zerocore kernels against the fastest torch baseline, interleaved")
    for line in [intro, load, meta, ""] + ref + [""] + lines:
        terminalreporter.write_line(line)
    path = config.getoption("--kernel-table")
    if path:
        with open(os.path.expanduser(path), "w") as f:
            f.write("\n".join([intro, "", load, meta, ""] + ref + [""] + lines) + "\n")
