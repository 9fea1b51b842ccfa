"""A failure on one rank while the model is being sharded is raised on every rank at once: the
layers are built in steps every rank agrees on (``Sharding.attempt`` / ``agree``), so the other
ranks learn of it at the next agreement instead of waiting in their next collective until the
process group's timeout. Each failure the GPU review named, injected on one rank of three: a
non-finite value in that rank's slice of an int8 frozen weight, an out-of-memory error while
building a layer (here while reading its values), and a device that rank cannot use in an NCCL
subgroup (its agreement over a gloo group of the subgroup's ranks alone). Every rank raises
within seconds with the same one-line message, naming the rank and the layer."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore.comm import device as zdevice
from zerocore.engine.sharding import BuildError

# Its tests bound in seconds how soon every rank has the failure: CI runs them alone, not beside
# other tests.
pytestmark = pytest.mark.deadline

# Without the agreement the other ranks would wait for the failed one until the group's
# timeout (tests/support/dist_utils.py, minutes); with it every rank is done within a tiny
# collective or two of the failure. 10 s is the bound, loose for a loaded 2-core machine.
BOUND_S = 10.0
FAILING = 1
WIDTH = 64


def stack(nan_in_rank_1_slice: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4)]
    for layer in layers:
        layer[0].weight.requires_grad_(False)   # frozen weights, trainable biases
    if nan_in_rank_1_slice:
        # Layer 2's flat frozen group is its weight alone, WIDTH * WIDTH elements in three equal
        # shards (int8 blocks of 128 divide it): an element in the middle of rank 1's.
        with torch.no_grad():
            layers[2][0].weight.view(-1)[WIDTH * WIDTH // 2] = float("nan")
    return layers


def build(rank: int, world_size: int, how: str, door: str) -> tuple[str | None, float]:
    start = time.perf_counter()
    try:
        if how == "int8-nan":
            layers = stack(nan_in_rank_1_slice=True)
            policies = dict(frozen_weights=zerocore.FrozenWeights("int8"))
        else:  # "oom": rank 1 runs out of memory reading layer 2's values
            layers = stack()

            def read(name: str, start: int, stop: int) -> torch.Tensor:
                raise torch.OutOfMemoryError("CPU out of memory (injected)")
            layers[2] = zerocore.MetaLayer(layers[2].to("meta"), read) if rank == FAILING \
                else layers[2]
            policies = {}
        if door == "shard":
            zerocore.shard(layers, **policies)
        else:
            modules = [l.module if isinstance(l, zerocore.MetaLayer) else l for l in layers]
            model = nn.Sequential(*modules)
            if how == "oom" and rank == FAILING:
                zerocore.shard_model(model, list(model), read=layers[2].read, **policies)
            else:
                zerocore.shard_model(model, list(model), **policies)
    except BuildError as e:
        return str(e), time.perf_counter() - start
    return None, time.perf_counter() - start


@pytest.mark.parametrize("door", ["shard", "shard_model"])
@pytest.mark.parametrize("how, cause", [("int8-nan", "inf or nan"),
                                        ("oom", "OutOfMemoryError")])
def test_a_failure_on_one_rank_is_raised_on_every_rank(worlds, how, cause, door):
    results = worlds(3).run(build, how, door)
    messages = {m for m, _ in results}
    assert len(messages) == 1 and None not in messages, results   # the same line everywhere
    message = messages.pop()
    assert "\n" not in message
    assert f"rank {FAILING} could not build layer 2" in message, message
    assert cause in message, message
    assert all(t < BOUND_S for _, t in results), results


def agree_in_subgroup(rank: int, world_size: int) -> tuple[str | None, float]:
    """Ranks 0-2 of 4 form a subgroup whose agreement runs over a side channel (as an NCCL
    subgroup's does); rank 1's device is one it cannot use (no visible GPU)."""
    sub = dist.new_group([0, 1, 2])
    if rank == 3:
        return None, 0.0
    ok = zerocore.Platform(host="h", torch_cuda="13.0", kernels_cuda=True,
                           cuda_device_count=4 if rank != FAILING else 0,
                           device_uuid=f"GPU-{rank}", usable_cores=8)
    start = time.perf_counter()
    try:
        zdevice.agree_on_devices(sub, torch.device("cuda", rank if rank != FAILING else 0),
                                 ok, side_channel=True)
    except ValueError as e:
        return str(e), time.perf_counter() - start
    return None, time.perf_counter() - start


def test_a_device_one_rank_cannot_use_in_an_nccl_subgroup_is_refused_on_every_rank(worlds):
    results = worlds(4).run(agree_in_subgroup)[:3]
    messages = {m for m, _ in results}
    assert len(messages) == 1 and None not in messages, results
    assert f"rank {FAILING}" in messages.pop()
    assert all(t < BOUND_S for _, t in results), results
