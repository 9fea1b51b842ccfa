"""neox checkpoint reading and writing: every Hugging Face layout, lazy per-layer reads, the
export transformers reloads, and a clear WeightsError for each kind of broken checkpoint."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch


import neox
from tests.support import neox_testing
import neox.weights.hf as hf_weights
from neox import WeightsError

transformers = pytest.importorskip("transformers")

# fp32 and the same ops as transformers (see test_neox_model.py for the derivation): only the
# attention kernel's accumulation order may differ.
ATOL, RTOL = 2e-5, 1e-5
VOCAB = 89
N_LAYERS = 4


def random_hf_model(seed: int = 0, **overrides):
    """The test's small random configuration; see neox_testing.random_hf_model."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=N_LAYERS,
                  num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                  rotary_pct=0.5)
    kwargs.update(overrides)
    return neox_testing.random_hf_model(transformers, seed, **kwargs)


IDS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS, use_cache=False) if hasattr(model, "lm_head") else model(IDS)
    return getattr(out, "logits", out)


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model()


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(path)
    return path


LEGACY_CONFIG = {  # transformers-4 key names, as the Pythia and 20B config.json files have
    "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": VOCAB,
    "hidden_size": 32, "num_hidden_layers": N_LAYERS, "num_attention_heads": 4,
    "intermediate_size": 48, "hidden_act": "gelu", "rotary_pct": 0.5, "rotary_emb_base": 10000,
    "max_position_embeddings": 64, "layer_norm_eps": 1e-5, "use_parallel_residual": True,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
}


def legacy_state(hf_model) -> dict[str, torch.Tensor]:
    """The model's tensors as an old pytorch_model.bin held them: ``embed_out.weight`` and the
    buffers transformers 4 saved (causal mask, masked_bias, rotary inv_freq)."""
    state = {("embed_out.weight" if k == "lm_head.weight" else k): v.clone()
             for k, v in hf_model.state_dict().items()}
    for i in range(N_LAYERS):
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 64, 64,
                                                                  dtype=torch.bool).tril()
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(4)
    return state


