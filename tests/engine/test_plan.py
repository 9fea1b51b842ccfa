"""``zerocore.plan`` / ``neox.plan`` against measurement: the peak bytes a real training step
holds on each CPU rank (model state measured from the tensors, plus the most bytes allocated at
once during two steps, ``zerocore.PeakMemory``) match the plan made from shapes alone, for
neox's model in several configurations (recomputation on and off, CPU offload, LoRA, biases,
gradient accumulation, world sizes 1-3) and for a stack of plain modules; the traffic per step
is what the engine counts; ``python -m neox.plan`` prints it for GPT-NeoX-20B and refuses bad
input in one line."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import zerocore
from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import layer_specs
from neox.run.planning import PlanRequest, plan_run
from neox.plan import main as plan_main
from neox.run.recipe import ShardingConfig
from neox.run.step import micro_batch_loss
from neox.weights import RandomInit, materialize
from tests.support.neox_testing import call_main
from zerocore.comm import collectives, quantized_reduce
from zerocore.comm.collectives import CommCounter
from zerocore.comm.fake import fake_group
from zerocore.comm.peer_memory import READ_CHUNK_BYTES
from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.meta_layer import READ_PIECE_NUMEL
from zerocore.engine.sharded_layer import _held_values
from zerocore.plan import _LoadingRead
from zerocore.planning.live_bytes import LiveBytes

# Big enough that the step's tensors (~10-60 MiB) dwarf anything the plan does not count
# (Python objects are not tensors; the profiler sees only torch's allocator).
CONFIG = NeoXConfig(vocab_size=2048, hidden_size=128, num_hidden_layers=3,
                    num_attention_heads=4, intermediate_size=512)
BATCH, SEQ = 4, 64
# The plan is the engine's own step on fake tensors, following its allocations one by one:
# measured agreement is within 0.1% on these runs. 2%, issue 29's bound, catches a layer's
# activations or a gathered layer left out (each 8% or more of these totals) with a wide margin.
REL_TOL = 0.02


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str = "full"
    dtype: torch.dtype = torch.float32
    recompute: tuple[int, ...] = ()      # blocks
    every: int = 1
    offload: bool = False
    grad_accum: int = 1
    world_size: int = 2
    frozen_weights: str | None = None
    frozen_placement: str = "sharded"

    def request(self) -> PlanRequest:
        return PlanRequest(config=CONFIG, filter_layers=None,
                           mode=FinetuneMode(self.mode, lora_rank=4), dtype=self.dtype,
                           reduce_dtype=torch.float32, batch_size=BATCH, seq_len=SEQ,
                           grad_accum=self.grad_accum, offload=self.offload,
                           recompute=self.recompute, recompute_every=self.every,
                           world_size=self.world_size, device="cpu",
                           frozen_weights=self.frozen_weights,
                           frozen_placement=self.frozen_placement)


CASES = {
    "full-fp32": Case(),
    "full-fp32-recompute": Case(recompute=(0, 1, 2)),
    "lora-bf16-offload": Case(mode="lora", dtype=torch.bfloat16, offload=True),
    "full-bf16-offload-recompute": Case(dtype=torch.bfloat16, offload=True, recompute=(0, 1, 2)),
    "biases-bf16-recompute-every-2-accumulate": Case(mode="biases", dtype=torch.bfloat16,
                                                     recompute=(0, 1, 2), every=2, grad_accum=2),
    "full-fp32-ws1": Case(world_size=1),
    "lora-fp32-recompute-ws3": Case(mode="lora", recompute=(1,), world_size=3),
    # The layout neox.plan recommends for a big base on few GPUs (issue 41): LoRA over a
    # replicated NF4 base, at every world size.
    **{f"lora-bf16-nf4-replicated-ws{n}": Case(mode="lora", dtype=torch.bfloat16,
                                               world_size=n, frozen_weights="nf4",
                                               frozen_placement="replicated")
       for n in (1, 2, 3)},
}


def arena_bytes(sharding) -> int:
    """Offload's host arena (engine/host_arena.py): memory the model holds from its build on,
    mapped outside torch's allocator, so PeakMemory's count does not see it; added to it."""
    arena = sharding.ctx.arena
    return 0 if arena is None else arena.used


def measure(rank: int, world_size: int, case: Case) -> dict:
    """A neox training step as neox.run.training runs it; the peak bytes of two steps (everything
    allocated since before the model was built)."""
    with zerocore.PeakMemory("cpu") as peak:
        result = _measure(case, rank, peak)
    return dict(result, measured=peak.peak_bytes + result.pop("arena"))


def _measure(case: Case, rank: int, peak: zerocore.PeakMemory) -> dict:
    reader = RandomInit(CONFIG, seed=1)
    specs = layer_specs(CONFIG)
    mode = FinetuneMode(case.mode, lora_rank=4)
    sharding = ShardingConfig(activation_checkpointing=case.recompute,
                      activation_checkpointing_every=case.every)
    model = zerocore.shard((prepare_layer(materialize(reader, s), i, mode)
                            for i, s in enumerate(specs)),
                           mixed_precision=zerocore.MixedPrecision(case.dtype, torch.float32),
                           offload=zerocore.Offload(optimizer=case.offload),
                           frozen_weights=zerocore.FrozenWeights(
                               case.frozen_weights, placement=case.frozen_placement),
                           recompute=sharding.recompute(specs))
    opt = zerocore.optim.AdamW(model.trainable_shards(), lr=1e-3)
    scaler = zerocore.LossScaler(model.group, dynamic=False, counter=model.counter)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        for _ in range(case.grad_accum):
            ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g)
            loss, correct = micro_batch_loss(model(ids[:, :-1]), ids[:, 1:])
            scaler.scale(loss / case.grad_accum).backward()
            del loss, correct
        scaler.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)

    step()  # the first step: nothing is created lazily any more
    state = model.memory_report(opt).model_state_bytes
    model.comm_report(reset=True)
    peak.mark()
    step()
    step()
    comm = model.comm_report()
    return {"state": state, "arena": arena_bytes(model),
            "all_gather": comm.all_gather_bytes // 2, "reduce": comm.reduce_scatter_bytes // 2}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_measured_peak(worlds, name):
    case = CASES[name]
    plan = plan_run(case.request())
    for rank, got in enumerate(worlds(case.world_size).run(measure, case)):
        ratio = plan.device_peak / got["measured"]
        assert abs(ratio - 1) < REL_TOL, (rank, ratio, got, plan.table())
        # Model state is counted exactly (from the same layouts).
        planned_state = sum(plan.state.bytes_of().values()) - plan.state.gradients
        assert planned_state == got["state"], (planned_state, got["state"])
        assert (plan.all_gather_bytes, plan.reduce_scatter_bytes) == \
            (got["all_gather"], got["reduce"])


def test_recomputation_lowers_the_planned_and_measured_peak(worlds):
    """The comparison the plan is for: with recomputation both fall, by about as much."""
    plain, again = CASES["full-fp32"], CASES["full-fp32-recompute"]
    measured = [worlds(2).run(measure, c)[0]["measured"] for c in (plain, again)]
    planned = [plan_run(c.request()).device_peak for c in (plain, again)]
    assert measured[1] < measured[0] and planned[1] < planned[0]
    saved_measured, saved_planned = measured[0] - measured[1], planned[0] - planned[1]
    assert abs(saved_planned / saved_measured - 1) < 0.1, (saved_planned, saved_measured)


# -- any stack of modules ------------------------------------------------------------------------

D, VOCAB = 96, 500


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2)
                   for t in self.qkv(self.ln(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(B, T, C)
        return x + self.mlp(x)


def plain_stack(device: str | None = None) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Embedding(VOCAB, D, device=device), Block().to(device), Block().to(device),
            nn.Linear(D, VOCAB, device=device)]


def plain_loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), torch.zeros(out.shape[:2], dtype=torch.long,
                                                          device=out.device).flatten())


# Stacks beyond neox's: (recompute every layer, Prefetch.keep_gathered, embedding frozen,
# FrozenWeights dtype, and its placement when not sharded).
PLAIN = {"kept": (False, 0, False, None), "recomputed": (True, 0, False, None),
         "keep-gathered-all-frozen-embedding": (False, "all", True, None),
         "keep-gathered-budget": (False, 2 * 4 * 13 * D * D, False, None),  # 3 of 4 layers
         "int8-frozen-embedding": (False, 0, True, "int8"),
         "int8-keep-gathered-all": (False, "all", True, "int8"),
         "fp8-frozen-embedding": (False, 0, True, "fp8"),
         "nf4-replicated-frozen-embedding": (False, 0, True, "nf4", "replicated")}


def plain_policies(name: str, layers: list[nn.Module]) -> dict:
    """shard()'s policies for a PLAIN configuration (and freezes what it freezes)."""
    recompute, keep, frozen_embedding, frozen_dtype, *placement = PLAIN[name]
    if frozen_embedding:
        layers[0].requires_grad_(False)
    return dict(recompute=zerocore.Recompute() if recompute else None,
                prefetch=zerocore.Prefetch(keep_gathered=keep),
                frozen_weights=zerocore.FrozenWeights(frozen_dtype, placement=(placement or
                                                                               ["sharded"])[0]))


