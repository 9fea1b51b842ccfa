"""End-to-end training step of zerocore against PyTorch FSDP2, 2 gloo ranks on the CPU.

Run (not part of the default test run):

    python -m pytest bench/bench_fsdp.py --benchmark-only

Every engine trains the same model (DEPTH residual MLP blocks, each one layer, ~16.8M fp32
parameters in all) from the same initial weights on the same per-rank batches, one engine after
the other in the same pytest run, each in its own fresh pair of processes:
- zerocore: ``zerocore.shard(layers)`` + ``zerocore.optim.AdamW`` (fused kernel on flat shards),
  in three configurations: the default; ``Prefetch(keep_last=False)`` (the engine before the
  last layer was kept gathered from forward to backward); and ``Offload(optimizer=True)``
  (master, gradients and moments on the CPU: here, with CPU ranks, the same memory, so this
  measures the offload path's own bookkeeping and copies);
- FSDP2: ``fully_shard`` on every layer and on the root, over a 1-D "cpu" DeviceMesh, +
  ``torch.optim.AdamW(fused=True)`` (``foreach=True`` if fused is refused on DTensor parameters;
  the table says which ran).
One step is forward + MSE loss + backward + optimizer step + ``zero_grad()``.

What the numbers mean. The parent process drives the ranks step by step over pipes, and
pytest-benchmark times each round trip (``benchmark.pedantic``, WARMUP untimed rounds, then
STEPS timed rounds of one step): that is the figure in pytest-benchmark's own table; it includes
the pipe round trip and waking the ranks (a few ms at most). Each rank also times its step with
``time.perf_counter`` and counts the CPU time its process used meanwhile (``getrusage``: the
compute thread and gloo's threads). The end-of-run table gives:
- the median over steps of the slower rank's time, and the zerocore / FSDP2 ratio;
- the median CPU time per step and rank: less sensitive to other processes than the wall time
  (each rank computes on one thread, so two ranks fill this 2-core machine and any other load
  stretches the steps), and what the collectives' own copying costs shows up there;
- how many cores other processes kept busy meanwhile (a lower bound): figures taken under load
  measure the scheduler as much as the engines;
- per rank, the model-state bytes (parameter, gradient and optimizer-state shards, measured from
  the tensors after a step, before ``zero_grad``) next to the ZeRO-3 prediction 16·Ψ/N in fp32;
  the RSS before the model is built (interpreter, torch, gloo); the peak RSS over the process's
  life (``ru_maxrss``, which includes building the unsharded model) and over training only
  (Linux ``VmHWM``, reset once the model is sharded);
- the largest relative difference between the two engines' per-rank losses: they train the same
  model on the same data, so this shows both did the same work.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import resource
import socket
import statistics
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
# A residual MLP block of a transformer's width for a small CPU model: 2,100,736 parameters per
# block, 16.8M in all (64 MiB in fp32), so the per-step traffic (3Ψ, ~200 MB) and the compute
# are both substantial.
WIDTH = 512
HIDDEN = 4 * WIDTH
DEPTH = 8
# Tokens per rank per step, as (sequences, positions).
BATCH = (8, 16)
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
WARMUP = 3   # untimed steps: first-touch allocations, optimizer state creation, gloo set-up
STEPS = 15   # timed steps
BATCHES = 4  # distinct batches per rank, drawn before timing and cycled
# Seconds a rank may take to start (import torch and zerocore under load) and to answer a step.
START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 300.0

# zerocore's configurations (_Zerocore's arguments); FSDP2 runs between them, so that a drift of
# the machine's speed during the run does not favour either side.
ZEROCORE_VARIANTS = {
    "zerocore": {},
    "zerocore-no-keep-last": {"keep_last": False},
    "zerocore-offload": {"offload": True},
}
ENGINES = ["zerocore-no-keep-last", "zerocore", "fsdp2", "zerocore-offload"]
# ZeRO-3 model state per parameter in fp32: parameter 4 + gradient 4 + Adam moments 8.
STATE_BYTES_PER_PARAM = 16


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): the feed-forward half of a pre-norm transformer layer."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, width)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def make_layers() -> list[nn.Module]:
    torch.manual_seed(0)  # the same initial weights on every rank and for both engines
    return [Block(WIDTH, HIDDEN) for _ in range(DEPTH)]


with torch.device("meta"):  # counted without allocating or drawing random numbers
    NUM_PARAMS = DEPTH * sum(p.numel() for p in Block(WIDTH, HIDDEN).parameters())


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, alike per engine
    return [(torch.randn(*BATCH, WIDTH, generator=gen), torch.randn(*BATCH, WIDTH, generator=gen))
            for _ in range(BATCHES)]


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of t (its local shard for a DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


# -- the two engines, on a rank -------------------------------------------------------------------

class _Zerocore:
    def __init__(self, keep_last: bool = True, offload: bool = False) -> None:
        import zerocore

        self.model = zerocore.shard(make_layers(),
                                    prefetch=zerocore.Prefetch(keep_last=keep_last),
                                    offload=zerocore.Offload(optimizer=offload))
        self.optimizer = zerocore.optim.AdamW(self.model.parameters(), **ADAMW)
        self.optimizer_kind = "zerocore.optim.AdamW (fused kernel)"

    def model_state(self) -> dict[str, int]:
        r = self.model.memory_report(self.optimizer)
        return dict(params=r.param_bytes + r.master_bytes, grads=r.grad_bytes,
                    optimizer=r.optimizer_bytes)


class _Fsdp2:
    def __init__(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        self.model = nn.Sequential(*make_layers())
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        try:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW, fused=True)
            self.optimizer_kind = "torch.optim.AdamW(fused=True)"
        except (RuntimeError, TypeError, NotImplementedError):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW, foreach=True)
            self.optimizer_kind = "torch.optim.AdamW(foreach=True)"

    def model_state(self) -> dict[str, int]:
        params = list(self.model.parameters())
        opt = sum(_local_bytes(v) for st in self.optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)  # not the scalar step count
        return dict(params=sum(_local_bytes(p) for p in params),
                    grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                    optimizer=opt)


def _train_step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor],
                zero_grad: bool = True) -> float:
    x, y = batch
    loss = nn.functional.mse_loss(engine.model(x), y)
    loss.backward()
    engine.optimizer.step()
    if zero_grad:
        engine.optimizer.zero_grad()
    return loss.item()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_s() -> float:
    """CPU seconds this process used so far, all its threads (gloo's included), to the µs."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank_main(rank: int, engine_name: str, port: int, conn: Any) -> None:
    """One rank: join the group, build the engine, then answer the parent's commands."""
    # Two ranks on two cores: more compute threads than cores would only contend.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
        # Both engines' code is loaded before the baseline RSS is read, so it is alike for both.
        from torch.distributed import fsdp  # noqa: F401
        import zerocore  # noqa: F401

        base_rss_kib = _status_kib("VmRSS")
        engine = (_Zerocore(**ZEROCORE_VARIANTS[engine_name])
                  if engine_name in ZEROCORE_VARIANTS else _Fsdp2())
        batches = _batches(rank)
        gc.collect()  # the unsharded model built above is gone: measure training from here
        hwm_reset = _reset_peak_rss()
        conn.send(("ok", (engine.optimizer_kind, _cpu_s())))
        step = 0
        while True:
            command = conn.recv()
            if command == "stop":
                break
            if command == "step":
                t0, c0 = time.perf_counter(), _cpu_s()
                loss = _train_step(engine, batches[step % BATCHES])
                conn.send(("ok", (time.perf_counter() - t0, _cpu_s() - c0, loss)))
            elif command == "report":
                cpu_s = _cpu_s()  # before the extra step: the parent's load window ends here
                # One more (untimed) step, measured before zero_grad frees the gradient shards.
                loss = _train_step(engine, batches[step % BATCHES], zero_grad=False)
                state = engine.model_state()
                engine.optimizer.zero_grad()
                conn.send(("ok", dict(state, loss=loss, cpu_s=cpu_s, base_rss_kib=base_rss_kib,
                                      maxrss_kib=resource.getrusage(
                                          resource.RUSAGE_SELF).ru_maxrss,
                                      train_hwm_kib=_status_kib("VmHWM") if hwm_reset else None)))
            step += 1
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    dist.barrier()
    dist.destroy_process_group()


# -- the parent: a pair of ranks driven step by step ----------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy so far; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return sum(int(x) for x in fields[1:4] + fields[6:9]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


class RankPair:
    """WORLD_SIZE ranks running one engine; ``step()`` runs one training step on all of them."""

    def __init__(self, engine: str):
        self.engine = engine
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(WORLD_SIZE):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, engine, port, child), daemon=True,
                            name=f"bench-{engine}-rank{rank}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        started = self._collect(START_TIMEOUT_S, "start")
        self.optimizer_kind = started[0][0]
        self.rank_cpu0 = [cpu for _, cpu in started]
        self.step_times: list[list[float]] = []  # per step, per rank: seconds
        self.step_cpu: list[list[float]] = []    # per step, per rank: CPU seconds
        self.losses: list[list[float]] = []      # per step, per rank
        self.wall0, self.busy0 = time.monotonic(), _machine_busy_s()
        self.parent_cpu0 = sum(os.times()[:2])

    def _collect(self, timeout: float, what: str) -> list[Any]:
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                self.close()
                raise RuntimeError(f"{self.engine} rank {rank}: no answer to '{what}' within "
                                   f"{timeout:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", "the process died (see its traceback above)"
            if status != "ok":
                self.close()
                raise RuntimeError(f"{self.engine} rank {rank} failed during '{what}':\n{value}")
            answers.append(value)
        return answers

    def _command(self, command: str, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send(command)
        return self._collect(timeout, command)

    def step(self) -> None:
        answers = self._command("step", STEP_TIMEOUT_S)
        self.step_times.append([seconds for seconds, _, _ in answers])
        self.step_cpu.append([cpu for _, cpu, _ in answers])
        self.losses.append([loss for _, _, loss in answers])

    def report(self) -> list[dict[str, Any]]:
        wall = time.monotonic() - self.wall0
        busy = _machine_busy_s()
        parent_cpu = sum(os.times()[:2]) - self.parent_cpu0
        reports = self._command("report", STEP_TIMEOUT_S)
        if busy is not None and self.busy0 is not None:
            ours = parent_cpu + sum(r["cpu_s"] - c0 for r, c0 in zip(reports, self.rank_cpu0))
            self.other_load = max(busy - self.busy0 - ours, 0.0) / wall
        else:
            self.other_load = None
        return reports

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send("stop")
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(30.0)
            if p.is_alive():
                p.terminate()
                p.join(5.0)


@dataclasses.dataclass
class EngineResult:
    engine: str
    optimizer_kind: str
    step_s: list[float]           # per timed step: the slower rank's in-rank time
    step_cpu_s: list[float]       # per timed step: CPU seconds, mean over ranks
    losses: list[list[float]]     # per step (warm-up included), per rank
    reports: list[dict[str, Any]]  # per rank
    benchmark_median_s: float | None
    other_load: float | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.step_cpu_s)


class _SummaryPlugin:
    """Prints the comparison table at the end of the run, next to pytest-benchmark's table
    (registered by the ``results`` fixture: a test module cannot define hooks itself)."""

    def __init__(self, found: dict[str, "EngineResult"]):
        self.found = found

    def pytest_terminal_summary(self, terminalreporter):
        if self.found:
            terminalreporter.section("zerocore vs FSDP2: training step, 2 gloo ranks on CPU, fp32")
            for line in _table(self.found):
                terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def results(request):
    """The engines' results, filled by the tests and printed at the end of the run."""
    found: dict[str, EngineResult] = {}
    request.config.pluginmanager.register(_SummaryPlugin(found), "zerocore-bench-fsdp-summary")
    return found


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _per_rank(values: list[str]) -> str:
    return " / ".join(values)


def _table(found: dict[str, EngineResult]) -> list[str]:
    predicted = STATE_BYTES_PER_PARAM * NUM_PARAMS // WORLD_SIZE
    engines = [found[name] for name in ENGINES if name in found]
    lines = [f"Model: {DEPTH} residual MLP blocks {WIDTH}->{HIDDEN}->{WIDTH}, Ψ = {NUM_PARAMS:,} "
             f"fp32 parameters; batch {BATCH[0]}x{BATCH[1]} tokens per rank; {WARMUP} warm-up "
             f"+ {STEPS} timed steps; 1 thread per rank; 'a / b' is rank 0 / rank 1.",
             "",
             "| engine | optimizer | step ms, median (in-rank, slower rank) | min | "
             "pytest-benchmark median ms | CPU ms per step and rank, median | "
             "other load (cores) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in engines:
        bench = "-" if r.benchmark_median_s is None else f"{1e3 * r.benchmark_median_s:.1f}"
        load = "-" if r.other_load is None else f"{r.other_load:.2f}"
        lines.append(f"| {r.engine} | {r.optimizer_kind} | {1e3 * r.median_s:.1f} | "
                     f"{1e3 * min(r.step_s):.1f} | {bench} | {1e3 * r.median_cpu_s:.1f} | "
                     f"{load} |")
    lines += ["",
              "| engine | model state MiB per rank (params + grads + optimizer) | 16Ψ/N MiB | "
              "measured / predicted | RSS MiB before the model | peak RSS MiB, process | "
              "peak RSS MiB, training |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in engines:
        states = [rep["params"] + rep["grads"] + rep["optimizer"] for rep in r.reports]
        parts = _per_rank([f"{_mib(s)} ({_mib(rep['params'])} + {_mib(rep['grads'])} + "
                           f"{_mib(rep['optimizer'])})" for s, rep in zip(states, r.reports)])
        ratio = _per_rank([f"{s / predicted:.4f}" for s in states])
        base = _per_rank([_mib(rep["base_rss_kib"] * 1024) for rep in r.reports])
        rss = _per_rank([_mib(rep["maxrss_kib"] * 1024) for rep in r.reports])
        hwm = _per_rank([_mib(rep["train_hwm_kib"] and rep["train_hwm_kib"] * 1024)
                         for rep in r.reports])
        lines.append(f"| {r.engine} | {parts} | {_mib(predicted)} | {ratio} | {base} | {rss} | "
                     f"{hwm} |")
    theirs = found.get("fsdp2")
    if theirs is not None:
        lines.append("")
        for name in ZEROCORE_VARIANTS:
            ours = found.get(name)
            if ours is None:
                continue
            bench = ""
            if ours.benchmark_median_s and theirs.benchmark_median_s:
                bench = (f"; pytest-benchmark medians "
                         f"{ours.benchmark_median_s / theirs.benchmark_median_s:.3f}")
            n = min(len(ours.losses), len(theirs.losses))
            diff = max((abs(a - b) / abs(b) for i in range(n)
                        for a, b in zip(ours.losses[i], theirs.losses[i])),
                       default=float("nan"))
            lines.append(f"{name} / FSDP2: step time {ours.median_s / theirs.median_s:.3f} "
                         f"(in-rank medians; target <= 1.0){bench}; CPU time per step "
                         f"{ours.median_cpu_s / theirs.median_cpu_s:.3f}; largest relative "
                         f"difference of the per-rank losses over {n} steps {diff:.2e}")
    if "zerocore" in found and "zerocore-no-keep-last" in found:
        after, before = found["zerocore"], found["zerocore-no-keep-last"]
        lines.append(f"zerocore / zerocore-no-keep-last (the last layer kept gathered): step "
                     f"time {after.median_s / before.median_s:.3f}, CPU time "
                     f"{after.median_cpu_s / before.median_cpu_s:.3f}")
    return lines


@pytest.mark.parametrize("engine", ENGINES)
def test_training_step(benchmark, results, engine):
    benchmark.group = "training step, 2 gloo ranks, CPU, fp32"
    benchmark.name = f"training step :: {engine}"
    pair = RankPair(engine)
    try:
        benchmark.pedantic(pair.step, rounds=STEPS, warmup_rounds=WARMUP, iterations=1)
        reports = pair.report()
    finally:
        pair.close()
    stats = benchmark.stats
    result = EngineResult(engine, pair.optimizer_kind,
                          [max(ts) for ts in pair.step_times[-STEPS:]],
                          [statistics.fmean(cs) for cs in pair.step_cpu[-STEPS:]], pair.losses,
                          reports, stats.stats.median if stats is not None else None,
                          pair.other_load)
    results[engine] = result
    benchmark.extra_info.update(
        optimizer=result.optimizer_kind,
        in_rank_median_ms=round(1e3 * result.median_s, 2),
        cpu_per_step_median_ms=round(1e3 * result.median_cpu_s, 2),
        model_state_bytes_per_rank=[rep["params"] + rep["grads"] + rep["optimizer"]
                                    for rep in reports],
        predicted_bytes_per_rank=STATE_BYTES_PER_PARAM * NUM_PARAMS // WORLD_SIZE,
        rss_before_model_kib=[rep["base_rss_kib"] for rep in reports],
        peak_rss_kib=[rep["maxrss_kib"] for rep in reports],
        training_peak_rss_kib=[rep["train_hwm_kib"] for rep in reports],
        other_load_cores=result.other_load)
