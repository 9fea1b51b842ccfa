"""The plan's choice of a layout for the frozen base: for each candidate (frozen format x
placement x keep-gathered budget x recomputation x offload), ``zerocore.plan`` of the run
(memory per GPU, bytes moved and floating-point work per step: the engine's own step on fake
tensors), a step time estimated from them, and the fastest candidate that fits the GPU (and
the host). ``neox.plan --link`` prints the table; ``neox.finetune --frozen-placement auto``
takes the choice.

The time model, stated once (``Machine.seconds``): a step takes its FLOPs at ``mfu`` of the
GPU's peak, PLUS the bytes each GPU sends at the link's bandwidth, PLUS the bytes it copies
between host and device (``host_bytes``: offload's) at the host link's (``link_host``). The
sum, not the largest: the engine prefetches only the next layer's gather, the collectives'
kernels take the GPU's cores from the matmuls, and what does not overlap (the first gather,
the last reduce-scatter, the optimizer step) is serial; the sum is the bound to plan a rental
with, and between candidates whose compute is the same it ranks them by their bytes, as
overlap would. Bytes on the wire are a ring's: a collective over N ranks of a buffer of S
bytes (how the plan counts it) sends (N - 1) / N x S from each rank (twice that for an
all-reduce); within a node over ``link``, across nodes over ``link_across``. Not counted:
dequantization (memory-bound, a few per cent of a layer's matmuls) and the optimizer step (on
the host when offloaded).

Offload candidates: none, the optimizer, the parameters, or both, in host memory
(``--offload-device cpu``). NVMe is not a candidate: its time is the disk's, which this
model does not know. An offloaded candidate fits when its GPU memory fits and, given
``host_memory``, the host memory of a node too (``neox.run.planning.fits``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import zerocore
from neox.run.hardware import LINKS, Link
from neox.run.planning import GiB, PlanRequest, fits, needs, plan_run
from neox.run.recipe import ShardingConfig

__all__ = ["DEFAULT_MFU", "OFFLOADS", "Machine", "Candidate", "Row", "sent_bytes", "host_bytes",
           "candidates", "evaluate",
           "ranked", "candidates_table", "recommendation", "auto_placement"]

# The fraction of the GPU's peak a step's matmuls reach (model FLOPs utilisation): a common
# figure for well-tuned dense training, stated rather than measured (``--mfu``).
DEFAULT_MFU = 0.4
# Step times within this fraction of each other are equally fast, for the choice.
TIE = 0.01
# Keep-gathered budgets tried on a sharded base, as fractions of the GPU's memory, then "all".
BUDGET_FRACTIONS = (0.125, 0.25)
# The offload candidates, as --offload says them (None: nothing), from the least traffic to the
# most, the order ties are broken in: less offload, fewer things that can go wrong.
OFFLOADS = (None, "optimizer", "params", "all")


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a step runs on: a GPU's memory (bytes) and peak (TFLOPS), the fraction of it the
    matmuls reach, the links within a node and across nodes, each GPU's link to the host, and
    a node's host memory (bytes; None: not limited) shared by its ``ranks_per_node``."""

    memory: int
    tflops: float
    link: Link
    link_across: Link | None = None
    mfu: float = DEFAULT_MFU
    link_host: Link = Link("pcie4", LINKS["pcie4"])
    host_memory: int | None = None
    ranks_per_node: int = 1

    def seconds(self, plan: zerocore.plan.MemoryPlan) -> tuple[float, float]:
        """(compute, communication) seconds of one step: FLOPs at ``mfu`` of the peak, bytes
        at the links' bandwidths. A step takes their sum (the module's docstring says why)."""
        if plan.flops is None:
            raise ValueError("a step time needs the plan's FLOPs: plan with count_flops=True")
        within, across = sent_bytes(plan)
        comm = within / self.link.bytes_per_s
        if across:
            assert self.link_across is not None, "a plan across nodes needs link_across"
            comm += across / self.link_across.bytes_per_s
        return plan.flops / (self.mfu * self.tflops * 1e12), comm


