"""Compiled units (``zerocore.Compile``, or ``torch.compile(block)`` in the block's place): after
one warm-up step nothing is compiled again and no graph breaks, by dynamo's own counters; and
training is the eager engine's to rounding, at world sizes 1-3, for ``zerocore.shard`` (plain,
recomputed, bf16 with int8 frozen weights) and ``zerocore.shard_model``; and a compiled layer
with dropout, recomputed, draws the masks of its first run (bitwise the same training).

The reference is the eager engine on the same ranks, same seeds, same sharding: the eager engine
is itself checked against unsharded torch modules and torch.optim.AdamW (test_shard.py), so the
only difference left here is what inductor changes, the order and precision of the arithmetic
inside a fused kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters  # torch's own: graphs, frames, graph breaks

import zerocore
from tests.support import toy_stack
from tests.support.toy_stack import Spec

WORLD_SIZES = [1, 2, 3]
STEPS = 4
# Compiling costs seconds per graph per rank, and ranks share two cores with each other.
TIMEOUT_S = 600.0


class Stacked(nn.Module):
    """The toy transformer as one model, for ``shard_model``: its blocks are the units, the
    embedding and readout the root."""

    def __init__(self):
        super().__init__()
        emb, *blocks, out = toy_stack.transformer_layers()
        self.emb, self.layers, self.out = emb, nn.ModuleList(blocks), out

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.layers:
            x = block(x)
        return self.out(x)


@dataclasses.dataclass(frozen=True)
class Run:
    front: str = "shard"       # "shard", "shard_model", or "recipe" (torch.compile per block,
                               # then shard_model: the FSDP2 user's habit)
    compiled: bool = True
    fullgraph: bool = True
    recompute: bool = False
    int8: bool = False         # the weights frozen, stored as int8; only the biases train
    bf16: bool = False         # bf16 compute (and gathers)
    fresh: bool = False        # forget every compiled graph first (torch._dynamo.reset)


def _dynamo_totals() -> dict:
    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
            "breaks": sum(counters["graph_break"].values()),
            "why": [reason[:300] for reason in counters["graph_break"]]}


def _build(run: Run):
    """(the model to call, what holds its sharded layers, its parameters' owner)."""
    policy = zerocore.Compile(fullgraph=run.fullgraph) if run.compiled else None
    if run.front == "shard":
        spec = Spec(model="transformer", train="biases" if run.int8 else "all")
        model = zerocore.shard(
            toy_stack.make_layers(spec), compile=policy,
            recompute=zerocore.Recompute() if run.recompute else None,
            mixed_precision=zerocore.MixedPrecision(torch.bfloat16 if run.bf16
                                                    else torch.float32),
            frozen_weights=zerocore.FrozenWeights("int8" if run.int8 else None))
        return model, model
    model = Stacked()
    if run.front == "recipe" and run.compiled:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, fullgraph=run.fullgraph)
        policy = None
    return model, zerocore.shard_model(model, model.layers, compile=policy)


def train_run(rank: int, world_size: int, run: Run) -> dict:
    """Losses, the first and last step's full gradients, the final parameters, and dynamo's
    counters: after the warm-up (one training step and one forward without autograd) and after
    the rest of the run."""
    if run.fresh:
        torch._dynamo.reset()  # every graph this run needs is compiled anew (and counted)
    model, sharded = _build(run)
    opt = zerocore.optim.AdamW(sharded.parameters(), lr=toy_stack.LR,
                               weight_decay=toy_stack.WEIGHT_DECAY)
    spec = Spec(model="transformer")
    start = _dynamo_totals()
    out: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        x, y = toy_stack.global_batch(spec, step, 0, world_size)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = toy_stack.loss_fn(spec, model(x), y)
        loss.backward()
        out["losses"].append(loss.item())
        if step in (0, STEPS - 1):
            out["grads"].append(toy_stack.full_grads(sharded))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)  # an evaluation: without autograd, a graph of its own per layer class
        if step == 0:
            out["warm"] = _dynamo_totals()
    out["end"] = _dynamo_totals()
    out["start"] = start
    out["params"] = ({k: v.float() for k, v in sharded.full_state_dict(to_rank=None).items()}
                     if run.front != "shard" else toy_stack.full_params(sharded))
    return out