def measure_plain(rank: int, world_size: int, name: str) -> int:
    with zerocore.PeakMemory("cpu") as peak:
        _train_plain(name, peak)
    return peak.peak_bytes


def _train_plain(name: str, peak: zerocore.PeakMemory) -> None:
    layers = plain_stack()
    train_stack(zerocore.shard(layers, **plain_policies(name, layers)), peak, steps=1)


def train_stack(model: nn.Module, peak: zerocore.PeakMemory, steps: int,
                micro_batches: int = 1) -> None:
    """A first step (nothing is created lazily after it), the peak's mark, then ``steps``
    more steps of the stack's loss with zerocore's AdamW, each of ``micro_batches``."""
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        for _ in range(micro_batches):
            plain_loss(model(torch.zeros(BATCH, SEQ, dtype=torch.long))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    peak.mark()
    for _ in range(steps):
        step()


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_plan_of_any_stack_from_meta_layers(worlds, name):
    layers = plain_stack("meta")
    plan = zerocore.plan.plan(layers, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=2, loss=plain_loss, device="cpu",
                              **plain_policies(name, layers))
    for measured in worlds(2).run(measure_plain, name):
        assert abs(plan.device_peak / measured - 1) < REL_TOL, (plan.table(), measured)


# -- a large layer among small ones (issue 18): what the transport keeps from step to step -------
# On 2 CPU ranks the on-host transport reads the peer's gradient contribution into one buffer it
# keeps between steps, as large as the largest shard reduced so far (5-7% of these totals); the
# exchange (ranks that may not read each other) holds the peer's half instead, per reduction in
# flight. The plan asks the transport (comm/transport.py) what each way holds.
#
# 2%, the bound. Measured (the smallest peak of the runs, see measure_mixed), the plan
# being the engine's own step on fake tensors (issue 29): 0.9997-0.9998 in fp32 and bf16, with
# and without offload, the exchange and keep-gathered, at 2 and 3 ranks, both front doors. The
# rest is what fake tensors never run: kernels' own workspaces.
MIXED_TOL = 0.02
# With recomputation the planned peak falls short by a little more (measured 0.9947-0.9965,
# both front doors): the step then runs the bf16 matmuls of a layer's forward again inside its
# backward, whose kernel workspaces fake tensors do not see either. How large those are is the
# CPU's: 0.9947-0.9965 on an AMD EPYC, 0.978-0.979 in bf16 at 3 ranks on an Intel Xeon
# (2026-12-03), whose oneDNN bf16 kernels convert through larger scratch buffers. 3% holds both;
# a layer's activations left out would still be 8% or more.
MIXED_RECOMPUTE_TOL = 0.03
MIXED = {"bf16": (torch.bfloat16, False, zerocore.Comm(), {}),
         "bf16-offload": (torch.bfloat16, True, zerocore.Comm(), {}),
         "fp32": (torch.float32, False, zerocore.Comm(), {}),
         "bf16-exchange": (torch.bfloat16, False, zerocore.Comm(peer_read="off"), {}),
         "bf16-recompute": (torch.bfloat16, False, zerocore.Comm(),
                            {"recompute": zerocore.Recompute()}),

         "bf16-keep-gathered": (torch.bfloat16, False, zerocore.Comm(),
                                {"prefetch": zerocore.Prefetch(keep_gathered="all")})}


# The cases measured: bf16 at 2 and 3 ranks (the transport keeps one received buffer at 2
# ranks, two from 3 on: the plan asks it, test_the_plan_asks_the_transport_what_it_keeps), the
# exchange at 2 (without reading, 3 ranks add nothing the 2 do not), each other variant at 3, the
# stricter count (uneven splits of the large layer): what a variant adds to the peak (fp32's
# sizes, offload's mirrors, recomputation, kept layers) does not depend on the count of ranks
# beyond the shard sizes, which the plan divides alike (CI time: each case measures 2 runs on
# every rank).
MIXED_CASES = [("bf16", 2), ("bf16-exchange", 2),
               *((name, 3) for name in MIXED if name != "bf16-exchange")]


def mixed_stack(device: str | None = None) -> list[nn.Module]:
    torch.manual_seed(0)
    small = [nn.Sequential(nn.Linear(D, D, device=device), nn.GELU()) for _ in range(8)]
    large = nn.Sequential(nn.Linear(D, 16 * D, device=device), nn.GELU(),
                          nn.Linear(16 * D, D, device=device))
    return [nn.Embedding(VOCAB, D, device=device), *small[:4], large, *small[4:],
            nn.Linear(D, VOCAB, device=device)]


# Recomputation in fp32 too, for the accumulated step below.
MORE_MIXED = {"fp32-recompute": (torch.float32, False, zerocore.Comm(),
                                 {"recompute": zerocore.Recompute()})}


def mixed_policies(name: str) -> dict:
    dtype, offload, comm, others = (MIXED | MORE_MIXED)[name]
    return dict(mixed_precision=zerocore.MixedPrecision(dtype, torch.float32),
                offload=zerocore.Offload(optimizer=offload), comm=comm, **others)


# Runs measured per rank (measure_mixed): the smallest peak of every rank's runs is the step's.
# An over-counted run (below) was seen on 1 run in 4 at 3 ranks, one rank at a time, so two runs
# on each of 2 or 3 ranks leave 4-6 chances for a sound one; with accumulation, where each
# micro-batch is one more chance of an outlier, three.
RUNS = 2
ACCUMULATED_RUNS = 3


def measure_mixed(rank: int, world_size: int, name: str, micro_batches: int = 1,
                  runs: int = RUNS) -> list[int]:
    """The peaks of ``runs`` runs. The CPU's count can only over-count: a buffer gloo's worker
    thread lets go of last (it may still hold a finished collective's tensors when the engine
    drops them) is freed on that thread, which torch's profiler does not follow, so its bytes
    stay counted (PeakMemory's docstring). Seen on 1 run in 4 at 3 ranks, adding one buffer's
    bytes (up to 19% here). Every rank runs the same step on shards of one size, so the
    smallest peak of all runs on all ranks is the step's own (see peak_of)."""
    peaks = []
    for _ in range(runs):
        with zerocore.PeakMemory("cpu") as peak:
            model = zerocore.shard(mixed_stack(), **mixed_policies(name))
            train_stack(model, peak, steps=2, micro_batches=micro_batches)
        peaks.append(peak.peak_bytes + arena_bytes(model))
    return peaks


def peak_of(runs: list[list[int]]) -> int:
    """The step's peak from every rank's runs (measure_mixed): the smallest."""
    return min(min(peaks) for peaks in runs)


@pytest.mark.parametrize("name, world_size", MIXED_CASES)
def test_plan_of_a_large_layer_among_small_ones(worlds, name, world_size):
    layers = mixed_stack("meta")
    plan = zerocore.plan.plan(layers, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=world_size, loss=plain_loss, device="cpu",
                              **mixed_policies(name))
    tolerance = MIXED_RECOMPUTE_TOL if "recompute" in name else MIXED_TOL
    runs = worlds(world_size).run(measure_mixed, name)
    ratio = plan.device_peak / peak_of(runs)
    assert abs(ratio - 1) < tolerance, (ratio, runs, plan.table())


# Issue 40, item 2: where recomputation, an accumulation of 3 micro-batches and a layer far larger
# than the others (uneven splits at 3 ranks) meet, a rank measured 0.685 of the plan. Measured
# again (2026-12-06, a fresh set of ranks per run, fp32 and bf16, the large layer first, in the
# middle or last): 0.96-0.99 on every rank whose measurement was sound, and the outliers
# (0.82-0.92, a rank at a time, never the same one twice) each ended their run holding exactly
# one packed-gradient buffer more than the other ranks: a buffer freed on gloo's worker thread,
# which the profiler does not see (PeakMemory's docstring, measure_mixed's). Each micro-batch's
# backward is one more chance for that, hence more outliers with accumulation. The plan rehearses
# two micro-batches (a third holds nothing the second does not). 5%, the bound: kernel
# workspaces with recomputation take up to 3% (MIXED_RECOMPUTE_TOL), a layer's activations
# left out would be 8% or more.
ACCUMULATED_TOL = 0.05


# Both dtypes at 3 ranks, where the case was (uneven splits); bf16 at 2 too (CI time).
@pytest.mark.parametrize("world_size, name", [(2, "bf16-recompute"), (3, "fp32-recompute"),
                                              (3, "bf16-recompute")])
def test_plan_of_a_large_layer_with_recomputation_and_accumulation(worlds, name, world_size):
    layers = mixed_stack("meta")
    policies = mixed_policies(name)
    plan = zerocore.plan.plan(layers, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=world_size, loss=plain_loss, device="cpu",
                              micro_batches=3, **policies)
    runs = worlds(world_size).run(measure_mixed, name, 3, ACCUMULATED_RUNS)
    ratio = plan.device_peak / peak_of(runs)
    assert abs(ratio - 1) < ACCUMULATED_TOL, (ratio, runs, plan.table())


class MixedModel(nn.Module):
    """The same stack as a model for ``shard_model``: the embedding and head in the root, the
    others units."""

    def __init__(self, device: str | None = None):
        super().__init__()
        stack = mixed_stack(device)
        self.embed, self.layers, self.head = stack[0], nn.ModuleList(stack[1:-1]), stack[-1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def measure_mixed_model(rank: int, world_size: int, name: str) -> list[int]:
    """As measure_mixed, through shard_model."""
    peaks = []
    for _ in range(RUNS):
        with zerocore.PeakMemory("cpu") as peak:
            model = MixedModel()
            sharding = zerocore.shard_model(model, model.layers, **mixed_policies(name))
            train_stack(model, peak, steps=2)
        peaks.append(peak.peak_bytes + arena_bytes(sharding))
    return peaks


# The same bounds and the same causes as for the stack (measured the same: 0.9947-0.9998).
@pytest.mark.parametrize("name, world_size", MIXED_CASES)
def test_plan_model_of_a_large_layer_among_small_ones(worlds, name, world_size):
    model = MixedModel("meta")
    plan = zerocore.plan.plan_model(model, model.layers,
                                    torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                                    world_size=world_size, loss=plain_loss, device="cpu",
                                    **mixed_policies(name))
    tolerance = MIXED_RECOMPUTE_TOL if "recompute" in name else MIXED_TOL
    runs = worlds(world_size).run(measure_mixed_model, name)
    ratio = plan.device_peak / peak_of(runs)
    assert abs(ratio - 1) < tolerance, (ratio, runs, plan.table())


def traffic_of_mixed_model(rank: int, world_size: int, name: str) -> tuple[int, int]:
    """Bytes all-gathered and reduce-scattered by one step of shard_model after the first (which
    also gathers resident groups)."""
    model = MixedModel()
    sharding = zerocore.shard_model(model, model.layers, **mixed_policies(name))
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        if step == 1:
            sharding.comm_report(reset=True)
        plain_loss(model(torch.zeros(BATCH, SEQ, dtype=torch.long))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = sharding.comm_report()
    return report.all_gather_bytes, report.reduce_scatter_bytes


@pytest.mark.parametrize("name", ["bf16", "bf16-keep-gathered", "bf16-recompute"])
def test_plan_model_traffic_is_what_shard_model_moves(worlds, name):
    model = MixedModel("meta")
    plan = zerocore.plan.plan_model(model, model.layers,
                                    torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                                    world_size=2, loss=plain_loss, device="cpu",
                                    **mixed_policies(name))
    for moved in worlds(2).run(traffic_of_mixed_model, name):
        assert moved == (plan.all_gather_bytes, plan.reduce_scatter_bytes)


def test_plan_model_refuses_what_shard_model_refuses():
    model = MixedModel("meta")
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="is not a submodule of the model"):
        zerocore.plan.plan_model(model, [nn.Linear(2, 2)], ids, world_size=2, device="cpu")
    with pytest.raises(ValueError, match="units must not nest"):
        zerocore.plan.plan_model(model, [model.layers[4], model.layers[4][0]], ids,
                                 world_size=2, device="cpu")

    class Named(nn.Module):   # an output with no loss: the plan needs to be told the loss
        def __init__(self):
            super().__init__()
            self.inner = MixedModel("meta")

        def forward(self, ids: torch.Tensor) -> dict:
            return {"logits": self.inner(ids)}

    named = Named()
    with pytest.raises(ValueError, match="pass loss="):
        zerocore.plan.plan_model(named, named.inner.layers, ids, world_size=2, device="cpu")
    assert model.layers[0][0].weight.device.type == "meta"   # the caller's model is left as is


def test_the_plan_asks_the_transport_what_it_keeps():
    """Reading keeps a buffer between steps (a piece of the largest shard, fp32: at most
    ``READ_CHUNK_BYTES``); the exchange holds the peer's half of the reduction in flight
    instead (at the peak, in the large layer's backward, the small layer's after it): the plans
    differ by that, and a way that cannot apply is refused as shard refuses it."""
    example = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    peaks = {peer_read: zerocore.plan.plan(mixed_stack("meta"), example, world_size=2,
                                           loss=plain_loss, device="cpu",
                                           comm=zerocore.Comm(peer_read=peer_read)).device_peak
             for peer_read in ("auto", "off")}
    largest_shard, small_shard = (D * 16 * D * 2 + 16 * D + D) // 2 * 4, (D * D + D) // 2 * 4
    kept = min(largest_shard, READ_CHUNK_BYTES)
    assert peaks["auto"] - peaks["off"] == pytest.approx(kept - small_shard, rel=0.01)
    with pytest.raises(ValueError, match="exactly two gloo ranks"):
        zerocore.plan.plan(mixed_stack("meta"), example, world_size=3, device="cpu",
                           comm=zerocore.Comm(reduce="exchange"))


def loaded_in_pieces(pieces: int, fake: bool) -> tuple[list[int], int]:
    """The reads of a bf16 parameter of ``pieces`` read pieces (the last 5 elements short)
    by the engine's loading (``_held_values``) into fp32 values, through the plan's reader
    when ``fake``, else a real one; and the most bytes held beside the values and the reader's
    buffer at once (fake only: the plan's count, ``LiveBytes``)."""
    numel = pieces * READ_PIECE_NUMEL - 5
    module = nn.Module()
    module.w = nn.Parameter(torch.empty(numel, dtype=torch.bfloat16, device="meta"))
    layout = FlatLayout.build([("w", (numel,))], 1)
    reads: list[int] = []
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        reader = _LoadingRead(module) if fake else (
            lambda name, a, b: torch.zeros(b - a, dtype=torch.bfloat16))

    def read(name: str, a: int, b: int) -> torch.Tensor:
        reads.append(b - a)
        return reader(name, a, b)
    if not fake:
        _held_values([("w", module.w)], layout, (0, numel), torch.float32, read)
        return reads, 0
    tracker = LiveBytes(lambda live: None)
    with mode, tracker:
        tracker.open_window()
        values = _held_values([("w", module.w)], layout, (0, numel), torch.float32, read)
        transient = tracker.close_window() - tracker.live
    del values
    return reads, transient


def test_a_plan_reads_the_middle_pieces_of_a_large_parameter_once():
    """A plan (fake values) reads a parameter's first two pieces and its last: each full piece
    after the first holds what the second held (sharded_layer.py's ``_read_starts``), so the
    loading's transient is the same as with every piece read (here: 3 pieces, all read,
    against 9); a real loading reads every piece."""
    piece = READ_PIECE_NUMEL
    assert loaded_in_pieces(4, fake=False)[0] == [piece] * 3 + [piece - 5]
    reads, transient = loaded_in_pieces(9, fake=True)
    assert reads == [piece, piece, piece - 5]
    assert loaded_in_pieces(3, fake=True) == (reads, transient)
    # Beyond the reader's fp32 buffer (kept: counted as held), one piece in bf16.
    assert transient == piece * 2


def test_plan_argument_checks():
    ids = torch.empty(2, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="device must be"):
        zerocore.plan.plan(plain_stack("meta"), ids, world_size=2, device="tpu")
    with pytest.raises(ValueError, match="world_size"):
        zerocore.plan.plan(plain_stack("meta"), ids, world_size=0)
    with pytest.raises(ValueError, match="beyond the stack"):
        zerocore.plan.plan(plain_stack("meta"), ids, world_size=2,
                           recompute=zerocore.Recompute(layers=(7,)))


# -- the command ---------------------------------------------------------------------------------

def test_20b_plan_prints_every_part(capsys):
    proc = call_main(plan_main, capsys, "--model", "gpt-neox-20b", "--finetune", "lora",
                     "--filter-layers", "0-3", "--batch-size", "1", "--seq-len", "256",
                     "--activation-checkpointing", "--gpus", "8", "--gpu-memory", "80")
    assert proc.returncode == 0, proc.stderr
    for phrase in ("parameter shards, frozen", "gradient shards", "fp32 master shards",
                   "optimizer state", "gathered layers at the peak", "activations at the peak",
                   "CUDA context and allocator headroom", "of 80 GiB: fits",
                   "all-gathered", "reduce-scattered", "without recomputation: activations",
                   "4 of 4 blocks recomputed", "loading by range, peak"):
        assert phrase in proc.stdout, (phrase, proc.stdout)


def test_20b_lora_fits_one_24gb_gpu_with_its_parameters_offloaded(capsys):
    # Issue 31's case: GPT-NeoX-20B's 38 GiB of bf16 frozen shards cannot be on a 24 GB GPU;
    # with --offload params they are on the host and the GPU holds a layer's window at a time.
    proc = call_main(plan_main, capsys, "--model", "gpt-neox-20b", "--finetune", "lora",
                     "--batch-size", "1", "--seq-len", "2048", "--activation-checkpointing",
                     "--gpus", "1", "--gpu-memory", "24", "--offload", "params", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    plan, memory = out["plan"], out["device_memory"]
    assert plan["state"]["parameter shards, frozen"] > memory   # no fit without the offload
    assert "parameter shards, frozen" in plan["on_host"]
    # One layer's window at a time: a block is about 1/44 of the frozen bytes (the embedding
    # and the head 1/66 each), far below a tenth.
    assert 0 < plan["windows_peak"] < plan["state"]["parameter shards, frozen"] / 10
    assert plan["peak_bytes"] <= memory, plan


def test_json_numbers_follow_the_formula(capsys):
    proc = call_main(plan_main, capsys, "--model", "gpt-neox-20b", "--finetune", "full",
                     "--filter-layers", "0-3", "--batch-size", "1", "--seq-len", "512",
                     "--gpus", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    plan, other = out["plan"], out["other_recompute"]
    psi = plan["trainable_numel"]
    state = plan["state"]
    # bf16 full training: 2 (copy) + 4 (master) + 8 (moments) bytes per parameter over 8
    # ranks, within the layouts' padding (16 elements per tensor and rank).
    assert state["parameter shards, trainable"] == pytest.approx(2 * psi / 8, rel=1e-4)
    assert state["fp32 master shards"] == pytest.approx(4 * psi / 8, rel=1e-4)
    assert state["optimizer state"] == pytest.approx(8 * psi / 8, rel=1e-4)
    assert plan["peak"]["gradient shards"] <= state["gradient shards"]
    assert other["peak"]["activations"] < plan["peak"]["activations"]  # recomputed
    assert plan["peak_bytes"] == plan["device_peak"] + plan["headroom"]
    # Loading by range: the shards (copies and masters, no moments yet) held after it, and
    # more at its peak (tests/hf/test_loading_plan.py measures it).
    held = state["parameter shards, trainable"] + state["fp32 master shards"]
    assert held <= plan["loading_held_bytes"] < held + state["optimizer state"]
    assert plan["loading_peak_bytes"] > plan["loading_held_bytes"]


@pytest.mark.parametrize("args, phrase", [
    (("--gpus", "0"), "--gpus"),
    (("--gpu-memory", "-1"), "--gpu-memory -1: must be"),
    (("--filter-layers", "50"), "block 50 is out of range"),
    (("--activation-checkpointing", "3", "--filter-layers", "0-1"), "not among the kept"),
    (("--checkpoint", "/nonexistent/weights"), "--checkpoint"),
])
def test_bad_input_is_one_line(capsys, args, phrase):
    proc = call_main(plan_main, capsys, "--model", "gpt-neox-20b", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert phrase in proc.stderr, proc.stderr


def test_help(capsys):
    proc = call_main(plan_main, capsys, "--help")
    assert proc.returncode == 0
    for flag in ("--gpus", "--nodes", "--gpu-memory", "--activation-checkpointing",
                 "--offload-optimizer", "--finetune", "--filter-layers", "--seq-len"):
        assert flag in proc.stdout


# -- a plan of many nodes (issue 40, item 5) -----------------------------------------------------

class OutputCount(TorchDispatchMode):
    """Counts the tensors the operations run under it return."""

    def __init__(self):
        super().__init__()
        self.tensors = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += sum(isinstance(t, torch.Tensor)
                            for t in (out if isinstance(out, (tuple, list)) else (out,)))
        return out


def cross_node_outputs(replicas: int) -> list[int]:
    """The tensors each cross-node reduction makes over a planned group of ``replicas`` nodes
    (a slice of 4 blocks per node)."""
    block = 128
    counts = []
    for reduce in (lambda t, g, c: quantized_reduce.reduce_scatter_int8(t, g, c, block),
                   lambda t, g, c: quantized_reduce.all_reduce_int8(t, g, c, block),
                   lambda t, g, c: collectives.reduce_scatter_across_nodes(t, g, c, True)):
        with OutputCount() as count:
            reduce(torch.ones(replicas * 4 * block), fake_group(replicas), CommCounter())
        counts.append(count.tensors)
    return counts


def test_a_cross_node_reduction_makes_as_many_tensors_at_any_number_of_nodes():
    """``neox.plan --nodes 100000 --gpus 8`` ran for minutes with growing memory: the plan
    rehearses every layout, and the cross-node reductions made a tensor (or several) per node
    (qgZ's messages packed row by row, hpZ's slice taken by ``chunk``), each one followed by
    the plan's count. Now the same few operations at any number of nodes."""
    assert cross_node_outputs(4) == cross_node_outputs(512)
