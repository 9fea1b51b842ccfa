"""Quantized frozen weights, each format in each placement: ``zerocore.FrozenWeights(dtype, block,
placement)`` with NF4, fp8 and int8, sharded (each rank holds its part of the quantized bytes,
each use gathers them and dequantizes) or replicated (each rank holds them all and dequantizes a
unit just before it runs; nothing frozen is gathered). Through both front doors at world sizes
1-3, the small transformer with its biases trained (tests/hf/test_shard_model_quantized.py:
LoRA on transformers models):
- trains as the unsharded model with ``torch.optim.AdamW`` whose frozen weights were quantized
  and dequantized the same way (tests/support/quantized_base.py), to fp32 rounding;
- the collectives move the trainable groups' bytes and, sharded, the frozen groups' quantized
  bytes; replicated, no frozen byte at all;
- each rank holds its part of the quantized base, or (replicated) every part;
- bad combinations are refused in one line before anything is built.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import zerocore
from tests.support.dist_utils import all_gather_flat
from tests.support.quantized_base import FORMATS, dequantized
from tests.support.toy_stack import (LR, WEIGHT_DECAY, Spec, assert_trains_as, global_batch,
                                     loss_fn, make_layers, train_digest)

WORLD_SIZES = [1, 2, 3]
STEPS = 3
SPEC = Spec(model="transformer", steps=STEPS, train="biases")
# (format, placement): int8 sharded is tests/engine/test_frozen_int8.py's.
CASES = [("nf4", "sharded"), ("fp8", "sharded"), ("nf4", "replicated"), ("fp8", "replicated"),
         ("int8", "replicated")]
IDS = [f"{d}-{p}" for d, p in CASES]


def _policy(dtype: str, placement: str) -> zerocore.FrozenWeights:
    return zerocore.FrozenWeights(dtype, block=FORMATS[dtype], placement=placement)


def _nf4(placement: str) -> dict:
    """The policies of an NF4 base ``placement``: "sharded", "replicated", or "host"
    (replicated, in host memory: ``Offload(params=True)``)."""
    if placement == "host":
        return dict(frozen_weights=_policy("nf4", "replicated"),
                    offload=zerocore.Offload(params=True))
    return dict(frozen_weights=_policy("nf4", placement))


def _build(door: str, policies: dict):
    """(the callable model, its sharding): ``shard`` takes the four layers; ``shard_model`` the
    model, with the two blocks as units (its root holds the embedding and the readout)."""
    layers = make_layers(SPEC)
    if door == "shard":
        model = zerocore.shard(layers, **policies)
        return model, model
    model = nn.Sequential(*layers)
    return model, zerocore.shard_model(model, [model[1], model[2]], **policies)


def train_sharded(rank: int, world_size: int, door: str, dtype: str, placement: str,
                  offload: str | None = None) -> dict:
    """``offload``: None, or what is offloaded: "params" (``Offload(params=True)``) or "all"
    (the optimizer too)."""
    policies = dict(frozen_weights=_policy(dtype, placement))
    if offload is not None:
        policies["offload"] = zerocore.Offload(params=True, optimizer=offload == "all")
    model, sharding = _build(door, policies)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    sharding.comm_report(reset=True)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(SPEC, step, 0, world_size)
        loss = loss_fn(SPEC, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    report = sharding.comm_report()
    memory = sharding.memory_report(opt)
    # What one step gathers of the trainable groups alone (fp32: 4 bytes an element), counted
    # from the layouts, not from what the groups say they move; shard_model's root (the last
    # unit) is gathered once a step (``ShardedModel.expected_traffic``).
    groups = [[(g.layout.padded_numel, True, g.layout.padded_numel * 4) for g in layer.groups
               if g.trainable] for layer in sharding.layers]
    if door == "shard":
        trainable, _ = sharding.schedule.traffic(groups, reduce_bytes=4)
    else:
        trainable, _ = sharding.schedule.traffic(groups[:-1], reduce_bytes=4, root=groups[-1],
                                                 input_requires_grad=bool(groups[-1]))
    frozen = [l.frozen for l in sharding.layers if l.frozen is not None]
    weights = {sharding.param_name(i, n): t
               for i, state in sharding.iter_full_states(trainable_only=True)
               for n, t in state.items()}
    return dict(losses=losses, weights=weights, gathered=report.all_gather_bytes,
                expected=report.expected_all_gather_bytes, trainable_per_step=trainable,
                held=sum(g.shard.numel() for g in frozen),
                part_bytes=sum(_policy(dtype, placement).frozen_nbytes(g.layout.shard_numel, 4)
                               for g in frozen),
                memory=memory.param_bytes, predicted=memory.predicted_bytes,
                frozen_on_device=sum(g.device_shard_bytes for g in frozen),
                on_host=memory.host_arena_bytes,
                frozen_numel=memory.frozen_numel, trainable_numel=memory.trainable_numel)


def train_unsharded(world_size: int, dtype: str) -> dict:
    """One process, fp32, torch.optim.AdamW on the biases, the whole global batch per step,
    the frozen weights quantized and dequantized as the engine holds them."""
    model = dequantized(nn.Sequential(*make_layers(SPEC)), dtype, FORMATS[dtype])
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(SPEC, step, 0, world_size)
        losses.append([loss_fn(SPEC, model(xr), yr).item()
                       for xr, yr in zip(x.chunk(world_size), y.chunk(world_size))])
        loss_fn(SPEC, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return dict(losses=losses, weights=weights, init=init)


@pytest.mark.parametrize("door", ["shard", "shard_model"])
@pytest.mark.parametrize("dtype, placement", CASES, ids=IDS)
def test_trains_as_the_dequantized_unsharded_model(world, door, dtype, placement):
    _check_trains_as_the_dequantized_model(world, door, dtype, placement, offload=None)


@pytest.mark.parametrize("door", ["shard", "shard_model"])
@pytest.mark.parametrize("dtype, offload", [("nf4", "params"), ("fp8", "all"),
                                            ("int8", "params")])
def test_a_replicated_base_on_the_host_trains_as_the_dequantized_model(world, door, dtype,
                                                                       offload):
    # Offload(params=True): the whole quantized base in host memory, each unit's bytes
    # uploaded for each use; nothing frozen gathered, nothing of the parameters on the device
    # between steps, its bytes in the host arena.
    got = _check_trains_as_the_dequantized_model(world, door, dtype, "replicated", offload)
    for out in got:
        assert out["frozen_on_device"] == 0, out
        assert out["on_host"] >= out["held"], out


def _check_trains_as_the_dequantized_model(world, door: str, dtype: str, placement: str,
                                           offload: str | None) -> list[dict]:
    got = world.run(train_sharded, door, dtype, placement, offload)
    want = train_unsharded(world.world_size, dtype)
    n = world.world_size
    for rank, out in enumerate(got):
        # fp32 throughout, the frozen weights the same bits on both sides: what is left is
        # zerocore's fused AdamW against torch's (a few ulps a step) and the reduce-scatter's
        # order of summation, as the front-door table's fp32 cases (1e-5 there too); a wrong
        # block, scale or part would move the losses by the quantization step, 1e-2 and more.
        for step, loss in enumerate(out["losses"]):
            ref = want["losses"][step][rank]
            assert abs(loss - ref) <= 1e-5 * abs(ref), (rank, step, loss, ref)
        assert_trains_as(out["weights"], want["weights"], want["init"], atol=1e-5,
                         update_rtol=None)
        # The collectives' own count: every step moved what was expected, and of the frozen
        # groups nothing when replicated, their quantized bytes when sharded.
        assert out["gathered"] == STEPS * out["expected"], out
        frozen_gathered = out["gathered"] - STEPS * out["trainable_per_step"]
        if placement == "replicated":
            assert frozen_gathered == 0, out
            assert out["held"] == n * out["part_bytes"]   # every rank's part, on every rank
        else:
            assert frozen_gathered > 0, out
            assert out["held"] == out["part_bytes"]       # its own part
        assert out["memory"] >= out["held"]
        # The report's prediction, (p + p + K)·Ψ_t/N plus the frozen bytes per rank: 1/N of
        # the quantized base, or all of it when replicated.
        frozen = _policy(dtype, placement).frozen_nbytes(out["frozen_numel"], 4)
        copies = n if placement == "replicated" else 1
        assert out["predicted"] == (16 * out["trainable_numel"] + copies * frozen) // n, out
    return got


def refusal(rank: int, world_size: int, policies: dict) -> str:
    try:
        zerocore.shard(make_layers(SPEC), **policies)
    except ValueError as e:
        return str(e)
    return "built"


def test_refusals(world):
    # Each line the same on every rank, raised before any layer is built.
    # A replicated base is in memory: on NVMe it is refused (params="cpu" is a home: above).
    replicated = _policy("nf4", "replicated")
    for r in world.run(refusal, dict(frozen_weights=replicated,
                                     offload=zerocore.Offload(params="nvme", optimizer="nvme",
                                                              path="."))):
        assert r.startswith("zerocore.shard: FrozenWeights(placement='replicated') keeps"), r
        assert "Offload(params='nvme')" in r and "\n" not in r


def too_large(rank: int, world_size: int, placement: str) -> str:
    # A layer of 4e10 frozen weights, given as shapes and a reader (never read: the refusal
    # comes first): 22 GB in NF4 on every rank, and 160 GB of fp32 to quantize from.
    layer = nn.Linear(200_000, 200_000, device="meta")
    layer.weight.requires_grad_(False)
    meta = zerocore.MetaLayer(layer, lambda name, a, b: torch.zeros(b - a))
    try:
        zerocore.shard([meta], **_nf4(placement))
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("placement", ["replicated", "host"])
def test_a_replicated_base_larger_than_memory_is_refused(world, placement):
    # (In host memory, the host is asked for the held bytes; on a CPU rank it is asked for
    # those and the fp32 values together, as on the device.)
    for r in world.run(too_large, placement):
        assert "FrozenWeights(placement='replicated'): layer 0 needs" in r, r
        assert "placement='sharded'" in r and "\n" not in r


def test_the_plan_says_a_replicated_base_is_whole_and_never_gathered():
    # zerocore.plan rehearses the engine: the replicated base is all of it on each rank, the
    # gathers are the trainable groups' alone (what the comm report of a run counts:
    # test_hpz's replicated case checks the plan against a run, byte for byte).
    with torch.device("meta"):
        layers = make_layers(SPEC)
    x = torch.zeros(4, 9, dtype=torch.int64, device="meta")
    plans = {placement: zerocore.plan.plan(layers, x, world_size=4, device="cpu",
                                           frozen_weights=_policy("nf4", placement))
             for placement in ("sharded", "replicated")}
    sharded, replicated = plans["sharded"], plans["replicated"]
    assert replicated.state.frozen_params == 4 * sharded.state.frozen_params  # every part
    assert replicated.all_gather_bytes < sharded.all_gather_bytes
    table = replicated.table()
    assert "frozen base, whole (nf4, replicated)" in table
    assert "none of it all-gathered" in table
    assert "parameter shards, frozen (nf4, sharded)" in sharded.table()


def test_policy_checks():
    with pytest.raises(ValueError, match=r"placement='replicated'\) holds the whole frozen base"):
        zerocore.FrozenWeights(placement="replicated")
    with pytest.raises(ValueError, match="placement must be one of"):
        zerocore.FrozenWeights("nf4", placement="everywhere")
    with pytest.raises(ValueError, match="block must be a multiple of 32 in"):
        zerocore.FrozenWeights("nf4", block=48)
    with pytest.raises(ValueError, match="dtype must be None or one of"):
        zerocore.FrozenWeights("int4")
    # The formats' own default blocks; int8 as before.
    assert [zerocore.FrozenWeights(d).block for d in (None, "int8", "nf4", "fp8")] == \
        [128, 128, 64, 128]
    nf4 = zerocore.FrozenWeights("nf4")
    assert nf4.frozen_nbytes(640, 4) == 320 + 4 * 10   # half a byte each, a scale per 64
    assert dataclasses.replace(nf4, placement="replicated").replicated


# -- bf16 compute ---------------------------------------------------------------------------------

BF16 = Spec(model="transformer", steps=3, micro=2, train="biases", param_dtype=torch.bfloat16)


def bf16_digest(rank: int, world_size: int, placement: str | None) -> dict:
    """The bf16 run with an NF4 base in ``placement``, or (None) unquantized with the
    dequantized weights as its frozen weights: a digest of every loss, gradient shard and the
    final weights as computed with (every rank's frozen groups gathered, dequantized)."""
    layers = make_layers(BF16)
    if placement is None:
        layers = list(dequantized(nn.Sequential(*layers), "nf4", FORMATS["nf4"]))
        policy = zerocore.FrozenWeights()
    else:
        policy = _policy("nf4", placement)
    model = zerocore.shard(layers, mixed_precision=zerocore.MixedPrecision(torch.bfloat16),
                           frozen_weights=policy)
    return train_digest(model, BF16, rank, world_size, final=lambda m: {
        f"{i}.{n}": t for i, state in m.iter_full_states() for n, t in state.items()})


def test_bf16_trains_bitwise_as_the_dequantized_base(world):
    # The kernels round each fp32 product once to bf16, as the reference's fp32 values are
    # rounded once when the unquantized engine takes them in bf16: the same bits.
    want = world.run(bf16_digest, None)
    for placement in ("sharded", "replicated"):
        for w, g in zip(want, world.run(bf16_digest, placement)):
            assert g["digest"] == w["digest"], placement


# -- checkpoints ---------------------------------------------------------------------------------


def _step(model, opt, rank: int, world_size: int, step: int) -> float:
    x, y = global_batch(SPEC, step, 0, world_size)
    loss = loss_fn(SPEC, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _trainable_state(model, opt) -> dict:
    """Every trainable parameter's master and Adam moments, gathered (each a collective)."""
    out = {}
    for i, state in model.iter_full_states(trainable_only=True):
        out.update({f"{i}.{n}": t for n, t in state.items()})
    for layer in model.layers:
        if layer.trainable is not None:
            shard = layer.trainable.shard
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{layer.index}.{key}"] = all_gather_flat(opt.state[shard][key])
    return out


def saved_then_continued(rank: int, world_size: int, root: str, placement: str) -> dict:
    """Two steps, a checkpoint (without the frozen weights: quantized copies are never saved),
    the state as saved, then one more step."""
    model = zerocore.shard(make_layers(SPEC), **_nf4(placement))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(2):
        _step(model, opt, rank, world_size, step)
    path = zerocore.save_checkpoint(root, 2, model, opt)
    saved = _trainable_state(model, opt)
    loss = _step(model, opt, rank, world_size, 2)
    return dict(path=str(path), saved=saved, loss=loss, after=_trainable_state(model, opt))


def resumed(rank: int, world_size: int, path: str, placement: str) -> dict:
    """A fresh model from the base weights (quantized as it is built), the checkpoint loaded,
    the state as loaded, then the third step."""
    model = zerocore.shard(make_layers(SPEC), **_nf4(placement))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    zerocore.load_checkpoint(path, model, opt)
    loaded = _trainable_state(model, opt)
    loss = _step(model, opt, rank, world_size, 2)
    return dict(loaded=loaded, loss=loss, after=_trainable_state(model, opt))


@pytest.mark.parametrize("placement", ["sharded", "replicated", "host"])
def test_checkpoints_resume_across_placements_and_world_sizes(worlds, tmp_path, placement):
    other = "replicated" if placement == "sharded" else "sharded"
    source = worlds(2).run(saved_then_continued, str(tmp_path), placement)[0]
    path = source["path"]
    # The other placement at the same world size: the state loaded is the state saved, and the
    # step after it is bitwise the uninterrupted run's (the same frozen bits in both
    # placements, the same reductions).
    for r in worlds(2).run(resumed, path, other):
        assert r["loaded"].keys() == source["saved"].keys()
        for n, t in source["saved"].items():
            assert torch.equal(r["loaded"][n], t), n
        for n, t in source["after"].items():
            assert torch.equal(r["after"][n], t), n
    # Other world sizes, either placement: the state loaded is the state saved, bitwise (the
    # checkpoint is flat, read at any size; the moments' padding at the end differs with the
    # world size, so their common part is compared), and training goes on from it (its batch
    # is another, as the global batch grows with the ranks).
    for n_ranks, where in ((1, placement), (3, other), (3, placement)):
        for r in worlds(n_ranks).run(resumed, path, where):
            for n, t in source["saved"].items():
                common = min(t.numel(), r["loaded"][n].numel())
                assert torch.equal(r["loaded"][n][:common], t[:common]), n
            assert math.isfinite(r["loss"])


def frozen_loaded(rank: int, world_size: int, root: str, placement: str) -> dict:
    """A checkpoint of the unquantized model with its frozen weights (what a base checkpoint
    is), loaded into a quantized model built from other frozen weights: quantized as it is
    read, the same bits as a model built from the checkpoint's weights directly."""
    source = zerocore.shard(make_layers(SPEC))
    path = zerocore.save_checkpoint(root, 1, source, zerocore.optim.AdamW(source.parameters()),
                                    include_frozen=True)
    layers = make_layers(SPEC)
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters() if not p.requires_grad):
            p.mul_(-0.5)  # other frozen weights than the checkpoint's
    target = zerocore.shard(layers, **_nf4(placement))
    zerocore.load_checkpoint(path, target, zerocore.optim.AdamW(target.parameters()))
    want = zerocore.shard(make_layers(SPEC), **_nf4(placement))
    compared, same = 0, True
    for a, b in zip(target.layers, want.layers):
        if a.frozen is not None:
            got, expected = a.frozen.gather_full(), b.frozen.gather_full()
            compared += len(expected)
            same = same and all(torch.equal(got[n], expected[n]) for n in expected)
            same = same and torch.equal(a.frozen.shard, b.frozen.shard)  # the held bytes
    try:
        zerocore.save_checkpoint(root, 2, target, zerocore.optim.AdamW(target.parameters()),
                                 include_frozen=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return dict(compared=compared, same=same, refused=refused)


@pytest.mark.parametrize("placement", ["sharded", "replicated", "host"])
def test_a_load_quantizes_the_checkpoints_frozen_weights(world, tmp_path, placement):
    for r in world.run(frozen_loaded, str(tmp_path), placement):
        assert r["compared"] > 0 and r["same"]
        # Nothing quantized is ever saved: checkpoints hold the base, never its nf4 copy.
        assert "the frozen shards are nf4 copies of the base weights" in r["refused"]