def host_bytes(plan: zerocore.plan.MemoryPlan, request: PlanRequest) -> int:
    """Bytes one rank copies between host and device per optimizer step under the request's
    offload, a stated model of what the homes copy (zerocore/engine/homes/; the plan counts
    none of these). Every shard figure is the plan's own (``plan.state``: this rank's bytes,
    padded, in the dtype they are stored in), so a quantized base counts its packed bytes and
    a replicated one all of them. Not subtracted: the layer ``Prefetch.keep_last`` keeps
    gathered from its forward to its backward (an upper bound by one layer's copy per
    micro-batch). Parameter offload is planned with no keep-gathered budget (``candidates``)."""
    s, micro = plan.state, request.grad_accum
    blocks = len(request.filter_layers or range(request.config.num_hidden_layers))
    # Uses of each unit's weights per micro-batch: its forward, its backward, and the
    # recomputed forward of the recomputed blocks (as a share of all the shards: the root, the
    # embedding and the head, is never recomputed, so this rounds up).
    uses = 2 + len(plan.recomputed_layers) / blocks
    copied = 0
    if request.offload:
        # The optimizer on the host: each micro-batch's reduce-scattered gradient shard goes
        # down in the reduce dtype (engine/backward.py), to be added into the host's fp32
        # gradient (``s.gradients``: 4 bytes an element of the shard) and stepped there.
        copied += s.gradients // 4 * request.reduce_dtype.itemsize * micro
        if not request.offload_params:
            # The updated model copy goes up once per step into the device's mirror
            # (homes/host_mirror.py: ``s.mirrors``, param dtype).
            copied += s.mirrors
    if request.offload_params:
        # The frozen shards live on the host (a replicated base: the whole quantized base,
        # homes/replicated.py's HostReplicated): each use uploads them (``s.frozen_params``).
        copied += int(s.frozen_params * uses * micro)
        if request.offload:
            # With the optimizer on the host too, each use uploads the trainable model copy
            # (homes/host_window.py's HostWindow; the updated copy has no other way up). Alone,
            # each window is rounded on the device from its master (RoundedWindow; in fp32 the
            # master itself is gathered): nothing is copied.
            copied += int(s.trainable_params * uses * micro)
    return copied


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
    offload: str | None = None     # OFFLOADS: --offload's word, in host memory

    def request(self, base: PlanRequest, count_flops: bool = True) -> PlanRequest:
        return dataclasses.replace(base, frozen_weights=self.frozen_weights,
                                   frozen_placement=self.frozen_placement,
                                   keep_gathered=self.keep_gathered, recompute=self.recompute,
                                   offload=self.offload in ("optimizer", "all"),
                                   offload_params=self.offload in ("params", "all"),
                                   offload_device="cpu", count_flops=count_flops)

    def words(self, blocks: int) -> str:
        budget = (self.keep_gathered if isinstance(self.keep_gathered, str)
                  else f"{self.keep_gathered / GiB:g}GiB")
        return (f"{self.frozen_weights or 'compute'} {self.frozen_placement}, keep-gathered "
                f"{budget}, {len(self.recompute)}/{blocks} recomputed, "
                f"{'offload ' + self.offload if self.offload else 'no offload'}")


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
    host: int = 0          # bytes one rank copies between host and device per step
    host_s: float = 0.0    # ... at the host link's bandwidth
    host_memory: int = 0   # host bytes per node at the peak (the offloaded state)

    @property
    def seconds(self) -> float:
        return self.compute_s + self.comm_s + self.host_s


def _offload_word(request: PlanRequest) -> str | None:
    """The request's offload as --offload says it (the recipe's checks take that word)."""
    return {(False, False): None, (True, False): "optimizer", (False, True): "params",
            (True, True): "all"}[(request.offload, request.offload_params)]


