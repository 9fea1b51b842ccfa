"""hpZ: ``shard(mesh=, hybrid=zerocore.Hybrid("hpz"))`` / ``shard_model(...)`` with a 2-D CPU
``DeviceMesh`` (replicate, shard) over gloo ranks, as two simulated nodes of two ranks (2x2),
and the edge shape 2x1 (one rank per node: the secondary shard is the whole layer).

Each run trains the small transformer of tests/support/toy_stack.py through either front door,
with two micro-batches per step and gradient clipping (the norm over every rank's shards),
against the unsharded model with ``torch.optim.AdamW`` and ``clip_grad_norm_`` on the whole
global batch (tests/support/hybrid_runs.py); then checks that every rank holds its own slice
of the state (sharded over all four), that backward's gathers never used the replicate group
(the nodes), and that the bytes per group are the formulas'.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from zerocore.comm.quantized_reduce import reduce_scatter_message_nbytes
from tests.support.hybrid_runs import (BF16, FP32, MICRO, QGZ_STEPS, QUANTIZE_BLOCK, STEPS,
                                       Case, check_against_reference, mesh_of, plan_of,
                                       quantized_collective, run_qgz, train_hybrid,
                                       train_unsharded)
from tests.support import toy_stack
from tests.support.toy_stack import SEQ, Spec, make_layers
from zerocore.plan import SECONDARY

HPZ = dict(layout="hpz")
CASES = {
    "2x2-fp32": Case((2, 2), **HPZ, **FP32),
    # bf16 through shard only: shard_model's root is covered by fp32's (both doors), and the
    # dtype is each group's alike, root or not (CI time).
    "2x2-bf16": Case((2, 2), **HPZ, **BF16, doors=("shard",)),
    "2x1-fp32": Case((2, 1), **HPZ, **FP32, doors=("shard",)),
    # Every layer (block) recomputed, and a gathered budget that keeps the readout and one
    # block from forward to backward (the blocks are about 33 kB gathered in fp32, the
    # embedding and readout about 8 kB each): a recomputed layer's backward gathers from its
    # secondary shard; a kept one needs none. Through gloo's collectives within the node (the
    # other cases read each other's memory there). fp32's bounds: the same arithmetic.
    "2x2-recompute-keep": Case((2, 2), **HPZ, **FP32, recompute=True, keep_gathered=45_000,
                               ways=("collective", "collective"), doors=("shard",)),
    # Optimizer and parameter offload (on the CPU: the host arena; each gather's input a
    # window): the same arithmetic, fp32's bounds.
    "2x2-offload": Case((2, 2), **HPZ, **FP32, offload=True, offload_params=True,
                        doors=("shard_model",)),
    # int8 frozen weights (the weights frozen, biases trained): the secondary shards hold int8
    # values and their scales. Each weight within half a step of its block's absmax/127, so
    # the front-door table's int8 bounds (5e-3 on the losses, 0.15 on the update).
    "2x2-int8-frozen": Case((2, 2), **HPZ, **FP32, train="biases", frozen_int8=True,
                            loss_rtol=5e-3, update_rtol=0.15, doors=("shard_model",)),
    # A replicated NF4 base (the weights frozen, biases trained): its groups gather nothing,
    # within the node or across, and keep no secondary shard; the reference is given the same
    # dequantized weights, so fp32's bounds.
    "2x2-nf4-replicated": Case((2, 2), **HPZ, **FP32, train="biases",
                               frozen=("nf4", "replicated")),
    # fp16 compute with dynamic loss scaling (the scale a power of two: it cancels exactly);
    # 2^-12 relative rounding: the front-door table's fp16 bounds (2e-3, 0.05).
    "2x2-fp16": Case((2, 2), **HPZ, param_dtype=torch.float16, loss_scaling=True,
                     loss_rtol=2e-3, update_rtol=0.05, doors=("shard",)),
}
PARAMS = [pytest.param(name, door, id=f"{name}-{door}")
          for name, case in CASES.items() for door in case.doors]


def _check_traffic(case: Case, got: list[dict]) -> None:
    """comm_report: the shard group's gathers and reduce-scatters as a flat layout's over the
    node; across the nodes, each forward's gather of the secondary shards (1/S of each layer)
    and each micro-batch's reduce-scatter of the secondary gradient slices (1/S of Ψ_t), and
    none of backward's gathers."""
    replicas, shards = case.shape
    reduce_bytes = case.param_dtype.itemsize  # the reduce dtype is the param dtype here
    for out in got:
        r = out["report"]
        passes = STEPS * MICRO
        assert r.all_gather_bytes == passes * r.expected_all_gather_bytes
        assert r.reduce_scatter_bytes == passes * r.expected_reduce_scatter_bytes
        # Backward gathers within the node only; every forward gathers across once per layer.
        assert out["backward_across"] == [0] * passes, out["backward_across"]
        assert all(n > 0 for n in out["forward_across"]), out["forward_across"]
        # The formulas: Ψ_t (padded) / S elements per micro-batch across the nodes in the
        # reduce dtype; each forward gather across the nodes 1/S of the layer's gather.
        formula = sum(out["padded"]) // shards * reduce_bytes
        assert r.expected_across_reduce_scatter_bytes == formula
        assert r.across_reduce_scatter_bytes == passes * formula
        assert r.across_all_gather_bytes == passes * r.expected_across_all_gather_bytes
        assert r.replica_all_reduce_bytes == 0 and out["replica_calls"] == 0
        assert r.inter_node_bytes == r.across_all_gather_bytes + r.across_reduce_scatter_bytes
        assert r.intra_node_bytes == r.all_gather_bytes + r.reduce_scatter_bytes
        assert f"hpZ {replicas}x{shards}" in out["ways"], out["ways"]
        if case.ways != ("auto", "auto"):
            assert "gather: {}; reduce: {}".format(*case.ways) in out["ways"], out["ways"]
        assert (f"intra-node {r.intra_node_bytes / 2**20:.3f} MiB, inter-node "
                f"{r.inter_node_bytes / 2**20:.3f} MiB") in r.table()


