"""``zerocore.FrozenWeights("int8")``: frozen flat groups quantized once at ``shard()`` by blocks,
stored and all-gathered as int8 + fp32 scales, dequantized after each gather. Checked on the CPU
over gloo at world sizes 1-3:
- every rank's dequantized weights are those of quantizing the whole unsharded group once
  (blocks never straddle shards);
- training is bitwise that of the unquantized engine given the dequantized weights as its
  frozen weights (trainable parameters, masters and moments are never quantized), with and
  without the gathered-memory budget;
- all-gathers move 1 + 4/block bytes per frozen element, as the report expects, and the frozen
  shards take that much memory;
- checkpoints: include_frozen is refused, a load quantizes the frozen values it reads.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import zerocore
from zerocore.kernels import reference
from zerocore.engine.flat_layout import FlatLayout

from tests.support.toy_stack import Spec, accumulate_step, make_layers
from tests.support.toy_stack import train_digest as offload_digest

WORLD_SIZES = [1, 2, 3]
BLOCK = 64


CASES = {
    "mlp-biases-fp32": Spec(model="mlp", steps=3, micro=2, train="biases", max_norm=0.05),
    "transformer-bf16-frozen-embedding": Spec(model="transformer", steps=3, train="no_embedding",
                                              param_dtype=torch.bfloat16),
}


def computed_weights(model: zerocore.ShardedSequential) -> dict[str, torch.Tensor]:
    """The weights as the layers compute with them: trainable from the fp32 masters, frozen
    dequantized where int8 (every rank's shards gathered)."""
    return {f"{i}.{n}": t for i, state in model.iter_full_states() for n, t in state.items()}


def train_digest(model: zerocore.ShardedSequential, spec: Spec, rank: int,
                 world_size: int) -> dict:
    return offload_digest(model, spec, rank, world_size, final=computed_weights)


def int8_model(spec: Spec, layers: list[nn.Module] | None = None, **policies
               ) -> zerocore.ShardedSequential:
    return zerocore.shard(layers if layers is not None else make_layers(spec),
                          mixed_precision=zerocore.MixedPrecision(spec.param_dtype),
                          frozen_weights=zerocore.FrozenWeights("int8", block=BLOCK), **policies)


def dequantized_layers(spec: Spec, world_size: int) -> list[nn.Module]:
    """The stack with each frozen parameter replaced by what quantizing its whole flat group
    once (laid out as the int8 engine lays it out, fp32) and dequantizing gives."""
    layers = make_layers(spec)
    for layer in layers:
        frozen = [(n, p) for n, p in layer.named_parameters() if not p.requires_grad]
        if not frozen:
            continue
        layout = FlatLayout.build([(n, tuple(p.shape)) for n, p in frozen], world_size,
                                  block=BLOCK)
        flat = torch.zeros(layout.padded_numel)
        for (_, p), s in zip(frozen, layout.slots):
            flat[s.offset:s.offset + s.numel] = p.detach().reshape(-1).float()
        q, scales = reference.quantize_blockwise(flat, BLOCK)
        values = reference.dequantize_blockwise(q, scales, BLOCK, spec.param_dtype)
        with torch.no_grad():
            for (_, p), s in zip(frozen, layout.slots):
                p.copy_(values[s.offset:s.offset + s.numel].view(p.shape).to(p.dtype))
    return layers


def weights_as_quantized_once(rank: int, world_size: int, spec: Spec) -> dict:
    model = int8_model(spec)
    want = dequantized_layers(spec, world_size)
    mismatched, compared = [], 0
    for layer, ref in zip(model.layers, want):
        if layer.frozen is None:
            continue
        got = layer.frozen.gather_full()
        ref_params = dict(ref.named_parameters())
        for name, t in got.items():
            compared += 1
            if not torch.equal(t, ref_params[name].detach().to(spec.param_dtype)):
                mismatched.append(f"{layer.index}.{name}")
    return dict(mismatched=mismatched, compared=compared)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_gets_the_weights_of_quantizing_once(world, case):
    for r in world.run(weights_as_quantized_once, CASES[case]):
        assert r["compared"] > 0
        assert r["mismatched"] == []


def digest_int8(rank: int, world_size: int, spec: Spec, keep_gathered) -> dict:
    model = int8_model(spec, prefetch=zerocore.Prefetch(keep_gathered=keep_gathered))
    model.comm_report(reset=True)
    out = train_digest(model, spec, rank, world_size)
    report = model.comm_report()
    frozen_shard_bytes = sum(l.frozen.shard.numel() for l in model.layers if l.frozen)
    frozen_shard_numel = sum(l.frozen.layout.shard_numel for l in model.layers if l.frozen)
    return dict(out, gathered=report.all_gather_bytes, expected=report.expected_all_gather_bytes,
                frozen_shard_bytes=frozen_shard_bytes, frozen_shard_numel=frozen_shard_numel,
                memory=model.memory_report().model_state_bytes)


def digest_dequantized(rank: int, world_size: int, spec: Spec) -> dict:
    model = zerocore.shard(dequantized_layers(spec, world_size),
                           mixed_precision=zerocore.MixedPrecision(spec.param_dtype))
    model.comm_report(reset=True)
    out = train_digest(model, spec, rank, world_size)
    frozen = sum(g.layout.padded_numel for l in model.layers for g in l.groups if not g.trainable)
    return dict(out, gathered=model.comm_report().all_gather_bytes, frozen_padded=frozen)


@pytest.mark.parametrize("budget", [0, "all"], ids=["no-budget", "keep-all"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_is_bitwise_the_dequantized_model_and_gathers_less(world, case, budget):
    spec = CASES[case]
    plain = world.run(digest_dequantized, spec)
    int8 = world.run(digest_int8, spec, budget)
    passes = spec.steps * spec.micro
    for p, q in zip(plain, int8):
        assert q["digest"] == p["digest"]
        assert q["gathered"] < p["gathered"]
        # one byte per element and an fp32 scale per block: a quarter of fp32's bytes plus
        # 4/BLOCK, or half of bf16's
        assert q["frozen_shard_bytes"] == q["frozen_shard_numel"] * (1 + 4 / BLOCK)
        if budget == 0:
            assert q["gathered"] == passes * q["expected"]


def memory_after_a_step(rank: int, world_size: int) -> dict:
    spec = Spec(train="biases")
    model = int8_model(spec)
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    accumulate_step(model, spec, 0, rank, world_size)
    opt.step()   # moments exist; the gradients are kept (no zero_grad): all of the state
    report = model.memory_report(opt)
    return dict(predicted=report.predicted_bytes, state=report.model_state_bytes)


def test_memory_report_counts_int8_shards(world):
    for r in world.run(memory_after_a_step):
        # The prediction counts real parameters, the shards their padding too: the padding of
        # a group is under one block per rank, a few per cent of these tiny layers.
        assert r["predicted"] <= r["state"] <= 1.25 * r["predicted"] + 4096


def checkpoint_round_trip(rank: int, world_size: int, root: str) -> dict:
    spec = Spec(train="biases")
    model = int8_model(spec)
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        zerocore.save_checkpoint(root, 1, model, opt, include_frozen=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    # A checkpoint of the unquantized model with its frozen weights, loaded into the int8 one:
    # the frozen values read are quantized on the way in.
    torch.manual_seed(0)
    source = zerocore.shard(make_layers(spec))
    source_opt = zerocore.optim.AdamW(source.parameters(), lr=1e-2)
    path = zerocore.save_checkpoint(root, 2, source, source_opt, include_frozen=True)
    layers = make_layers(spec)
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters() if not p.requires_grad):
            p.mul_(-0.5)  # other frozen weights than the checkpoint's
    target = int8_model(spec, layers)
    target_opt = zerocore.optim.AdamW(target.parameters(), lr=1e-2)
    zerocore.load_checkpoint(path, target, target_opt)
    want = int8_model(spec)   # built from the checkpoint's weights directly
    same = True
    for a, b in zip(target.layers, want.layers):  # every rank gathers every layer: no shortcut
        if a.frozen is not None:
            got, expected = a.frozen.gather_full(), b.frozen.gather_full()
            same = same and all(torch.equal(got[n], expected[n]) for n in expected)
    return dict(refused=refused, same=same)


def test_checkpoints_refuse_int8_frozen_and_quantize_on_load(world, tmp_path):
    for r in world.run(checkpoint_round_trip, str(tmp_path)):
        assert r["refused"] and "int8 copies of the base weights" in r["refused"]
        assert r["same"]


def test_policy_checks():
    with pytest.raises(ValueError, match="dtype"):
        zerocore.FrozenWeights("int4")
    with pytest.raises(ValueError, match="block"):
        zerocore.FrozenWeights("int8", block=8)
    assert zerocore.FrozenWeights().int8_block is None
    assert zerocore.FrozenWeights("int8").int8_block == 128
    # Whole blocks per rank: the layout of an int8 group pads each shard to them.
    layout = FlatLayout.build([("w", (1000,))], 3, block=128)
    assert layout.shard_numel % 128 == 0 and layout.padded_numel >= 1000
    assert math.lcm(16, 48) == 48 and FlatLayout.build([("w", (5,))], 2, 48).shard_numel == 48
