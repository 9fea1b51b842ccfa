"""What every benchmark in bench/ shares, so that each script holds only its workload.

Four concerns, in the order a benchmark meets them:

- **ranks**: ``run_ranks(fn, nproc, *args)`` starts ``nproc`` spawned processes, each joined to
  a gloo group on a free local port with one compute thread, calls ``fn(rank, nproc, *args)``
  in each and returns the results by rank. A script that drives its ranks step by step instead
  (bench_fsdp.py) uses the pieces: ``free_port()``, ``join_gloo(rank, world, port)``.
  Every rank also gets ``rank_env``'s variables (what torchrun would set), which DeepSpeed and
  accelerate read.
- **interleaved timing**: ``Interleaved(variants, warmup=...)`` times every variant of one
  measurement in the same process: each round calls every variant once, in an order shuffled
  afresh per round (seeded), so that a drift of the machine (other work, clock, the allocator's
  state) reaches every variant alike and each call has the others' calls moments before and
  after it. The first ``warmup`` rounds are dropped; ``Rounds`` holds the rest and gives
  medians and ratios taken round by round. ``quartiles`` and ``slowest`` summarise.
- **subprocesses**: ``child_env(**extra)`` is the environment a benchmark gives a command it
  runs (neox.finetune, a converter): this checkout first on PYTHONPATH, and none of the
  rendezvous variables of a surrounding launcher (RANK, MASTER_PORT, ...), which would make the
  child join the wrong group.
- **reporting**: ``header(...)`` is the first lines of a result (date, machine, load, versions),
  ``table(columns, rows, align)`` a Markdown table; ``machine_busy_s()``, ``status_kib()`` and
  ``reset_peak_rss()`` are what the "other load" and memory columns are computed from.

A script imports it as ``import harness`` (bench/ is on ``sys.path`` both when a script runs as
``python bench/x.py`` and under pytest, whose conftest.py lives here).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.metadata
import os
import platform
import random
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

REPO = Path(__file__).resolve().parent.parent

# -- ranks ----------------------------------------------------------------------------------------

# The variables a launcher (torchrun, neox.finetune, a surrounding benchmark) sets for a rank.
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun would set for this rank; DeepSpeed (LOCAL_SIZE) and accelerate
    (LOCAL_WORLD_SIZE) read it even when the group already exists."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def join_gloo(rank: int, world: int, port: int, *, timeout_s: float = 900,
              env: Mapping[str, str] | None = None, backend: str = "gloo") -> None:
    """In a rank: one compute thread (the ranks share the cores), ``rank_env`` and ``env`` in
    ``os.environ``, then the gloo group on ``port`` (or ``backend``'s: ``"cuda:nccl,cpu:gloo"``
    for the GPU variants, this rank on GPU ``rank``)."""
    # torch is imported where ranks are started, not with this module: a script that only runs
    # commands and measures them (from_deepspeed_mem.py) keeps its own process small.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, world, port), **(env or {}))
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
               env: Mapping[str, str] | None, group_timeout_s: float, backend: str,
               results) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, port, timeout_s=group_timeout_s, env=env, backend=backend)
    try:
        results.put((rank, fn(rank, world, *args)))
    finally:
        gc.collect()  # free what holds the group first (see examples/train_mlp.py)
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 1800,
              group_timeout_s: float = 900, env: Mapping[str, str] | None = None,
              backend: str = "gloo") -> list[Any]:
    """``fn(rank, nproc, *args)`` in ``nproc`` fresh gloo ranks; their results, by rank.

    ``fn`` must be importable by a spawned process (a module-level function, of a script run as
    ``__main__`` too). ``env``: more variables for the ranks (e.g. ``DS_ACCELERATOR``).
    ``timeout_s`` bounds the wait for the results, ``group_timeout_s`` each collective; a rank
    that exits with an error code after answering is an error too."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, nproc, port, fn, args, env, group_timeout_s, backend,
                               results))
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    by_rank = dict(results.get(timeout=timeout_s) for _ in procs)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a rank exited with {proc.exitcode}")
    return [by_rank[r] for r in range(nproc)]


