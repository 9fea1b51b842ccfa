"""``Prefetch(keep_gathered=...)``: a gathered-memory budget. The chosen layers (from the last
one backwards, while they fit) skip their backward all-gather, and their frozen groups stay
gathered from step to step. Everything is checked against the budget-free engine on the CPU
over gloo at world sizes 1-3: the same bits (losses, gradient shards, norms, final weights),
exactly the all-gathers the report expects, and never more held than the budget.
"""

from __future__ import annotations

import pytest
import torch

import zerocore
from tests.support.toy_stack import (LR, Spec, accumulate_step, global_batch, loss_fn, make_layers,
                                     model_input, train_digest)

WORLD_SIZES = [1, 2, 3]


CASES = {
    # PEFT-like: every weight frozen, the biases trained, micro-batches accumulated, clipping.
    "mlp-biases-micro2-clip": Spec(model="mlp", steps=3, micro=2, train="biases", max_norm=0.05),
    # A frozen first layer whose input (token ids) needs no gradient: no backward covers it.
    "transformer-bf16-frozen-embedding": Spec(model="transformer", steps=3, train="no_embedding",
                                              param_dtype=torch.bfloat16),
    # A wholly frozen middle layer that gradients must pass through.
    "mlp-middle-frozen": Spec(model="mlp", steps=3, train="middle_frozen"),
}
# Budgets: everything; and about half of the stack's gathered bytes (resolved per model, the
# same on every rank, since every rank has the same layouts).
BUDGETS = ["all", "half"]


def layer_bytes(model: zerocore.ShardedSequential) -> list[int]:
    return [l.gathered_size for l in model.layers]


def build(spec: Spec, keep_gathered) -> zerocore.ShardedSequential:
    policies = dict(mixed_precision=zerocore.MixedPrecision(spec.param_dtype))
    if keep_gathered == "half":
        sizes = layer_bytes(zerocore.shard(make_layers(spec), **policies))
        keep_gathered = sum(sizes) // 2
    return zerocore.shard(make_layers(spec), prefetch=zerocore.Prefetch(
        keep_gathered=keep_gathered), **policies)


def digest(rank: int, world_size: int, spec: Spec, keep_gathered) -> dict:
    model = build(spec, keep_gathered)
    model.comm_report(reset=True)
    out = train_digest(model, spec, rank, world_size)
    report = model.comm_report()
    resident = sum(g.layout.padded_numel * spec.param_dtype.itemsize
                   for i in model.kept_layers for g in model.layers[i].groups if not g.trainable)
    return dict(out, gathered=report.all_gather_bytes, expected=report.expected_all_gather_bytes,
                kept=sorted(model.kept_layers), resident=resident, layers=len(model.layers))


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_budget_is_bitwise_and_gathers_what_the_report_expects(world, case, budget):
    """The same bits as without a budget; and the all-gathers measured over the run are the
    report's steady-state figure per forward/backward, plus the resident frozen groups once
    (the first forward gathers them), and fewer than without the budget."""
    spec = CASES[case]
    plain = world.run(digest, spec, 0)
    kept = world.run(digest, spec, budget)
    passes = spec.steps * spec.micro
    for p, k in zip(plain, kept):
        assert k["digest"] == p["digest"]
        assert k["kept"], "the budget chose no layer: this compared nothing"
        if budget == "all":
            assert k["kept"] == list(range(k["layers"]))
        assert k["gathered"] == passes * k["expected"] + k["resident"]
        assert p["gathered"] == passes * p["expected"]
        assert k["gathered"] < p["gathered"]


def stack_sizes(rank: int, world_size: int) -> list[int]:
    return layer_bytes(zerocore.shard(make_layers(Spec(train="biases"))))


