"""``zerocore.MetaLayer``: layers given as meta-device shapes plus a range reader. Each rank reads
only the elements of its own shard, and the sharded model is bitwise the one built from the
materialised layers (world sizes 1-3, trainable and frozen groups, parameters that already hold
values beside meta ones, bf16 groups)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore
from tests.support.dist_utils import all_gather_flat


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    stack = [nn.Sequential(nn.Linear(13, 31), nn.GELU()),
             nn.Sequential(nn.LayerNorm(31), nn.Linear(31, 31), nn.GELU()),
             nn.Linear(31, 7)]
    stack[1][1].weight.requires_grad_(False)   # a frozen group beside a trainable one
    return stack


def as_meta(index: int, layer: nn.Module, keep: set[str], log: list[tuple[str, int, int]]
            ) -> zerocore.MetaLayer:
    """The layer on the meta device except parameters named in ``keep`` (left with values),
    reading the values of the others from a copy, and logging each read."""
    values = {n: p.detach().clone() for n, p in layer.named_parameters()}
    meta = copy.deepcopy(layer).to("meta")
    for name, p in layer.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        owner = meta.get_submodule(owner_name) if owner_name else meta
        if name in keep:
            setattr(owner, attr, nn.Parameter(values[name], requires_grad=p.requires_grad))
        else:
            getattr(owner, attr).requires_grad_(p.requires_grad)

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        log.append((f"{index}.{name}", start, stop))
        return values[name].reshape(-1)[start:stop]
    return zerocore.MetaLayer(meta, read)


def full_state(model: zerocore.ShardedSequential) -> dict[str, torch.Tensor]:
    out = {}
    for layer in model.layers:
        for g in layer.groups:
            out[f"{layer.index}.{g.trainable}"] = all_gather_flat(g.shard)
            if g.trainable and g.shard.model_copy is not None:
                out[f"{layer.index}.copy"] = all_gather_flat(g.shard.model_copy)
    return out


def build_both(rank: int, world_size: int, dtype: torch.dtype) -> dict:
    mp = zerocore.MixedPrecision(param_dtype=dtype)
    plain = zerocore.shard(layers(), mixed_precision=mp)
    log: list[tuple[str, int, int]] = []
    keep = {"0.bias"}   # e.g. an adapter created on the CPU beside meta base weights
    meta = zerocore.shard([as_meta(i, l, keep if i == 0 else set(), log)
                           for i, l in enumerate(layers())], mixed_precision=mp)
    shard_numel = {f"{l.index}.{g.trainable}": g.layout.shard_numel
                   for l in meta.layers for g in l.groups}
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(rank)).to(dtype)
    meta(x).float().square().mean().backward()
    plain(x).float().square().mean().backward()
    grads = [(all_gather_flat(a.trainable_shard.grad), all_gather_flat(b.trainable_shard.grad))
             for a, b in zip(plain.layers, meta.layers)]
    return {"plain": full_state(plain), "meta": full_state(meta), "log": log,
            "shard_numel": shard_numel, "grads": grads}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_meta_layers_shard_bitwise_and_read_only_the_shard(worlds, world_size, dtype):
    results = worlds(world_size).run(build_both, dtype)
    for rank, r in enumerate(results):
        assert r["plain"].keys() == r["meta"].keys()
        for key, want in r["plain"].items():
            assert torch.equal(r["meta"][key], want), key
        for a, b in r["grads"]:
            assert torch.equal(a, b)
        read = sum(stop - start for _, start, stop in r["log"])
        # What this rank read is at most its shards of the meta groups (the kept bias aside).
        assert 0 < read <= sum(r["shard_numel"].values()), (read, r["shard_numel"])
        assert "0.0.bias" not in {name for name, _, _ in r["log"]}
        for name, start, stop in r["log"]:
            assert 0 <= start < stop
    # Together the ranks read every element of every meta parameter exactly once.
    everything = sorted((n, a, b) for r in results for n, a, b in r["log"])
    sizes = {f"{i}.{n}": p.numel() for i, l in enumerate(layers())
             for n, p in l.named_parameters()}
    covered: dict[str, int] = {}
    for name, start, stop in everything:
        covered[name] = covered.get(name, 0) + stop - start
    assert covered == {k: v for k, v in sizes.items() if k != "0.0.bias"}, (covered, sizes)
    assert len(set(everything)) == len(everything)


def meta_errors(rank: int, world_size: int, how: str) -> str:
    layer = nn.Linear(5, 5)
    try:
        if how == "no reader":
            stack: list = [layer.to("meta")]
        elif how == "wrong size":
            stack = [zerocore.MetaLayer(layer.to("meta"),
                                        lambda n, a, b: torch.zeros(b - a + 1))]
        else:
            layer.register_buffer("table", torch.zeros(3, device="meta"))
            stack = [zerocore.MetaLayer(layer.to("meta"), lambda n, a, b: torch.zeros(b - a))]
        zerocore.shard(stack)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("how, phrase", [
    ("no reader", "is on the meta device, without values"),
    ("wrong size", "expected"),
    ("meta buffer", "buffers ['table'] are on the meta device")])
def test_meta_layer_errors(worlds, how, phrase):
    for msg in worlds(1).run(meta_errors, how):
        assert phrase in msg, msg


# -- through shard_model: a model built on the meta device, read by the model's own names ------

class Tied(nn.Module):
    """A model whose first and last layers share a weight (the root's), with units between."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(23, 31)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(31), nn.Linear(31, 31),
                                                  nn.GELU()) for _ in range(3))
        self.head = nn.Linear(31, 23, bias=False)
        self.head.weight = self.embed.weight
        self.layers[1][1].weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model_both(rank: int, world_size: int) -> dict:
    plain = Tied()
    values = {n: p.detach().clone() for n, p in plain.named_parameters()}
    plain_sharding = zerocore.shard_model(plain, plain.layers)
    with torch.device("meta"):
        meta = Tied()
    meta.layers[1][1].weight.requires_grad_(False)
    log: list[tuple[str, int, int]] = []

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        log.append((name, start, stop))
        return values[name].reshape(-1)[start:stop]
    meta_sharding = zerocore.shard_model(meta, meta.layers, read=read)
    ids = torch.randint(0, 23, (3, 5), generator=torch.Generator().manual_seed(rank))
    for model in (plain, meta):
        model(ids).square().mean().backward()
    grads = [(all_gather_flat(a.trainable_shard.grad), all_gather_flat(b.trainable_shard.grad))
             for a, b in zip(plain_sharding.layers, meta_sharding.layers)
             if a.trainable_shard is not None]
    shard_numel = sum(g.layout.shard_numel for l in meta_sharding.layers for g in l.groups)
    return {"plain": full_state(plain_sharding), "meta": full_state(meta_sharding),
            "grads": grads, "log": log, "shard_numel": shard_numel,
            "sizes": {n: v.numel() for n, v in values.items()}}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_model_reads_a_meta_model_by_range_bitwise(worlds, world_size):
    # shard_model(read=) is MetaLayer's rank-local read for a whole model: the same shards,
    # model copies and gradients, bit for bit, as from the materialised model (the tied
    # weight, the root's, read once under its first name), each rank reading only its part.
    results = worlds(world_size).run(build_model_both)
    for r in results:
        assert r["plain"].keys() == r["meta"].keys()
        for key, want in r["plain"].items():
            assert torch.equal(r["meta"][key], want), key
        for a, b in r["grads"]:
            assert torch.equal(a, b)
        assert 0 < sum(b - a for _, a, b in r["log"]) <= r["shard_numel"]
    covered: dict[str, int] = {}
    for name, start, stop in sorted(e for r in results for e in r["log"]):
        covered[name] = covered.get(name, 0) + stop - start
    # Every element of every parameter once, the tied weight under its first name only.
    assert covered == {n: v for n, v in results[0]["sizes"].items()}, covered