def _close(got: dict, want: dict, rel: float, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, w in want.items():
        err = (got[name] - w).abs().max().item()
        scale = max(w.abs().max().item(), 1e-12)
        assert err <= rel * scale, f"{what}, {name}: max error {err:.3g} vs |max| {scale:.3g}"


# -- dynamo's counters ------------------------------------------------------------------------

# One graph per layer class and kind of call, not per layer: the two blocks share theirs. A
# kind of call: with autograd; without (the evaluation forward). A recomputed layer adds none:
# torch's checkpoint runs its first forward with autograd enabled (keeping only the inputs), as
# the recomputation does, so one graph serves both. shard: embedding, block, readout;
# shard_model: the block (the root stays eager).
NO_RECOMPILE = [
    # fullgraph=False, so that a graph break would be counted instead of raised.
    ("shard", Run(fullgraph=False, fresh=True), 3 * 2),
    ("shard_recompute", Run(fullgraph=False, fresh=True, recompute=True), 3 * 2),
    # bf16 with int8 frozen weights (the gathers and dequantization stay outside the graph).
    # Only biases train, so the embedding is frozen: the first block's input needs no grad,
    # the second's does, one more graph for the block.
    ("shard_bf16_int8", Run(fullgraph=False, fresh=True, int8=True, bf16=True), 3 * 2 + 1),
    ("shard_model", Run(front="shard_model", fullgraph=False, fresh=True), 1 * 2),
    ("recipe", Run(front="recipe", fullgraph=False, fresh=True), 1 * 2),
]


# shard at 1, 2 and 3 ranks; the variants at 3 only: what they compile does not depend on the
# count, which shard covers at 1, 2 and 3, and each variant compiles with fullgraph=True (a
# break raises) at 1, 2 and 3 in the parity tests below (CI time).
@pytest.mark.parametrize("size,run,graphs", [
    pytest.param(size, run, graphs, id=f"ws{size}-{name}") for name, run, graphs in NO_RECOMPILE
    for size in (WORLD_SIZES if name == "shard" else [3])])
def test_no_recompile_no_graph_break(worlds, size: int, run: Run, graphs: int):
    world = worlds(size)
    for rank, r in enumerate(world.run(train_run, run, timeout=TIMEOUT_S)):
        warm, end, start = r["warm"], r["end"], r["start"]
        assert end["breaks"] == start["breaks"], f"rank {rank}: graph breaks: {end['why']}"
        # Re-installed views each gather, new values each step: nothing compiled after warm-up.
        assert end["graphs"] == warm["graphs"] and end["frames"] == warm["frames"], \
            f"rank {rank}: compiled again after warm-up ({warm} -> {end})"
        assert warm["graphs"] - start["graphs"] == graphs, f"rank {rank}: {start} -> {warm}"


@pytest.mark.parametrize("front", ["shard", "shard_model"])
def test_module_compile_refused_on_every_rank(world, front):
    world.run(_refuse_unit_compile, front)


def _refuse_unit_compile(rank: int, world_size: int, front: str) -> None:
    """``module.compile()`` compiles the engine's hooks with the module, under either door (the
    layers of ``shard`` carry the same hooks); refused on every rank though only the last
    rank's layer 1 was compiled (the others learn of it at the next agreement)."""
    model = Stacked()
    if rank == world_size - 1:
        model.layers[1].compile()
    with pytest.raises(ValueError, match=r"module\.compile\(\).*zerocore\.Compile\(\)"):
        if front == "shard":
            zerocore.shard([model.emb, *model.layers, model.out])
        else:
            zerocore.shard_model(model, model.layers)


# -- training parity with the eager engine ------------------------------------------------------

@pytest.mark.parametrize("run", [Run(), Run(recompute=True), Run(front="shard_model"),
                                 Run(front="recipe")],
                         ids=["shard", "shard_recompute", "shard_model", "recipe"])
def test_parity_with_eager_fp32(world, run: Run):
    eager = world.run(train_run, dataclasses.replace(run, compiled=False), timeout=TIMEOUT_S)
    compiled = world.run(train_run, run, timeout=TIMEOUT_S)
    for rank, (e, c) in enumerate(zip(eager, compiled)):
        # fp32: inductor's fused kernels sum in another order; a loss differs by ~1e-7
        # relatively, so 1e-5 is 100 such roundings and far below a wrong step's change.
        assert c["losses"] == pytest.approx(e["losses"], rel=1e-5), f"rank {rank}"
        # Gradients: ~6e-7 of a tensor's largest element at the first step, ~5e-6 at the last
        # (Adam's steps carry the first differences on); 1e-4 leaves margin for other shapes.
        for step, (ge, gc) in enumerate(zip(e["grads"], c["grads"])):
            _close(gc, ge, 1e-4, f"rank {rank}, gradients at check {step}")
        # Parameters after the steps: differences ~1e-5; a flipped Adam step would be lr=1e-2.
        _close(c["params"], e["params"], 1e-3, f"rank {rank}, final parameters")
        # The parameters keep their plain names (no torch.compile "_orig_mod." in them).
        assert not any("_orig_mod" in name for name in c["params"]), sorted(c["params"])


def test_bf16_int8_as_close_to_fp32_as_eager(world):
    """bf16 with int8 frozen weights: the compiled engine's result is no further from the same
    run in fp32 (the same int8 weights, dequantized to fp32) than the eager engine's. (Inductor
    keeps a fused kernel's intermediates in fp32 and rounds to bf16 only at its outputs, where
    eager rounds after each op, so it is usually closer; the two bf16 runs differ from each
    other by bf16 roundings, ~1% of a gradient's norm.)"""
    fp32 = world.run(train_run, Run(compiled=False, int8=True), timeout=TIMEOUT_S)
    bf16 = Run(int8=True, bf16=True)
    eager = world.run(train_run, dataclasses.replace(bf16, compiled=False), timeout=TIMEOUT_S)
    compiled = world.run(train_run, bf16, timeout=TIMEOUT_S)
    for rank, (f, e, c) in enumerate(zip(fp32, eager, compiled)):
        def distance(r: dict) -> float:
            # Over the trainable biases' last gradients: what the next step would apply.
            g_ref, g = f["grads"][-1], r["grads"][-1]
            return max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g)
        # 1.5: margin for a seed or shape where the two land closer together than here.
        assert distance(c) <= 1.5 * distance(e), f"rank {rank}"
        # Losses: either engine's is within a few 1e-4 of fp32's, relatively, the two in no
        # fixed order (one scalar each); bounded by one bf16 rounding, 2**-8 relative.
        for a, b in zip(c["losses"], f["losses"]):
            assert abs(a - b) <= 2 ** -8 * abs(b), f"rank {rank}: loss {a} vs fp32 {b}"


