"""``zerocore.shard_model(..., frozen_weights=FrozenWeights(dtype, placement=...))`` with int8,
NF4 and fp8 sharded, and NF4 and fp8 replicated: a transformers model with PEFT LoRA whose frozen
weights (the base model's, in the units and in the root) are held quantized trains bit for bit
as the same sharded model given the dequantized weights (tests/support/quantized_base.py: each
parameter of a quantized group sits on its own blocks, so quantizing it alone gives exactly what
the engine holds), at world sizes 1-3. Replicated, every rank holds the whole quantized base and
gathers only the adapters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from tests.support.dist_utils import global_mean
from tests.support.hf_models import batch, build, decoder_layers, prepare
from tests.support.quantized_base import FORMATS, dequantized

WORLD_SIZES = [1, 2, 3]
LOCAL_ROWS = 2
# (format, placement): int8 replicated is tests/engine/test_frozen_quantized.py's.
CASES = [("int8", "sharded"), ("nf4", "sharded"), ("fp8", "sharded"), ("nf4", "replicated"),
         ("fp8", "replicated")]


def train(model: nn.Module, rank: int, world_size: int, **policies) -> dict:
    sharded = zerocore.shard_model(model, decoder_layers(model), **policies)
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    sharded.comm_report(reset=True)
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
            "frozen_bytes": frozen_bytes, "gathered": sharded.comm_report().all_gather_bytes}


def quantized_run(rank: int, world_size: int, arch: str, dtype: str, placement: str) -> dict:
    model = prepare(build(arch), "lora")
    block = FORMATS[dtype]
    want = train(dequantized(model, dtype, block), rank, world_size)
    got = train(model, rank, world_size,
                frozen_weights=zerocore.FrozenWeights(dtype, block=block, placement=placement))
    return {"want": want, "got": got}


@pytest.mark.parametrize("dtype, placement", CASES, ids=[f"{d}-{p}" for d, p in CASES])
@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_lora_is_bitwise_the_dequantized_model(world, arch, dtype, placement):
    results = world.run(quantized_run, arch, dtype, placement)
    assert results[0]["want"]["adapter"], "no adapter gathered on rank 0: compared nothing"
    n = world.world_size
    for r in results:
        want, got = r["want"], r["got"]
        assert got["losses"] == want["losses"]
        assert want["adapter"].keys() == got["adapter"].keys()  # rank 0 only: the others {}
        for name, t in want["adapter"].items():
            assert torch.equal(got["adapter"][name], t), name
        # NF4: half a byte per frozen element, int8 and fp8 one, and a 4-byte scale per block,
        # against fp32's 4 (the reference's shard, 1/n of the base): per rank its part
        # (sharded) or every rank's part (replicated); 1.3 for the padding of small tensors to
        # whole blocks.
        per_element = (0.5 if dtype == "nf4" else 1) + 4 / FORMATS[dtype]
        parts = n if placement == "replicated" else 1
        assert got["frozen_bytes"] < 1.3 * parts * want["frozen_bytes"] * per_element / 4
        if placement == "replicated":   # the adapters alone: a small part of what fp32 moves
            assert got["gathered"] < 0.2 * want["gathered"]
        elif dtype == "nf4":            # every frozen byte too, in about an eighth of fp32's
            assert 0.2 * want["gathered"] < got["gathered"] < 0.5 * want["gathered"]
