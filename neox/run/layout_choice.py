"""The plan's choice of a layout for the frozen base: for each candidate (frozen format x
placement x keep-gathered budget x recomputation), ``zerocore.plan`` of the run (memory per GPU,
bytes moved and floating-point work per step: the engine's own step on fake tensors), a step
time estimated from them, and the fastest candidate that fits the GPU. ``neox.plan --link``
prints the table; ``neox.finetune --frozen-placement auto`` takes the choice.

The time model, stated once (``Machine.seconds``): a step takes its FLOPs at ``mfu`` of the
GPU's peak, PLUS the bytes each GPU sends at the link's bandwidth. The sum, not the larger of
the two: the engine prefetches only the next layer's gather, the collectives' kernels take the
GPU's cores from the matmuls, and what does not overlap (the first gather, the last
reduce-scatter, the optimizer step) is serial; the sum is the bound to plan a rental with, and
between candidates whose compute is the same it ranks them by their bytes, as overlap would.
Bytes on the wire are a ring's: a collective over N ranks of a buffer of S bytes (how the plan
counts it) sends (N - 1) / N x S from each rank (twice that for an all-reduce); within a node
over ``link``, across nodes over ``link_across``. Not counted: dequantization (memory-bound,
a few per cent of a layer's matmuls), the optimizer step and host-device copies of offload.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import zerocore
from neox.run.hardware import Link
from neox.run.planning import GiB, PlanRequest, plan_run
from neox.run.recipe import ShardingConfig

__all__ = ["DEFAULT_MFU", "Machine", "Candidate", "Row", "sent_bytes", "candidates", "evaluate",
           "ranked", "candidates_table", "recommendation", "auto_placement"]

# The fraction of the GPU's peak a step's matmuls reach (model FLOPs utilisation): a common
# figure for well-tuned dense training, stated rather than measured (``--mfu``).
DEFAULT_MFU = 0.4
# Step times within this fraction of each other are equally fast, for the choice.
TIE = 0.01
# Keep-gathered budgets tried on a sharded base, as fractions of the GPU's memory, then "all".
BUDGET_FRACTIONS = (0.125, 0.25)


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a step runs on: a GPU's memory (bytes) and peak (TFLOPS), the fraction of it the
    matmuls reach, and the links within a node and across nodes."""

    memory: int
    tflops: float
    link: Link
    link_across: Link | None = None
    mfu: float = DEFAULT_MFU

    def seconds(self, plan: zerocore.plan.MemoryPlan) -> tuple[float, float]:
        """(compute, communication) seconds of one step: FLOPs at ``mfu`` of the peak, bytes
        at the links' bandwidths. A step takes their sum (the module's docstring says why)."""
        within, across = sent_bytes(plan)
        comm = within / self.link.bytes_per_s
        if across:
            assert self.link_across is not None, "a plan across nodes needs link_across"
            comm += across / self.link_across.bytes_per_s
        return plan.flops / (self.mfu * self.tflops * 1e12), comm


def sent_bytes(plan: zerocore.plan.MemoryPlan) -> tuple[float, float]:
    """Bytes one rank sends per step (within a node, across nodes), as a ring sends them."""
    shards = plan.mesh[1] if plan.mesh is not None else plan.world_size
    group = (plan.all_gather_bytes + plan.reduce_scatter_bytes) * (shards - 1) / shards
    within, across = (0.0, group) if plan.mesh is None and plan.nodes > 1 else (group, 0.0)
    if plan.mesh is not None:
        replicas = plan.mesh[0]
        across += (replicas - 1) / replicas * (
            2 * plan.replica_all_reduce_bytes + plan.across_all_gather_bytes
            + plan.across_reduce_scatter_bytes)
    return within, across


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to hold the frozen base, with the run's other settings unchanged."""

    frozen_weights: str | None     # None: the compute dtype; else a zerocore.FROZEN_FORMATS
    frozen_placement: str          # zerocore.FROZEN_PLACEMENTS
    keep_gathered: int | str       # zerocore.Prefetch.keep_gathered
    recompute: tuple[int, ...]     # blocks recomputed

    def request(self, base: PlanRequest) -> PlanRequest:
        return dataclasses.replace(base, frozen_weights=self.frozen_weights,
                                   frozen_placement=self.frozen_placement,
                                   keep_gathered=self.keep_gathered, recompute=self.recompute)

    def words(self, blocks: int) -> str:
        budget = (self.keep_gathered if isinstance(self.keep_gathered, str)
                  else f"{self.keep_gathered / GiB:g}GiB")
        return (f"{self.frozen_weights or 'compute'} {self.frozen_placement}, keep-gathered "
                f"{budget}, {len(self.recompute)}/{blocks} recomputed")


