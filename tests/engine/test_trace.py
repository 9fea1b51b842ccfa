"""A ``torch.profiler`` trace of one training step shows the engine: every layer's gather (issued
and waited for) and, for each layer with trainable parameters, its gradient reduction (issued
and delivered), labelled ``zerocore::<what> layer <index>``, and the optimizer step, one fused
launch over every layer's shard (``zerocore::adam``, around ``zerocore::fused_adam_multi``),
through both front doors, at world sizes 1-3."""

from __future__ import annotations

import collections

import pytest
from torch import nn
from torch.profiler import ProfilerActivity, profile

import zerocore
from tests.support.toy_stack import Spec, global_batch, loss_fn, make_layers

WORLD_SIZES = [1, 2, 3]


def traced_step(rank: int, world_size: int, door: str) -> dict:
    spec = Spec(model="transformer", train="no_embedding")  # layer 0 frozen: nothing to reduce
    layers = make_layers(spec)
    if door == "shard":
        model = sharding = zerocore.shard(layers)
    else:
        model = nn.Sequential(*layers)
        sharding = zerocore.shard_model(model, list(model))
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=1e-3)
    x, y = global_batch(spec, 0, 0, world_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(spec, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        opt.step()
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith("zerocore::"))
    counts["ops"] = sum(e.name == "zerocore::fused_adam_multi" for e in prof.events())
    trainable = [l.index for l in sharding.layers if l.trainable is not None]
    # A unit with no parameters of its own (shard_model's root here) gathers nothing: it has
    # no gather to label, only its wait.
    return dict(counts=dict(counts), layers=[l.index for l in sharding.layers if l.groups],
                trainable=trainable)


@pytest.mark.parametrize("door", ["shard", "shard_model"])
def test_a_trace_shows_each_layers_gathers_reduces_and_steps(world, door):
    for out in world.run(traced_step, door):
        counts = out["counts"]
        for i in out["layers"]:
            # Gathered for forward; layers in backward again (all but the frozen first one,
            # whose input needs no gradient), though the last stays gathered (keep_last).
            assert counts.get(f"zerocore::gather layer {i}", 0) >= 1, (i, counts)
            assert counts.get(f"zerocore::gather_wait layer {i}", 0) >= 1, (i, counts)
        for i in out["trainable"]:
            for what in ("reduce", "reduce_wait"):
                assert counts.get(f"zerocore::{what} layer {i}") == 1, (what, i, counts)
        assert 0 not in out["trainable"]
        assert "zerocore::reduce layer 0" not in counts
        # Every layer's fp32 shard stepped by one launch (one device, dtype and step count), in
        # its labelled region; no layer stepped on its own.
        assert counts.get("zerocore::adam") == 1 and counts["ops"] == 1, counts
        assert not any(name.startswith("zerocore::adam layer") for name in counts), counts