# -- recomputation with dropout ------------------------------------------------------------------

class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(toy_stack.D_MODEL, toy_stack.D_MODEL)
        self.drop = nn.Dropout(0.3)  # large enough that another mask changes every gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.nn.functional.gelu(self.fc(x)))


def _dropout_run(rank: int, world_size: int, recompute: bool) -> dict:
    torch.manual_seed(0)
    model = zerocore.shard([DropoutBlock() for _ in range(3)], compile=zerocore.Compile(),
                           recompute=zerocore.Recompute() if recompute else None)
    torch.manual_seed(10 + rank)  # dropout masks per rank, the same in both runs
    x = torch.randn(4, 5, toy_stack.D_MODEL)
    out = model(x)
    out.square().sum().backward()
    return {"out": out.detach(), "grads": toy_stack.full_grads(model)}


def test_recompute_with_dropout_bitwise(world):
    """Inductor draws its own random numbers (not eager's masks), from seeds taken from torch's
    generator; the recomputation reinstates the generator, so its graph draws the first run's
    masks, although the first run was another graph (the one without autograd)."""
    plain = world.run(_dropout_run, False, timeout=TIMEOUT_S)
    recomputed = world.run(_dropout_run, True, timeout=TIMEOUT_S)
    for rank, (a, b) in enumerate(zip(plain, recomputed)):
        assert torch.equal(a["out"], b["out"]), f"rank {rank}"
        for name, g in a["grads"].items():
            assert torch.equal(b["grads"][name], g), f"rank {rank}: {name}"