@dataclasses.dataclass(frozen=True)
class Row:
    """A candidate's plan in the figures the choice is made from."""

    candidate: Candidate
    memory: int            # bytes per GPU at the peak (the plan's total, with its headroom)
    moved: int             # bytes per step as the plan counts collectives (unsharded buffers)
    wire: float            # bytes one rank sends per step (within and across nodes)
    compute_s: float
    comm_s: float
    fits: bool

    @property
    def seconds(self) -> float:
        return self.compute_s + self.comm_s


def _offload_word(request: PlanRequest) -> str | None:
    """The request's offload as --offload says it (the recipe's checks take that word)."""
    return {(False, False): None, (True, False): "optimizer", (False, True): "params",
            (True, True): "all"}[(request.offload, request.offload_params)]


def candidates(request: PlanRequest, memory: int) -> Iterator[list[list[Candidate]]]:
    """The candidates for ``request`` on GPUs of ``memory`` bytes, by frozen format and
    placement: a list of ladders, first without more recomputation than the request's, then
    with every kept block recomputed. Within a ladder each rung holds at least what the one
    before it holds (a larger keep-gathered budget). Combinations the recipe refuses
    (``ShardingConfig.problem``: a replicated base in the compute dtype, or with the
    parameters offloaded) are left out; a replicated base gathers nothing frozen, so it gets
    no budget beyond 0."""
    kept = request.filter_layers or tuple(range(request.config.num_hidden_layers))
    recomputes = [request.recompute] + ([kept] if request.recompute != kept else [])
    budgets = [0, *(int(f * memory) for f in BUDGET_FRACTIONS), "all"]
    offload = _offload_word(request)
    for fmt in (None, *zerocore.FROZEN_FORMATS):
        for placement in zerocore.FROZEN_PLACEMENTS:
            sharding = ShardingConfig(frozen_weights=fmt, frozen_placement=placement)
            if sharding.problem(offload=offload,
                                offload_device=request.offload_device) is not None:
                continue
            yield [[Candidate(fmt, placement, budget, recompute)
                    for budget in (budgets if placement == "sharded" else [0])]
                   for recompute in recomputes]


def evaluate(request: PlanRequest, machine: Machine,
             plan: Callable[[PlanRequest], zerocore.plan.MemoryPlan] = plan_run) -> list[Row]:
    """The candidates planned (``plan``: ``plan_run``, or a cache of it). A ladder is climbed
    while its rungs fit and the last one still moved bytes a larger budget could save (a
    larger one holds more and moves no less). Recomputation costs a forward and moves no
    fewer bytes, so its ladder is planned only when the one without it stopped on memory:
    what recomputation frees is worth something only then."""
    rows = []
    for ladders in candidates(request, machine.memory):
        for ladder in ladders:
            for candidate in ladder:
                rows.append(_row(candidate, plan(candidate.request(request)), machine))
                if not rows[-1].fits or rows[-1].moved == 0 or (
                        _rung_below(rows) and rows[-1].moved >= rows[-2].moved):
                    break
            if rows[-1].fits:
                break
    return rows


def _rung_below(rows: list[Row]) -> bool:
    """Whether the row before the last is the rung below it on the same ladder."""
    if len(rows) < 2:
        return False
    a, b = rows[-2].candidate, rows[-1].candidate
    return (a.frozen_weights, a.frozen_placement, a.recompute) == \
        (b.frozen_weights, b.frozen_placement, b.recompute)


def _row(candidate: Candidate, planned: zerocore.plan.MemoryPlan, machine: Machine) -> Row:
    compute_s, comm_s = machine.seconds(planned)
    moved = (planned.all_gather_bytes + planned.reduce_scatter_bytes
             + planned.replica_all_reduce_bytes + planned.across_all_gather_bytes
             + planned.across_reduce_scatter_bytes)
    return Row(candidate, planned.peak_bytes, moved, sum(sent_bytes(planned)), compute_s,
               comm_s, planned.peak_bytes <= machine.memory)