# -- interleaved timing ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rounds:
    """The timed rounds of an ``Interleaved`` run (warm-up rounds dropped), per variant, in
    round order."""
    times_s: dict[str, list[float]]  # one wall time per timed round
    values: dict[str, list[Any]]     # what the variant returned in each timed round
    probes: dict[str, list[Any]]     # what ``probe(name)`` returned after each timed call

    def median_s(self, name: str) -> float:
        return statistics.median(self.times_s[name])

    def ratios(self, name: str, to: str) -> list[float]:
        """``name``'s time over ``to``'s, round by round (calls moments apart): steadier than
        a ratio of medians when other work comes and goes."""
        return [a / b for a, b in zip(self.times_s[name], self.times_s[to])]


class Interleaved:
    """Interleaved rounds over ``variants`` (name -> callable taking the round's number,
    warm-up rounds counted, e.g. to pick that round's batch).

    ``before(name)`` runs before each call, outside the timer (a barrier, a counter's reset);
    ``settle()`` at the end of each call, inside it (a barrier or a device synchronisation:
    what the call must have finished); ``probe(name)`` after, outside it (a counter's reading).
    The order of a round is shuffled by ``random.Random(seed)``: the same orders in every run,
    and on every rank (collective steps must run in the same order everywhere).
    ``round()`` runs one round (for a driver that calls it, as pytest-benchmark's
    ``pedantic``); ``run(rounds)`` runs the warm-up and ``rounds`` timed rounds."""

    def __init__(self, variants: Mapping[str, Callable[[int], Any]], *, warmup: int,
                 seed: int | str = 0, before: Callable[[str], None] | None = None,
                 settle: Callable[[], None] | None = None,
                 probe: Callable[[str], Any] | None = None):
        self.variants = dict(variants)
        self.warmup = warmup
        self.before, self.settle, self.probe = before, settle, probe
        self.done = 0  # rounds run so far, warm-up included
        self._rng = random.Random(seed)
        self._rounds = Rounds({n: [] for n in self.variants}, {n: [] for n in self.variants},
                              {n: [] for n in self.variants})

    def round(self) -> None:
        order = list(self.variants)
        self._rng.shuffle(order)
        timed = self.done >= self.warmup
        for name in order:
            if self.before is not None:
                self.before(name)
            t0 = time.perf_counter()
            value = self.variants[name](self.done)
            if self.settle is not None:
                self.settle()
            elapsed = time.perf_counter() - t0
            probed = self.probe(name) if self.probe is not None else None
            if timed:
                self._rounds.times_s[name].append(elapsed)
                self._rounds.values[name].append(value)
                self._rounds.probes[name].append(probed)
        self.done += 1

    def result(self) -> Rounds:
        return self._rounds

    def run(self, rounds: int) -> Rounds:
        for _ in range(self.warmup + rounds):
            self.round()
        return self.result()


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile), linearly interpolated."""
    q = (statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1
         else [values[0]] * 3)
    return q[0], q[1], q[2]


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Round by round, the slowest rank's time (a collective step ends with its last rank)."""
    return [max(times) for times in zip(*per_rank)]


# -- subprocesses ---------------------------------------------------------------------------------

def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a command a benchmark runs: this checkout first on
    PYTHONPATH, a surrounding launcher's rendezvous variables removed, ``extra`` added."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for var in RENDEZVOUS_VARIABLES:
        env.pop(var, None)
    return env


# -- reporting ------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the architecture off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(packages: Iterable[str]) -> str:
    """``name version`` for each installed package, read from its metadata (no import: some
    take seconds to import, DeepSpeed builds ops)."""
    found = []
    for name in packages:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def load_average() -> float:
    return os.getloadavg()[0]


def header(*what: str, packages: Sequence[str] = ("torch", "transformers", "deepspeed")) -> str:
    """The lines a result starts with: when and where it ran (date, CPU, cores, the one-minute
    load average now, the installed versions of ``packages``), then ``what`` was run."""
    lines = [f"# {utc_now()}; {cpu_model()}, {os.cpu_count()} CPUs, load average "
             f"{load_average():.2f}; {versions(packages)}"]
    return "\n".join(lines + [f"# {line}" for line in what])


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> str:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    assert len(align) == len(columns), (columns, align)
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy so far (user, nice, system, irq, softirq,
    steal, from /proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return sum(int(x) for x in fields[1:4] + fields[6:9]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def reset_peak_rss() -> bool:
    """Resets this process's VmHWM to its current RSS (Linux >= 4.0); False where that is not
    possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)
