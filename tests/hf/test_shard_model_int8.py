"""``zerocore.shard_model(..., frozen_weights=FrozenWeights("int8"))``: a transformers model with
PEFT LoRA whose frozen weights (the base model's, in the units and in the root) are held and
gathered as int8 trains bit for bit as the same sharded model given the dequantized weights,
at world sizes 1-3: each parameter of an int8 group sits on its own blocks, so quantizing it
alone (zero-padded to whole blocks) gives exactly what the engine holds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore
from zerocore.kernels import reference
from tests.support.dist_utils import global_mean
from tests.support.hf_models import batch, build, decoder_layers, prepare

WORLD_SIZES = [1, 2, 3]
BLOCK = 64
LOCAL_ROWS = 2


def dequantized(model: nn.Module) -> nn.Module:
    """A copy whose frozen parameters are replaced by their int8 round trip (blockwise)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                continue
            flat = p.detach().float().reshape(-1)
            padded = torch.zeros(-(-flat.numel() // BLOCK) * BLOCK)
            padded[:flat.numel()] = flat
            q, scales = reference.quantize_blockwise(padded, BLOCK)
            values = reference.dequantize_blockwise(q, scales, BLOCK, torch.float32)
            p.copy_(values[:flat.numel()].view(p.shape))
    return model


def train(model: nn.Module, rank: int, world_size: int, **policies) -> dict:
    sharded = zerocore.shard_model(model, decoder_layers(model), **policies)
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        ids = batch(step, LOCAL_ROWS * world_size)
        loss = model(input_ids=ids.chunk(world_size)[rank], labels=ids.chunk(world_size)[rank],
                     use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if not p.requires_grad)
    return {"losses": losses, "adapter": sharded.full_state_dict(trainable_only=True),
            "frozen_bytes": frozen_bytes}


def int8_run(rank: int, world_size: int, arch: str) -> dict:
    model = prepare(build(arch), "lora")
    want = train(dequantized(model), rank, world_size)
    got = train(model, rank, world_size,
                frozen_weights=zerocore.FrozenWeights("int8", block=BLOCK))
    return {"want": want, "got": got}


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_int8_lora_is_bitwise_the_dequantized_model(world, arch):
    results = world.run(int8_run, arch)
    assert results[0]["want"]["adapter"], "no adapter gathered on rank 0: compared nothing"
    for r in results:
        want, got = r["want"], r["got"]
        assert got["losses"] == want["losses"]
        assert want["adapter"].keys() == got["adapter"].keys()  # rank 0 only: the others {}
        for name, t in want["adapter"].items():
            assert torch.equal(got["adapter"][name], t), name
        # one byte per frozen element and a 4-byte scale per block (plus padding), against 4
        assert got["frozen_bytes"] < 0.3 * want["frozen_bytes"]