def candidates(request: PlanRequest, memory: int) -> Iterator[list[list[list[Candidate]]]]:
    """The candidates for ``request`` on GPUs of ``memory`` bytes, by frozen format and
    placement: for each of ``OFFLOADS`` (in host memory, whatever the request's offload; on
    CPU ranks none, whose host is their device: offload frees nothing of it) a
    list of ladders, first without more recomputation than the request's, then with every
    kept block recomputed. Within a ladder each rung holds at least what the one before it
    holds (a larger keep-gathered budget). Combinations the recipe refuses
    (``ShardingConfig.problem``: a replicated base in the compute dtype) are left out; a
    replicated base gathers nothing frozen, and offloaded parameters are copied up for each
    use (``host_bytes``), so neither gets a budget beyond 0."""
    kept = request.filter_layers or tuple(range(request.config.num_hidden_layers))
    recomputes = [request.recompute] + ([kept] if request.recompute != kept else [])
    budgets = [0, *(int(f * memory) for f in BUDGET_FRACTIONS), "all"]
    for fmt in (None, *zerocore.FROZEN_FORMATS):
        for placement in zerocore.FROZEN_PLACEMENTS:
            levels = []
            for offload in OFFLOADS if request.device == "cuda" else (None,):
                sharding = ShardingConfig(frozen_weights=fmt, frozen_placement=placement)
                if sharding.problem(offload=offload, offload_device="cpu") is not None:
                    continue
                tried = (budgets if placement == "sharded" and offload not in ("params", "all")
                         else [0])
                levels.append([[Candidate(fmt, placement, budget, recompute, offload)
                                for budget in tried] for recompute in recomputes])
            if levels:
                yield levels


def evaluate(request: PlanRequest, machine: Machine,
             plan: Callable[[PlanRequest], zerocore.plan.MemoryPlan] = plan_run,
             progress: Callable[[str], None] = lambda line: None) -> list[Row]:
    """The candidates planned (``plan``: ``plan_run``, or a cache of it), each named to
    ``progress`` before it is (a large model's rehearsal takes seconds to a minute each, and
    there may be dozens: the command says where it is). A ladder is climbed
    while its rungs fit and the last one still moved bytes a larger budget could save (a
    larger one holds more and moves no less). Recomputation costs a forward and moves no
    fewer bytes, so its ladder is planned only when the one without it stopped on memory:
    what recomputation frees is worth something only then. Offload likewise costs copies and
    saves nothing but memory: a larger offload is planned only while the smaller one's first
    rung (no added recomputation) does not fit."""
    rows = []
    blocks = len(request.filter_layers or range(request.config.num_hidden_layers))
    counted: dict[tuple[int, ...], int] = {}   # a step's FLOPs, by the blocks it recomputes
    for levels in candidates(request, machine.memory):
        for ladders in levels:
            for ladder in ladders:
                for candidate in ladder:
                    progress(f"planning layout {len(rows) + 1}: {candidate.words(blocks)}")
                    rows.append(_row(candidate, _planned(candidate, request, plan, counted),
                                     machine, request))
                    if not rows[-1].fits or rows[-1].moved == 0 or (
                            _rung_below(rows) and rows[-1].moved >= rows[-2].moved):
                        break
                if rows[-1].fits:
                    break
            if any(r.fits for r in rows if r.candidate == ladders[0][0]):
                break
    return rows


def _planned(candidate: Candidate, base: PlanRequest,
             plan: Callable[[PlanRequest], zerocore.plan.MemoryPlan],
             counted: dict[tuple[int, ...], int]) -> zerocore.plan.MemoryPlan:
    """The candidate's plan, its FLOPs counted by the first candidate that recomputes the same
    blocks (``counted``) and taken from it by the others: torch's counter costs a quarter to a
    third of a plan, and it counts only matmuls and attention, which no other choice of a
    candidate changes (where the frozen base lives and in which format: its dequantization is
    zerocore's kernel, uncounted, before the same matmul; the budget kept gathered; what is
    offloaded, whose Adam is zerocore's kernel too). tests/neox/test_neox_layout_choice.py
    checks the reused figures against counted ones."""
    known = counted.get(candidate.recompute)
    if known is None:
        planned = plan(candidate.request(base))
        counted[candidate.recompute] = planned.flops
        return planned
    return dataclasses.replace(plan(candidate.request(base, count_flops=False)), flops=known)


def _rung_below(rows: list[Row]) -> bool:
    """Whether the row before the last is the rung below it on the same ladder."""
    if len(rows) < 2:
        return False
    a, b = rows[-2].candidate, rows[-1].candidate
    return (a.frozen_weights, a.frozen_placement, a.recompute, a.offload) == \
        (b.frozen_weights, b.frozen_placement, b.recompute, b.offload)