def write_sharded_bin(path: Path, state: dict[str, torch.Tensor], n_files: int) -> None:
    keys = sorted(state)
    weight_map = {}
    for f in range(n_files):
        name = f"pytorch_model-{f + 1:05d}-of-{n_files:05d}.bin"
        part = {k: state[k] for k in keys[f::n_files]}
        torch.save(part, path / name)
        weight_map.update({k: name for k in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


# -- every layout loads to transformers' logits ---------------------------------------------

def test_single_safetensors(hf_model, hf_dir):
    assert (hf_dir / "model.safetensors").is_file()
    torch.testing.assert_close(logits(neox.from_pretrained(hf_dir)), logits(hf_model),
                               atol=ATOL, rtol=RTOL)


def test_sharded_safetensors(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    torch.testing.assert_close(logits(neox.from_pretrained(tmp_path)), logits(hf_model),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("layout", ["bin", "bin-legacy-pickle", "bin-sharded", "bin-lm_head"])
def test_pytorch_bin(hf_model, tmp_path, layout):
    # transformers 5 no longer writes .bin files; these are written as older versions did.
    (tmp_path / "config.json").write_text(json.dumps(LEGACY_CONFIG))
    state = legacy_state(hf_model)
    if layout == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    elif layout == "bin-legacy-pickle":  # torch < 1.6 format: cannot be memory-mapped
        torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    elif layout == "bin-sharded":
        write_sharded_bin(tmp_path, state, 3)
    else:  # a transformers-5 state_dict() saved as is: lm_head.weight, no legacy buffers
        torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    torch.testing.assert_close(logits(neox.from_pretrained(tmp_path)), logits(hf_model),
                               atol=ATOL, rtol=RTOL)


def test_tied_embeddings(tmp_path):
    hf = random_hf_model(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    ours = neox.from_pretrained(tmp_path)
    torch.testing.assert_close(logits(ours), logits(hf), atol=ATOL, rtol=RTOL)
    # Exported untied; transformers reads it back to the same logits.
    neox.save_hf(tmp_path / "export", ours.config, neox.iter_layer_states(ours))
    assert not json.loads((tmp_path / "export" / "config.json").read_text())[
        "tie_word_embeddings"]
    back = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "export").eval()
    torch.testing.assert_close(logits(back), logits(ours), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_and_prepare(hf_dir, dtype):
    seen = []

    def prepare(layer):
        seen.append(layer.kind)
        layer.requires_grad_(False)

    with neox.open_weights(hf_dir) as reader:
        layers = list(neox.iter_layers(reader, filter_layers=[2], dtype=dtype, prepare=prepare))
    assert seen == ["embed", "block", "final_norm", "readout"]
    for layer in layers:
        for p in layer.parameters():
            assert p.dtype == dtype and not p.requires_grad and p.device.type == "cpu"


# -- laziness ---------------------------------------------------------------------------------

def test_filter_layers_reads_only_those_tensors(hf_model, hf_dir, monkeypatch):
    """Counts every tensor read out of model.safetensors."""
    read_keys = []
    real_safe_open = hf_weights.safe_open

    class CountingSafeOpen:
        def __init__(self, *args, **kwargs):
            self.f = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read_keys.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(hf_weights, "safe_open", CountingSafeOpen)
    neox.from_pretrained(hf_dir, filter_layers={2})
    assert sorted(read_keys) == sorted(
        ["embed_out.weight", "gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.bias",
         "gpt_neox.final_layer_norm.weight"]
        + [k for k in hf_model.state_dict() if k.startswith("gpt_neox.layers.2.")])


def test_filter_layers_never_opens_other_layer_files(hf_dir, tmp_path):
    """Our export puts one layer per file: delete the files of the blocks not kept, and the
    filtered model still loads (a full load then fails on the first missing file)."""
    export = tmp_path / "export"
    full = neox.from_pretrained(hf_dir)
    neox.save_hf(export, full.config, neox.iter_layer_states(full))
    weight_map = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    for block in (0, 2, 3):
        (export / weight_map[f"gpt_neox.layers.{block}.mlp.dense_h_to_4h.weight"]).unlink()
    ours = neox.from_pretrained(export, filter_layers=[1])
    hf = random_hf_model()  # the same weights as hf_dir's (same seed), free to modify
    hf.gpt_neox.layers = torch.nn.ModuleList([hf.gpt_neox.layers[1]])
    hf.config.num_hidden_layers = 1
    torch.testing.assert_close(logits(ours), logits(hf), atol=ATOL, rtol=RTOL)
    missing = export / weight_map["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"]
    with pytest.raises(WeightsError, match=re.escape(f"{missing}: missing file")):
        neox.from_pretrained(export)


def test_iter_layers_reads_one_layer_per_step(hf_dir):
    """The generator reads a layer only when asked for it."""

    class Recording(hf_weights.HFReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.reads = []

        def read(self, kind, index=None):
            self.reads.append((kind, index))
            return super().read(kind, index)

    reader = Recording(hf_dir)
    it = neox.iter_layers(reader, filter_layers=[1, 3])
    assert reader.reads == []
    next(it)
    assert reader.reads == [("embed", None)]
    next(it)
    assert reader.reads == [("embed", None), ("block", 1)]
    assert len(list(it)) == 3
    assert reader.reads[2:] == [("block", 3), ("final_norm", None), ("readout", None)]


def test_random_init_is_deterministic_and_filter_consistent():
    config = dataclasses.replace(neox.PRESETS["tiny"], vocab_size=120, num_hidden_layers=3)
    full = list(neox.iter_layers(neox.RandomInit(config, seed=7)))
    sub = list(neox.iter_layers(neox.RandomInit(config, seed=7), filter_layers=[2]))
    other = list(neox.iter_layers(neox.RandomInit(config, seed=8), filter_layers=[2]))
    for a, b in zip([full[0], full[3], full[4], full[5]], sub):
        for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), n
    assert not torch.equal(sub[1].attention.dense.weight, other[1].attention.dense.weight)


# -- export -----------------------------------------------------------------------------------

def test_save_hf_reloads_in_transformers(hf_dir, tmp_path):
    ours = neox.from_pretrained(hf_dir)
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    out = neox.save_hf(tmp_path / "export", ours.config, neox.iter_layer_states(ours),
                       extra_files={"tokenizer.json": tok})
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", "tokenizer.json"]
        + [f"model-{i:05d}-of-00007.safetensors" for i in range(1, 8)])
    assert not list(tmp_path.glob(".export*"))  # the temporary directory is gone
    back = transformers.GPTNeoXForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(back), logits(ours), atol=ATOL, rtol=RTOL)
    # Through our own reader: the same fp32 values through the same code, so bitwise equal.
    torch.testing.assert_close(logits(neox.from_pretrained(out)), logits(ours), atol=0, rtol=0)


def test_save_hf_of_filtered_model_is_a_smaller_model(hf_dir, tmp_path):
    ours = neox.from_pretrained(hf_dir, filter_layers=[0, 3])
    neox.save_hf(tmp_path / "export", ours.config, neox.iter_layer_states(ours))
    back = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert back.config.num_hidden_layers == 2
    torch.testing.assert_close(logits(back), logits(ours), atol=ATOL, rtol=RTOL)


def test_save_hf_is_atomic_and_checks_its_input(hf_dir, tmp_path):
    ours = neox.from_pretrained(hf_dir)
    target = tmp_path / "export"

    def interrupted():
        for i, item in enumerate(neox.iter_layer_states(ours)):
            if i == 3:
                raise KeyboardInterrupt
            yield item

    with pytest.raises(KeyboardInterrupt):
        neox.save_hf(target, ours.config, interrupted())
    assert not target.exists() and list(tmp_path.iterdir()) == []

    states = list(neox.iter_layer_states(ours))
    with pytest.raises(ValueError, match="no tensors were given for block 3, readout"):
        neox.save_hf(target, ours.config, states[:4] + states[5:6])
    with pytest.raises(ValueError, match="block 1 was given twice"):
        neox.save_hf(target, ours.config, states[:3] + states[2:])
    with pytest.raises(ValueError, match="unexpected layer block 4"):
        neox.save_hf(target, ours.config, states + [("block", 4, states[1][2])])
    bad = dict(states[1][2])
    bad["mlp.dense_h_to_4h.bias"] = torch.zeros(3)
    with pytest.raises(ValueError,
                       match=r"block 0 tensor 'mlp.dense_h_to_4h.bias' has shape \(3,\)"):
        neox.save_hf(target, ours.config, [states[0], ("block", 0, bad)] + states[2:])
    assert list(tmp_path.iterdir()) == []

    neox.save_hf(target, ours.config, states)
    with pytest.raises(FileExistsError, match="not an empty directory"):
        neox.save_hf(target, ours.config, states)
    neox.save_hf(target, ours.config, states, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# -- errors -----------------------------------------------------------------------------------

def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_and_unreadable(hf_dir, tmp_path):
    with pytest.raises(WeightsError, match="no such weights directory"):
        neox.from_pretrained(tmp_path / "nope")
    with pytest.raises(WeightsError, match="is a file"):
        neox.from_pretrained(hf_dir / "model.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no weights found"):
        neox.from_pretrained(tmp_path / "empty")

    d = copy_dir(hf_dir, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(WeightsError, match=re.escape(f"{d / 'config.json'}: missing")):
        neox.from_pretrained(d)
    # ... unless a config is given
    config = neox.open_weights(hf_dir).config
    assert neox.from_pretrained(d, config=config).config == config

    d = copy_dir(hf_dir, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="config.json: cannot read"):
        neox.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**LEGACY_CONFIG, "hidden_act": "swishy"}))
    with pytest.raises(WeightsError, match="config.json: .*hidden_act 'swishy'"):
        neox.from_pretrained(d)

    d = copy_dir(hf_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no weights; expected one of"):
        neox.from_pretrained(d)

    d = copy_dir(hf_dir, tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(WeightsError, match="model.safetensors: not a readable safetensors"):
        neox.from_pretrained(d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(WeightsError, match="pytorch_model.bin: cannot load"):
        neox.from_pretrained(d)


def write_bin_dir(path: Path, state: dict[str, torch.Tensor], config=LEGACY_CONFIG) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    torch.save(state, path / "pytorch_model.bin")
    return path


def test_missing_tensor_names_file_and_tensor(hf_model, tmp_path):
    state = legacy_state(hf_model)
    del state["gpt_neox.layers.2.attention.dense.bias"]
    d = write_bin_dir(tmp_path / "d", state)
    with pytest.raises(WeightsError, match=re.escape(
            f"{d / 'pytorch_model.bin'}: tensor 'gpt_neox.layers.2.attention.dense.bias': "
            f"missing from the checkpoint")):
        neox.from_pretrained(d)
    # a filter that skips block 2 does not need it
    neox.from_pretrained(d, filter_layers=[0, 1, 3])

    state = legacy_state(hf_model)
    del state["embed_out.weight"]
    d = write_bin_dir(tmp_path / "noreadout", state)
    with pytest.raises(WeightsError, match="tensor 'embed_out.weight': missing"):
        neox.from_pretrained(d)

    state = {k: v for k, v in legacy_state(hf_model).items() if ".layers.1." not in k}
    d = write_bin_dir(tmp_path / "noblock", state)
    with pytest.raises(WeightsError, match=r"layers\.1\..*missing from the checkpoint \(and "
                                              r"11 more tensors of block 1\)"):
        neox.from_pretrained(d)


def test_shape_mismatch_names_tensor_and_shapes(hf_model, tmp_path):
    state = legacy_state(hf_model)
    state["gpt_neox.layers.1.mlp.dense_h_to_4h.bias"] = torch.zeros(47)
    d = write_bin_dir(tmp_path / "d", state)
    with pytest.raises(WeightsError, match=re.escape(
            "pytorch_model.bin: tensor 'gpt_neox.layers.1.mlp.dense_h_to_4h.bias': shape (47,) "
            "does not match the configuration, which needs (48,)")):
        neox.from_pretrained(d)
    # a configuration that does not fit the weights
    d = write_bin_dir(tmp_path / "cfg", legacy_state(hf_model),
                      {**LEGACY_CONFIG, "intermediate_size": 64})
    with pytest.raises(WeightsError, match=r"dense_h_to_4h.weight': shape \(48, 32\) does not "
                                              r"match the configuration, which needs \(64, 32\)"):
        neox.from_pretrained(d)


def test_unknown_tensors(hf_model, tmp_path):
    state = legacy_state(hf_model)
    state["gpt_neox.layers.0.attention.lora_A.weight"] = torch.zeros(2, 2)
    d = write_bin_dir(tmp_path / "inblock", state)
    with pytest.raises(WeightsError, match=re.escape(
            f"{d / 'pytorch_model.bin'}: tensor 'gpt_neox.layers.0.attention.lora_A.weight': "
            f"unknown tensor")):
        neox.from_pretrained(d)

    state = legacy_state(hf_model)
    state["score.weight"] = torch.zeros(2, 32)
    d = write_bin_dir(tmp_path / "toplevel", state)
    with pytest.raises(WeightsError, match="unknown tensor 'score.weight'"):
        neox.open_weights(d)

    state = legacy_state(hf_model)
    state["gpt_neox.layers.4.input_layernorm.weight"] = torch.ones(32)
    d = write_bin_dir(tmp_path / "extrablock", state)
    with pytest.raises(WeightsError, match=r"belongs to block 4, but the configuration has 4 "
                                              r"blocks \(0\.\.3\)"):
        neox.open_weights(d)

    state = legacy_state(hf_model)
    state["lm_head.weight"] = state["embed_out.weight"]
    d = write_bin_dir(tmp_path / "twice", state)
    with pytest.raises(WeightsError, match="are both readout embed_out.weight"):
        neox.open_weights(d)

    state = legacy_state(hf_model)
    state["gpt_neox.layers.0.attention.dense.bias"] = torch.zeros(32, dtype=torch.int64)
    d = write_bin_dir(tmp_path / "intdtype", state)
    with pytest.raises(WeightsError, match="dense.bias'.*dtype torch.int64"):
        neox.from_pretrained(d)


def test_broken_index(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "a", max_shard_size="20KB")
    d = tmp_path / "a"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = "gpt_neox.layers.3.attention.query_key_value.weight"
    victim = d / index["weight_map"][key]
    victim.rename(d / "moved.safetensors")
    with pytest.raises(WeightsError, match=re.escape(
            f"{victim}: missing file (listed in model.safetensors.index.json)")):
        neox.from_pretrained(d)
    (d / "moved.safetensors").rename(victim)

    index["weight_map"][key] = index["weight_map"]["gpt_neox.embed_in.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=f"tensor '{re.escape(key)}' is listed in "
                                              f"model.safetensors.index.json but not in the file"):
        neox.from_pretrained(d)

    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(WeightsError, match="not a readable weight index"):
        neox.from_pretrained(d)


# -- configurations that change the computation ------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     r"quantization_config is set \(gptq\): quantized weights are not supported"),
    ({"architectures": ["GPTNeoXForSequenceClassification"]},
     r"architectures is \['GPTNeoXForSequenceClassification'\]: "
     r"GPTNeoXForSequenceClassification ends in a task head"),
])
def test_config_keys_that_change_the_math_are_refused(hf_model, tmp_path, change, message):
    d = write_bin_dir(tmp_path / "d", legacy_state(hf_model), {**LEGACY_CONFIG, **change})
    with pytest.raises(WeightsError, match=re.escape(f"{d / 'config.json'}: config ") + message):
        neox.open_weights(d)


def test_config_keys_that_do_not_change_the_math_are_ignored(hf_model, tmp_path):
    harmless = {"architectures": ["GPTNeoXModel"], "quantization_config": None,
                "attention_dropout": 0.1, "hidden_dropout": 0.1, "classifier_dropout": 0.1,
                "initializer_range": 0.5, "use_cache": False, "dtype": "float16",
                "_attn_implementation": "eager", "num_key_value_heads": 4}
    d = write_bin_dir(tmp_path / "d", legacy_state(hf_model), {**LEGACY_CONFIG, **harmless})
    torch.testing.assert_close(logits(neox.from_pretrained(d)), logits(hf_model),
                               atol=ATOL, rtol=RTOL)


# -- the weights directory is self-contained ---------------------------------------------------

def sharded_with_one_file_moved(hf_model, root: Path, name_for) -> tuple[Path, Path]:
    """A sharded safetensors directory whose index names one shard by ``name_for(moved)``,
    the shard having been moved to ``root/outside``."""
    d = root / "model"
    hf_model.save_pretrained(d, max_shard_size="20KB")
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"]["gpt_neox.layers.1.attention.dense.weight"]
    (root / "outside").mkdir()
    moved = (d / shard).rename(root / "outside" / "x.safetensors")
    index["weight_map"] = {k: (name_for(moved) if v == shard else v)
                           for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    return d, moved


def refused_unless_allowed(d: Path, hf_model, message: str) -> None:
    """Opening ``d`` fails with ``message``; with allow_outside it reads ``hf_model``."""
    with pytest.raises(WeightsError, match=message):
        neox.open_weights(d)
    torch.testing.assert_close(logits(neox.from_pretrained(d, allow_outside=True)),
                               logits(hf_model), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_index_naming_a_file_outside_is_refused(hf_model, tmp_path, how):
    name_for = (lambda moved: "../outside/x.safetensors") if how == "relative" else str
    d, moved = sharded_with_one_file_moved(hf_model, tmp_path, name_for)
    named = re.escape(repr(name_for(moved)))
    refused_unless_allowed(d, hf_model, (
        rf"{re.escape(str(d))}: model\.safetensors\.index\.json \(weight_map\) names {named}, "
        rf"which leads outside the weights directory \(to {re.escape(str(moved))}\); copy the "
        rf"file into it, or allow files outside explicitly"))


def test_sharded_bin_outside_is_read_from_where_the_index_says(hf_model, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LEGACY_CONFIG))
    write_sharded_bin(d, legacy_state(hf_model), 3)
    (tmp_path / "outside").mkdir()
    (d / "pytorch_model-00002-of-00003.bin").rename(tmp_path / "outside" / "two.bin")
    index = json.loads((d / "pytorch_model.bin.index.json").read_text())
    index["weight_map"] = {k: "../outside/two.bin" if v.startswith("pytorch_model-00002") else v
                           for k, v in index["weight_map"].items()}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    refused_unless_allowed(d, hf_model, r"names '\.\./outside/two\.bin', which leads outside")


def test_weight_file_linked_outside_is_refused(hf_model, hf_dir, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text((hf_dir / "config.json").read_text())
    (d / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    target = re.escape(str((hf_dir / "model.safetensors").resolve()))
    refused_unless_allowed(d, hf_model, rf"{re.escape(str(d))}: the weight file "
                                        rf"'model\.safetensors', which leads outside the "
                                        rf"weights directory \(to {target}\)")
    # The configuration too.
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(hf_dir / "config.json")
    with pytest.raises(WeightsError, match=r"the configuration 'config\.json', which leads "
                                           r"outside"):
        neox.open_weights(d, allow_outside=False)


def test_hub_cache_snapshot_links_into_its_blobs(hf_model, tmp_path):
    """huggingface_hub's cache: models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>.
    One download, so it is read without allow_outside."""
    repo = tmp_path / "hub" / "models--EleutherAI--tiny"
    source = tmp_path / "saved"
    hf_model.save_pretrained(source, max_shard_size="20KB")
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(source.iterdir())):
        f.rename(repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    torch.testing.assert_close(logits(neox.from_pretrained(snapshot)), logits(hf_model),
                               atol=ATOL, rtol=RTOL)
    # Not a hub cache: the same links from a folder of another name lead outside.
    other = repo / "copies" / "0123abcd"
    other.parent.mkdir()
    snapshot.rename(other)
    with pytest.raises(WeightsError, match="leads outside the weights directory"):
        neox.open_weights(other)


class _RunsCode:
    """A pickled object whose loading would call a function (here: create a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_bin_that_would_run_code_is_refused_in_one_line(tmp_path):
    """torch's own refusal ends by saying weights_only=False "will likely succeed": the advice
    not to take with an untrusted file; neox says what was refused, in one line, and nothing
    of the file runs."""
    from neox.weights.base import load_state_file
    marker = tmp_path / "it-ran"
    torch.save({"gpt_neox.embed_in.weight": torch.zeros(2), "x": _RunsCode(marker)},
               tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError) as raised:
        load_state_file(tmp_path / "pytorch_model.bin")
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'pytorch_model.bin'}: refused")
    assert "weights_only" not in message and "likely succeed" not in message
    assert "unsupported global" in message.lower(), message
    assert not marker.exists()