def _check_plan(case: Case, got: list[dict], plan) -> None:
    """zerocore.plan predicts, from shapes alone, every byte the run moved (per group) and the
    secondary shards it held between the passes, and memory per rank sharded over all ranks."""
    for out in got:
        r, memory = out["report"], out["memory"]
        assert (plan.all_gather_bytes * STEPS, plan.reduce_scatter_bytes * STEPS) == \
            (r.all_gather_bytes, r.reduce_scatter_bytes)
        assert (plan.across_all_gather_bytes * STEPS, plan.across_reduce_scatter_bytes * STEPS) \
            == (r.across_all_gather_bytes, r.across_reduce_scatter_bytes)
        assert plan.inter_node_bytes * STEPS == r.inter_node_bytes > 0
        # After the first forward every layer backward gathers again holds its secondary
        # shard (the plan's most at any point), all of them on every rank alike.
        assert 0 < memory.secondary_bytes == plan.secondary_peak
        assert f"secondary shards now {memory.secondary_bytes / 2**20:.3f} MiB" in \
            " ".join(memory.table().split())
        assert memory.world_size == plan.world_size == case.shape[0] * case.shape[1]
        s = plan.state
        assert memory.param_bytes == s.trainable_params + s.frozen_params
        assert memory.master_bytes == s.masters and memory.optimizer_bytes == s.optimizer
    assert "hpZ 2x2" in plan.table() or case.shape != (2, 2)