def auto_placement(request: PlanRequest, memory: int,
                   plan: Callable[[PlanRequest], zerocore.plan.MemoryPlan] = plan_run
                   ) -> tuple[str, str]:
    """``--frozen-placement auto``: the placement of the request's frozen base (its format,
    budget and recomputation as they are) and the line that says why. Both placements do the
    same arithmetic and replicated sends fewer bytes, so on any link the faster one that fits
    is replicated when it fits, sharded otherwise: the choice needs the GPU's ``memory``
    alone. When neither fits, the smaller (the run will say it does not fit, as it would)."""
    planned = {}
    for placement in zerocore.FROZEN_PLACEMENTS:
        sharding = ShardingConfig(frozen_weights=request.frozen_weights,
                                  frozen_placement=placement)
        if sharding.problem(offload=_offload_word(request),
                            offload_device=request.offload_device) is None:
            planned[placement] = plan(dataclasses.replace(request, frozen_placement=placement))
    fitting = [p for p, m in planned.items() if m.peak_bytes <= memory]
    pick = (min(fitting, key=lambda p: sum(sent_bytes(planned[p]))) if fitting
            else min(planned, key=lambda p: planned[p].peak_bytes))
    said = "; ".join(f"{p} {m.peak_bytes / GiB:.2f} GiB per rank, sends "
                     f"{sum(sent_bytes(m)) / 1e9:.3f} GB per step" for p, m in planned.items())
    verdict = ("the one that fits sending the fewest bytes" if fitting else
               f"neither fits in {memory / GiB:.2f} GiB: the smaller")
    return pick, (f"--frozen-placement auto: {pick} ({verdict}; planned: {said}; "
                  f"{memory / GiB:.2f} GiB per rank)")


def ranked(rows: list[Row]) -> list[Row]:
    """The rows that fit, fastest first. Times within ``TIE`` of each other are equally fast
    (the estimate is not finer than that): among those, the one sending fewer bytes (it loses
    least if the link is slower than its figure), then the one holding less memory."""
    fitting = sorted((r for r in rows if r.fits), key=lambda r: (r.seconds, r.wire, r.memory))
    if not fitting:
        return []
    tied = [r for r in fitting if r.seconds <= fitting[0].seconds * (1 + TIE)]
    return (sorted(tied, key=lambda r: (r.wire, r.memory))
            + [r for r in fitting if r not in tied])


def candidates_table(rows: list[Row], blocks: int) -> str:
    """The rows as aligned text (memory in GiB, bytes in GB, seconds per step)."""
    head = (f"  {'candidate':<58}{'GiB/GPU':>9}{'moved GB':>10}{'sent GB':>9}{'compute s':>11}"
            f"{'comm s':>9}{'step s':>9}  fits")
    return "\n".join([head] + [
        f"  {r.candidate.words(blocks):<58}{r.memory / GiB:9.2f}{r.moved / 1e9:10.2f}"
        f"{r.wire / 1e9:9.2f}{r.compute_s:11.3f}{r.comm_s:9.3f}{r.seconds:9.3f}  "
        f"{'yes' if r.fits else 'NO'}" for r in rows])


def recommendation(rows: list[Row], machine: Machine, blocks: int) -> str:
    """The line that says which candidate is recommended and why, or that none fits."""
    order = ranked(rows)
    if not order:
        least = min(rows, key=lambda r: r.memory)
        return (f"recommended: nothing: no candidate fits in {machine.memory / GiB:g} GiB (the "
                f"smallest, {least.candidate.words(blocks)}, needs {least.memory / GiB:.1f} "
                f"GiB); more GPUs, a shorter --seq-len or a smaller --batch-size would shrink it")
    best = order[0]
    why = (f"fits in {machine.memory / GiB:g} GiB ({best.memory / GiB:.1f} GiB), sends "
           f"{best.wire / 1e9:.2f} GB per GPU per step over {machine.link.name}, "
           f"{best.seconds:.2f} s a step")
    if len(order) > 1:
        nxt = order[1]
        why += (f", against {nxt.wire / 1e9:.2f} GB and {nxt.seconds:.2f} s for the next "
                f"({nxt.candidate.words(blocks)})")
    return f"recommended: {best.candidate.words(blocks)}: {why}"
