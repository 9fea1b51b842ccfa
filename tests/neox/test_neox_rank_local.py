"""Reading only this rank's share of pretrained weights: the readers' ``shapes`` and
``read_range`` (Hugging Face safetensors and memory-mapped ``.bin``, GPT-NeoX slim partitions,
tied readouts) give exactly the elements ``read`` gives; and a model built from range reads
(``neox.run.build.source_layer`` -> ``zerocore.MetaLayer``) is bitwise the one built from whole
layers, at world sizes 1-3, in every fine-tuning mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerocore
from tests.support.dist_utils import all_gather_flat
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import layer_specs
from neox.run.build import source_layer
from neox.weights import RandomInit, iter_layer_states, materialize, meta_layer, open_weights, \
    save_hf
from neox.weights.hf import hf_key
from tests.support.slim_weights import neox_yaml, random_model, small_config, write_slim


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """The same random model in each format a reader reads by range."""
    root = tmp_path_factory.mktemp("rank-local")
    config = small_config()
    model = random_model(config)
    hf = save_hf(root / "hf", config, iter_layer_states(model))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((hf / "config.json").read_text())
    state = {hf_key(kind, index, name): t.clone() for kind, index, layer in
             iter_layer_states(model) for name, t in layer.items()}
    torch.save(state, bin_dir / "pytorch_model.bin")
    slim = write_slim(hf, root / "slim", yaml_text=neox_yaml(config))
    tied = write_slim(hf, root / "slim-tied", yaml_text=neox_yaml(config, tied=True), tied=True)
    return {"safetensors": hf, "bin": bin_dir, "slim": slim, "slim-tied": tied}


FORMATS = ["safetensors", "bin", "slim", "slim-tied"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ranges_are_the_elements_read_gives(weights, fmt):
    with open_weights(weights[fmt]) as reader:
        for spec in layer_specs(reader.config):
            whole = reader.read(spec.kind, spec.source)
            shapes = reader.shapes(spec.kind, spec.source)
            assert shapes == {n: (t.shape, t.dtype) for n, t in whole.items()}
            for name, t in whole.items():
                flat, n = t.reshape(-1), t.numel()
                row = t.shape[-1] if t.dim() > 1 else 1
                # the whole, a row boundary crossed both ways, single elements at the ends
                for a, b in ((0, n), (row - 1, 2 * row + 3), (n - 1, n), (0, 1),
                             (n // 3, 2 * n // 3)):
                    a, b = min(a, n - 1), min(max(b, a + 1), n)
                    got = reader.read_range(spec.kind, spec.source, name, a, b)
                    assert torch.equal(got, flat[a:b]), (spec, name, a, b)


def test_random_init_reads_whole_layers():
    reader = RandomInit(small_config())
    spec = layer_specs(reader.config)[1]
    assert reader.shapes(spec.kind, spec.source) is None and meta_layer(reader, spec) is None


def build(rank: int, world_size: int, path: str, mode: str, ranged: bool) -> dict:
    finetune = FinetuneMode(mode, lora_rank=2, seed=3)
    with open_weights(path) as reader:
        specs = layer_specs(reader.config, (0, 2))

        def layers():
            for i, spec in enumerate(specs):
                if ranged:
                    yield source_layer(reader, spec, i, finetune)
                else:
                    yield prepare_layer(materialize(reader, spec), i, finetune)
        model = zerocore.shard(layers(), mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    out = {}
    for layer in model.layers:
        for g in layer.groups:
            out[f"{layer.index}.{g.trainable}"] = all_gather_flat(g.shard)
    return {"shards": out}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("fmt, mode", [("safetensors", "lora"), ("bin", "biases"),
                                       ("slim", "full"), ("slim-tied", "lora")])
def test_built_from_ranges_is_bitwise_the_whole_layer_build(worlds, weights, world_size, fmt,
                                                            mode):
    world = worlds(world_size)
    whole = world.run(build, str(weights[fmt]), mode, False)
    ranged = world.run(build, str(weights[fmt]), mode, True)
    for a, b in zip(whole, ranged):
        assert a["shards"].keys() == b["shards"].keys()
        for key, want in a["shards"].items():
            assert torch.equal(b["shards"][key], want), key


def test_source_layer_is_a_meta_layer_where_the_format_allows(weights):
    mode = FinetuneMode("lora", lora_rank=2)
    with open_weights(weights["safetensors"]) as reader:
        spec = layer_specs(reader.config)[1]
        layer = source_layer(reader, spec, 1, mode)
        assert isinstance(layer, zerocore.MetaLayer)
        meta = {n for n, p in layer.module.named_parameters() if p.is_meta}
        held = {n for n, p in layer.module.named_parameters() if not p.is_meta}
        assert held and all("lora_" in n for n in held)           # adapters: created here
        assert "attention.query_key_value.weight" in meta        # base weights: read by range
    assert not isinstance(source_layer(RandomInit(small_config()), spec, 1, mode),
                          zerocore.MetaLayer)
    assert json.loads((weights["bin"] / "config.json").read_text())["hidden_size"] == 32
