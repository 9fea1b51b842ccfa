"""pytest plumbing for the kernel benchmarks: a ``kernel_bench`` fixture that times one variant of
one operation and records the bytes it moves, and an end-of-run table of GB/s and ratios.

All figures in the table come from the benchmarks of the same pytest run, so ratios are never
taken between runs made at different times (this machine's bandwidth drifts between runs).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import pytest
import torch

# Timed rounds per variant, after WARMUP untimed ones. The medians of 30 rounds were stable to a
# few per cent on the idle 2-core development machine; the slowest variant (foreach AdamW) takes
# about 2 s in all, the whole CPU run about 15 s.
ROUNDS = 30
WARMUP = 3
# On a GPU one call of a 2^24-element op takes ~0.1 ms, comparable to a host synchronisation, so
# each timed round runs the op this many times and synchronises once.
CUDA_CALLS_PER_ROUND = 20

COPY_VARIANT = "copy (ceiling)"
ZEROCORE_VARIANT = "zerocore"


@dataclasses.dataclass(frozen=True)
class Row:
    group: str    # the operation and its dtypes, e.g. "pack fp32->fp16 [cpu]"
    variant: str  # who does it: "zerocore", a torch baseline, or COPY_VARIANT
    nbytes: int   # bytes the operation must move (read + written)
    median_s: float
    min_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9


_ROWS = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption("--kernel-table", default=None, metavar="PATH",
                     help="also write the end-of-run GB/s table as Markdown to PATH")


_CPU_AT_START = pytest.StashKey[tuple]()


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds used by the whole machine, by this process) so far; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = sum(int(x) for x in fields[1:4] + fields[6:9])  # user nice system irq softirq steal
    t = os.times()
    return busy / ticks, t.user + t.system


def pytest_configure(config):
    config.stash[_ROWS] = []
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
def kernel_bench(benchmark, request):
    """``kernel_bench(fn, group=..., variant=..., nbytes=..., device=...)`` times ``fn`` and
    records the row for the summary table and ``benchmark.extra_info``."""

    def run(fn: Callable[[], object], *, group: str, variant: str, nbytes: int,
            device: str) -> None:
        group = f"{group} [{device}]"
        calls = 1
        timed = fn
        if device == "cuda":
            calls = CUDA_CALLS_PER_ROUND

            def timed():
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()

        benchmark.group = group
        benchmark.name = f"{group} :: {variant}"
        benchmark.extra_info.update(group=group, variant=variant, bytes=nbytes,
                                    calls_per_round=calls)
        benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=WARMUP)
        if benchmark.stats is None:  # --benchmark-disable: nothing was timed
            return
        stats = benchmark.stats.stats
        row = Row(group, variant, nbytes, stats.median / calls, stats.min / calls)
        benchmark.extra_info["GB/s"] = round(row.gbps, 2)
        request.config.stash[_ROWS].append(row)

    return run


def _table(rows: list[Row]) -> list[str]:
    lines = [
        "| operation | variant | median ms | min ms | GB/s | % of copy | time / zerocore's "
        "(median) | (min) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    for group, members in groups.items():
        copy = next((r for r in members if r.variant == COPY_VARIANT), None)
        ours = next((r for r in members if r.variant == ZEROCORE_VARIANT), None)
        for r in members:
            frac = f"{100 * r.gbps / copy.gbps:.0f}%" if copy else "-"
            ratio = f"{r.median_s / ours.median_s:.2f}x" if ours else "-"
            ratio_min = f"{r.min_s / ours.min_s:.2f}x" if ours else "-"
            lines.append(f"| {group} | {r.variant} | {1e3 * r.median_s:.3f} | "
                         f"{1e3 * r.min_s:.3f} | {r.gbps:.1f} | {frac} | {ratio} | {ratio_min} |")
    return lines


def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(_ROWS, [])
    if not rows:
        return
    lines = _table(rows)
    terminalreporter.section("zerocore kernel bandwidth (GB/s from the median time)")
    terminalreporter.write_line(
        "GB/s counts the bytes each operation must move (read + written); '% of copy' compares "
        "with a plain copy of the same number of bytes timed in this run; 'time / zerocore's' > 1 "
        "means zerocore is faster.")
    load = f"Other processes kept {_other_load(config)} busy on average during the run."
    terminalreporter.write_line(load)
    for line in lines:
        terminalreporter.write_line(line)
    path = config.getoption("--kernel-table")
    if path:
        with open(os.path.expanduser(path), "w") as f:
            f.write("\n".join(lines + ["", load]) + "\n")