def _row(candidate: Candidate, planned: zerocore.plan.MemoryPlan, machine: Machine,
         base: PlanRequest) -> Row:
    compute_s, comm_s = machine.seconds(planned)
    moved = (planned.all_gather_bytes + planned.reduce_scatter_bytes
             + planned.replica_all_reduce_bytes + planned.across_all_gather_bytes
             + planned.across_reduce_scatter_bytes)
    copied = host_bytes(planned, candidate.request(base))
    need = needs(planned, machine.ranks_per_node)
    fit = planned.peak_bytes <= machine.memory and fits(need, planned.device, machine.memory,
                                                        machine.host_memory)
    return Row(candidate, planned.peak_bytes, moved, sum(sent_bytes(planned)), compute_s,
               comm_s, fit, copied, copied / machine.link_host.bytes_per_s, need[1])


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
    (the estimate is not finer than that): among those, the one offloading less (fewer
    things that can go wrong: ``OFFLOADS``' order), then the one sending fewer bytes (it loses
    least if the link is slower than its figure), then the one holding less memory."""
    fitting = sorted((r for r in rows if r.fits), key=lambda r: (r.seconds, r.wire, r.memory))
    if not fitting:
        return []
    tied = [r for r in fitting if r.seconds <= fitting[0].seconds * (1 + TIE)]
    return (sorted(tied, key=lambda r: (OFFLOADS.index(r.candidate.offload), r.wire, r.memory))
            + [r for r in fitting if r not in tied])


def candidates_table(rows: list[Row], blocks: int) -> str:
    """The rows as aligned text (memory in GiB, bytes in GB, seconds per step; host: the bytes
    copied between host and device, and the host memory per node)."""
    head = (f"  {'candidate':<50}{'offload':>10}{'GiB/GPU':>9}{'host GiB':>9}{'moved GB':>10}"
            f"{'sent GB':>9}{'host GB':>9}{'compute s':>11}{'comm s':>9}{'host s':>9}"
            f"{'step s':>9}  fits")
    return "\n".join([head] + [
        f"  {_layout_words(r.candidate, blocks):<50}{r.candidate.offload or 'none':>10}"
        f"{r.memory / GiB:9.2f}{r.host_memory / GiB:9.2f}{r.moved / 1e9:10.2f}"
        f"{r.wire / 1e9:9.2f}{r.host / 1e9:9.2f}{r.compute_s:11.3f}{r.comm_s:9.3f}"
        f"{r.host_s:9.3f}{r.seconds:9.3f}  {'yes' if r.fits else 'NO'}" for r in rows])


def _layout_words(candidate: Candidate, blocks: int) -> str:
    """The candidate's words without its offload (the table's column of its own)."""
    return candidate.words(blocks).rsplit(", ", 1)[0]


def recommendation(rows: list[Row], machine: Machine, blocks: int) -> str:
    """The line that says which candidate is recommended and why, or that none fits."""
    order = ranked(rows)
    if not order:
        least = min(rows, key=lambda r: r.memory)
        return (f"recommended: nothing: no candidate fits in {machine.memory / GiB:g} GiB (the "
                f"smallest, {least.candidate.words(blocks)}, needs {least.memory / GiB:.1f} "
                f"GiB); more GPUs, a shorter --seq-len or a smaller --batch-size would shrink it")
    best = order[0]
    host = ("" if machine.host_memory is None else
            f" and the host's {machine.host_memory / GiB:g} GiB per node "
            f"({best.host_memory / GiB:.1f} GiB)")
    why = (f"fits in {machine.memory / GiB:g} GiB ({best.memory / GiB:.1f} GiB){host}, sends "
           f"{best.wire / 1e9:.2f} GB per GPU per step over {machine.link.name}"
           + (f" and copies {best.host / 1e9:.2f} GB over {machine.link_host.name} to and from "
              f"the host" if best.host else "") + f", {best.seconds:.2f} s a step")
    if len(order) > 1:
        nxt = order[1]
        why += (f", against {nxt.wire / 1e9:.2f} GB and {nxt.seconds:.2f} s for the next "
                f"({nxt.candidate.words(blocks)})")
    return f"recommended: {best.candidate.words(blocks)}: {why}"