def held_after_each_call(rank: int, world_size: int, budget) -> dict:
    """Bytes of gathered buffers held after each call a training loop with evaluation,
    abandoned forwards and a checkpoint load makes; and the budget's figures."""
    spec = Spec(train="biases")
    model = build(spec, budget)
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR)
    x, y = global_batch(spec, 0, 0, world_size)
    xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]

    def held() -> int:
        return model.memory_report().gather_bytes

    seen = {}
    out = model(model_input(spec, xr))
    seen["after forward"] = held()
    loss_fn(spec, out, yr).backward()
    seen["after backward"] = held()
    opt.step()
    with torch.no_grad():
        model(model_input(spec, xr))
    seen["after a no_grad forward"] = held()
    model.release_gathered()
    seen["released"] = held()
    accumulate_step(model, spec, 1, rank, world_size)
    seen["after a step"] = held()
    sizes = layer_bytes(model)
    frozen = sum(g.layout.padded_numel * 4 for i in model.kept_layers
                 for g in model.layers[i].groups if not g.trainable)
    kept = sum(sizes[i] for i in model.kept_layers)
    last = sizes[-1] if len(sizes) - 1 not in model.kept_layers else 0
    return dict(seen=seen, frozen=frozen, kept=kept, last=last, sizes=sizes,
                chosen=sorted(model.kept_layers))


@pytest.mark.parametrize("budget", ["one layer", "all"])
def test_budget_bounds_what_is_held_and_resident_groups_stay(world, budget):
    """After forward the kept layers (and the last layer, Prefetch.keep_last) are held, never
    more than the budget beyond keep_last's layer; after backward, and through evaluation,
    only the chosen layers' frozen groups; release_gathered frees those too."""
    if budget == "one layer":
        # Exactly the last layer's size: it alone is taken (nothing is left for the others).
        budget = world.run(stack_sizes)[0][-1]
    for r in world.run(held_after_each_call, budget):
        seen = r["seen"]
        if budget != "all":
            assert r["chosen"] == [len(r["sizes"]) - 1], r
            assert r["kept"] <= budget
        else:
            assert r["chosen"] == list(range(len(r["sizes"])))
        assert seen["after forward"] == r["kept"] + r["last"]
        assert seen["after backward"] == r["frozen"] > 0
        assert seen["after a no_grad forward"] == r["frozen"]
        assert seen["released"] == 0
        assert seen["after a step"] == r["frozen"]


def resident_after_load(rank: int, world_size: int, root: str) -> dict:
    """A checkpoint saved with the frozen shards, then loaded into a model whose resident
    frozen groups hold other values: the load must drop them, or the next forward would run
    on the old weights."""
    spec = Spec(train="biases")
    torch.manual_seed(0)
    source = zerocore.shard(make_layers(spec))
    opt = zerocore.optim.AdamW(source.parameters(), lr=LR)
    path = zerocore.save_checkpoint(root, 1, source, opt, include_frozen=True)
    x, _ = global_batch(spec, 0, 0, world_size)
    xr = model_input(spec, x.chunk(world_size)[rank])
    with torch.no_grad():
        want = source(xr)
    layers = make_layers(spec)        # seeded alike: made different below
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters()):
            p.mul_(0.5)
    target = zerocore.shard(layers, prefetch=zerocore.Prefetch(keep_gathered="all"))
    target_opt = zerocore.optim.AdamW(target.parameters(), lr=LR)
    with torch.no_grad():
        before = target(xr)           # gathers every frozen group, which stays
    zerocore.load_checkpoint(path, target, target_opt)
    with torch.no_grad():
        got = target(xr)
    return dict(differed=not torch.equal(before, want), equal=torch.equal(got, want))


def test_load_checkpoint_drops_resident_groups(world, tmp_path):
    for r in world.run(resident_after_load, str(tmp_path)):
        assert r["differed"], "the two models computed alike: this compared nothing"
        assert r["equal"]


def test_policy_checks_and_choice():
    with pytest.raises(ValueError, match="keep_gathered"):
        zerocore.Prefetch(keep_gathered=-1)
    with pytest.raises(ValueError, match="keep_gathered"):
        zerocore.Prefetch(keep_gathered="most")
    p = zerocore.Prefetch(keep_gathered=10)
    # From the last layer backwards, each taken while it fits in what is left.
    assert p.layers_kept([4, 4, 11, 6]) == {3, 1}
    assert zerocore.Prefetch().layers_kept([1, 2]) == frozenset()
    assert zerocore.Prefetch(keep_gathered="all").layers_kept([5, 7]) == {0, 1}