@pytest.mark.parametrize("name, door", PARAMS)
def test_hpz_trains_as_the_unsharded_model(worlds, name, door):
    case = CASES[name]
    replicas, shards = case.shape
    world = worlds(replicas * shards)
    got = world.run(train_hybrid, door, case, timeout=300)
    check_against_reference(case, got, train_unsharded(case, world.world_size))
    # The state is sharded over every rank: rank w (row r, column s of the mesh) holds slice
    # s·R + r, each slice once.
    assert [out["group"] for out in got] == [
        ((w % shards) * replicas + w // shards, replicas * shards) for w in range(len(got))]
    # An export to rank 0 of model.group (the whole mesh): the same weights, there alone.
    assert got[0]["exported"].keys() == got[0]["weights"].keys()
    assert all(torch.equal(got[0]["exported"][n], w) for n, w in got[0]["weights"].items())
    assert all(out["exported"] == {} for out in got[1:])
    _check_traffic(case, got)
    _check_plan(case, got, plan_of(door, case))


# -- qgZ on hpZ: the cross-node reduce-scatter in int8 --------------------------------------------

BLOCK = QUANTIZE_BLOCK


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_int8_reduce_scatter_is_within_its_bound(worlds, ranks):
    per = 336  # each rank's slice: not a whole number of blocks
    got = worlds(ranks).run(quantized_collective, "reduce_scatter", ranks * per)
    xs = torch.stack([out["x"] for out in got]).double().view(ranks, ranks, per)
    chunk = -(-per // BLOCK) * BLOCK

    def absmax_per_element(t: torch.Tensor) -> torch.Tensor:
        """Each element's block's absmax, for each rank's slice (padded to whole blocks, as
        quantized): (R, per)."""
        full = torch.zeros(ranks, chunk, dtype=torch.float64)
        full[:, :per] = t.abs()
        return full.view(ranks, -1, BLOCK).amax(2).repeat_interleave(BLOCK, 1)[:, :per]

    # comm/quantized_reduce.py's bound for the one hop: each rank's values rounded to their
    # block's absmax/127 (off by at most half that), plus fp32's own rounding of the
    # dequantized products and the sum (a few ulps of the sum of magnitudes).
    bound = (sum(absmax_per_element(x) for x in xs) / 254
             + 4 * torch.finfo(torch.float32).eps * xs.abs().sum(0))
    exact = xs.sum(0)  # (R, per): row r is rank r's slice of the sum
    for r, out in enumerate(got):
        err = (out["y"].double() - exact[r]).abs()
        assert (err <= bound[r]).all(), (err - bound[r]).max()
        assert out["nbytes"] == reduce_scatter_message_nbytes(ranks * per, ranks, BLOCK) == \
            ranks * (chunk + 4 * chunk // BLOCK + 4)
        assert out["calls"] == 1
    # Not exact: the bound is what is used, not the arithmetic's own rounding.
    assert max((out["y"].double() - exact[r]).abs().max() for r, out in enumerate(got)) > \
        1e-4 * exact.abs().max()


# qgZ on hpZ's stated bound on real training, as HSDP's (tests/engine/test_hsdp.py): the toy
# transformer's mean loss, step by step over 20 steps, within 1% (relative) of the same run
# with the exact reduce-scatter. One hop (the all-to-all and fp32 sum), so each element of the
# cross-node sum is off by at most Σ_r absmax_r / 254 of its block (the unit test above).
# Measured: 0.10% in fp32, 0.27% in bf16 (the loss falls from 3.35 to 0.047).
QGZ_LOSS_RTOL = 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qgz_on_hpz_trains_within_its_bound(worlds, dtype):
    exact, quantized = run_qgz(worlds(4), dtype, "hpz", QGZ_LOSS_RTOL)
    for e, q in zip(exact, quantized):
        # The bytes across the nodes per micro-batch: each trainable group's secondary slice
        # (padded / 2) split 2 ways, as int8 with its scales and flags; the gathers are exact.
        per_pass = sum(reduce_scatter_message_nbytes(n // 2, 2, BLOCK) for n in q["padded"])
        r = q["report"]
        assert r.expected_across_reduce_scatter_bytes == per_pass
        assert r.across_reduce_scatter_bytes == QGZ_STEPS * MICRO * per_pass
        assert r.across_all_gather_bytes == e["report"].across_all_gather_bytes
        # (1 + 4/128 + padding) bytes an element, against fp32's 4 (bf16's 2).
        assert per_pass < 0.28 * 4 * sum(q["padded"]) // 2


# -- refusals -----------------------------------------------------------------------------------


def hybrid_without_nodes(rank: int, world_size: int, layout: str, how: str) -> str:
    where = {"group": {}, "1-D mesh": {"mesh": init_device_mesh("cpu", (world_size,))},
             "one replica": {"mesh": mesh_of((1, world_size))}}[how]
    try:
        zerocore.shard(make_layers(Spec(model="transformer")),
                       hybrid=zerocore.Hybrid(layout), **where)
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("layout, how", [("hpz", "group"), ("hpz", "1-D mesh"),
                                         ("hpz", "one replica"), ("hsdp", "group")])
def test_hybrid_without_nodes_is_refused_on_every_rank(worlds, layout, how):
    want = ("zerocore.shard: Hybrid('hpz') gathers across the mesh's replicate dim and this "
            "mesh has one replica" if how == "one replica" else
            f"zerocore.shard: Hybrid({layout!r}) needs a 2-D mesh (replicate, shard) and this "
            f"model has none")
    for m in worlds(2).run(hybrid_without_nodes, layout, how):
        assert m.startswith(want), m
        assert "\n" not in m


def test_hybrid_takes_only_its_layouts():
    assert zerocore.Hybrid().layout == "hsdp"
    with pytest.raises(ValueError, match=r"Hybrid.layout must be one of \('hsdp', 'hpz'\), "
                                         r"got 'hpZ'"):
        zerocore.Hybrid("hpZ")


def test_plan_refuses_hpz_without_nodes():
    with torch.device("meta"):
        layers = make_layers(Spec(model="transformer"))
    example = torch.zeros(2, SEQ, dtype=torch.int64, device="meta")
    hpz = zerocore.Hybrid("hpz")
    with pytest.raises(ValueError, match=r"^plan: Hybrid\('hpz'\) needs a 2-D mesh \(replicate, "
                                         r"shard\) and this model has none \(layout: flat over 4 "
                                         r"ranks\); pass mesh=\(nodes, ranks_per_node\)"):
        zerocore.plan.plan(layers, example, world_size=4, hybrid=hpz)
    with pytest.raises(ValueError, match=r"^plan: Hybrid\('hpz'\) gathers across the mesh's "
                                         r"replicate dim and this mesh has one replica"):
        zerocore.plan.plan(layers, example, world_size=4, mesh=(1, 4), hybrid=hpz)


def test_plan_sets_hpz_beside_flat_and_hsdp():
    """On 2 nodes x 2: hpZ holds flat's model state per rank (sharded over all 4) plus its
    secondary shards, moves within the node what flat moves in all, and sends across the
    nodes a quarter of flat's traffic: each forward's gathers and each micro-batch's gradient
    reduce-scatters, 1/S each (the formulas of docs/decisions.md)."""
    with torch.device("meta"):
        layers = make_layers(Spec(model="transformer"))
    example = torch.zeros(2, SEQ, dtype=torch.int64, device="meta")
    common = dict(world_size=4, device="cpu", micro_batches=2)
    flat = zerocore.plan.plan(layers, example, nodes=2, **common)
    hsdp = zerocore.plan.plan(layers, example, mesh=(2, 2), **common)
    hpz = zerocore.plan.plan(layers, example, mesh=(2, 2), hybrid=zerocore.Hybrid("hpz"),
                             **common)
    qgz = zerocore.plan.plan(layers, example, mesh=(2, 2), hybrid=zerocore.Hybrid("hpz"),
                             comm=zerocore.Comm(quantize_gradients="int8"), **common)
    assert hpz.state == flat.state != hsdp.state
    assert hpz.peak[SECONDARY] > 0 and flat.peak[SECONDARY] == hsdp.peak[SECONDARY] == 0
    assert hpz.intra_node_bytes == flat.all_gather_bytes + flat.reduce_scatter_bytes
    # Across the nodes, half (S = 2) of each forward's gathers and of the gradients; flat
    # sends every forward gather and the backward's again (every layer but the last, kept for
    # its backward), and the gradients.
    forward = hpz.across_all_gather_bytes * 2
    assert 0 < flat.all_gather_bytes - forward < forward
    assert hpz.across_reduce_scatter_bytes * 2 == flat.reduce_scatter_bytes
    assert hsdp.inter_node_bytes < qgz.inter_node_bytes < hpz.inter_node_bytes \
        < flat.inter_node_bytes
    assert qgz.across_all_gather_bytes == hpz.across_all_gather_bytes
    assert qgz.across_reduce_scatter_bytes < 0.28 * hpz.across_reduce_scatter_bytes
    assert qgz.state == hpz.state


# -- values changed between a forward and its backward -------------------------------------------

def _step_between_forward_and_backward(rank: int, world_size: int, hybrid: bool) -> dict:
    """A forward, an optimizer step (gradients of ones), then the forward's backward: hpZ's
    secondary shards kept by that forward hold the weights before the step, so backward must
    gather the stepped ones again, across the nodes, as a flat layout gathers them again. The
    gradients (hashed per rank's slice, in slice order) must be the flat layout's of the same
    sequence: the optimizer writes through ``.data``, which a tensor's version does not see."""
    torch.manual_seed(0)
    where = (dict(mesh=mesh_of((2, world_size // 2)), hybrid=zerocore.Hybrid("hpz"))
             if hybrid else {})
    model = zerocore.shard(make_layers(Spec(model="mlp")), **where)
    opt = zerocore.optim.AdamW(model.trainable_shards(), lr=1e-1)
    x = torch.randn(4, toy_stack.D_IN, generator=torch.Generator().manual_seed(1))
    out = model(x)
    for p in model.trainable_shards():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    across = model.counter.replicate_all_gather_calls
    out.pow(2).sum().backward()
    grads = {model.rank: [p.grad.clone() for p in model.trainable_shards()]}
    return dict(across=model.counter.replicate_all_gather_calls - across, grads=grads)


def test_a_step_between_forward_and_backward_gathers_the_new_weights(worlds):
    flat = worlds(4).run(_step_between_forward_and_backward, False)
    hpz = worlds(4).run(_step_between_forward_and_backward, True)
    assert all(r["across"] > 0 for r in hpz), [r["across"] for r in hpz]
    # The flat layout over 4 ranks holds the same slices in rank order, hpZ in slice order.
    by_slice = {s: g for r in flat for s, g in r["grads"].items()}
    for r in hpz:
        (s, grads), = r["grads"].items()
        for got, want in zip(grads, by_slice[s]):
            # Summed in another order (within the node, then across): fp32 rounding.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
