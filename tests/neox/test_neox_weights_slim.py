"""neox.weights.slim: EleutherAI GPT-NeoX "slim weights" (layer_XX-model_YY-model_states.pt).

Two kinds of check:
- Round trip: a random model written with ``neox.save_hf``, split here into 2 tensor-parallel
  partitions in the slim layout (the inverse of the merge, written independently of the
  module's rule table), must load through ``neox.from_pretrained`` to the same logits as the
  Hugging Face directory, bit for bit.
- Semantics: partitions drawn independently at random are run the way NeoX runs them on 2
  ranks (each rank its heads and its MLP slice, partial outputs summed, biases added where
  NeoX adds them), and the merged single-device layer must compute the same thing. This is
  what pins the qkv head layout, the row-parallel concatenation and the bias merge to the
  format's meaning rather than to our own inverse.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import neox
from neox.config import PRESETS, NeoXConfig
from neox.model import ACTIVATIONS, apply_rotary, build_layer, rotary_cos_sin
from neox.weights import WeightsError, iter_layer_states, save_hf
from neox.weights.neox_yaml import config_from_neox_yaml, parse_flat_yaml, read_neox_yaml
from neox.weights.slim import (PartitionsDifferWarning, SlimReader, find_slim_directory,
                               open_slim, slim_file_name)
from tests.support.slim_weights import TP, neox_yaml, random_model, small_config, write_slim

def logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module", params=["parallel", "sequential"])
def dirs(request, tmp_path_factory):
    """(config, HF directory, slim directory with YAML) of one random model."""
    config = small_config(use_parallel_residual=request.param == "parallel",
                          hidden_act="gelu_fast" if request.param == "parallel" else "gelu")
    root = tmp_path_factory.mktemp(f"slim-{request.param}")
    hf_dir = save_hf(root / "hf", config, iter_layer_states(random_model(config)))
    slim_dir = write_slim(hf_dir, root / "slim", yaml_text=neox_yaml(config))
    return config, hf_dir, slim_dir


IDS = torch.randint(0, 102, (2, 11), generator=torch.Generator().manual_seed(1))


def test_slim_loads_to_the_same_model_as_hf(dirs):
    config, hf_dir, slim_dir = dirs
    with neox.open_weights(slim_dir) as reader:
        assert isinstance(reader, SlimReader)
        assert reader.tp == TP
        # Everything the model needs comes from the YAML, the vocabulary from the files.
        assert reader.config == config
        assert "20B.yml" in reader.description
        expected_merge = "sum" if config.use_parallel_residual else "mean"
        assert reader.row_parallel_bias == expected_merge
    slim_model = neox.from_pretrained(slim_dir)
    hf_model = neox.from_pretrained(hf_dir)
    # Same tensors bit for bit (concatenation is exact, halves sum back exactly, identical
    # copies average to themselves), so the logits are identical, not merely close.
    for (name, a), (_, b) in zip(slim_model.state_dict().items(), hf_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(logits(slim_model, IDS), logits(hf_model, IDS))


def test_filter_layers_reads_only_the_chosen_layer_files(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = tmp_path / "slim"
    work.mkdir()
    for f in slim_dir.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    # Blocks 0 and 2 become garbage: a reader that opened them would fail.
    for layer in (2, 4):
        for r in range(TP):
            (work / slim_file_name(layer, r)).write_bytes(b"not a torch file")
    filtered = neox.from_pretrained(work, filter_layers=[1])
    reference = neox.from_pretrained(hf_dir, filter_layers=[1])
    assert filtered.source_layers == (1,)
    assert torch.equal(logits(filtered, IDS), logits(reference, IDS))
    with pytest.raises(WeightsError, match=r"layer_02-model_00-model_states\.pt: cannot load"):
        neox.from_pretrained(work)


def test_missing_partition_is_a_clear_error(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    (work / slim_file_name(3, 1)).unlink()  # block 1, rank 1
    with pytest.raises(WeightsError,
                       match=r"layer_03-model_01-model_states\.pt: missing; it holds "
                             r"tensor-parallel partition 1 of 2 of block 1"):
        neox.from_pretrained(work)
    # The other blocks are still readable: a partial download can be used with filter_layers.
    neox.from_pretrained(work, filter_layers=[0, 2])


def test_shape_mismatch_between_partitions_names_file_and_tensor(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    file = work / slim_file_name(2, 1)
    state = torch.load(file, weights_only=True)
    state["attention.dense.weight"] = state["attention.dense.weight"][:, :-1].clone()
    torch.save(state, file)
    with pytest.raises(WeightsError,
                       match=r"layer_02-model_01-model_states\.pt: tensor "
                             r"'attention\.dense\.weight' has shape \(32, 15\) but \(32, 16\)"):
        neox.from_pretrained(work)


@pytest.mark.parametrize("new_names", [False, True])
def test_partitions_that_do_not_fit_the_config_name_file_and_tensor(dirs, tmp_path, new_names):
    config, hf_dir, slim_dir = dirs
    if new_names:  # messages name the tensor as the files do
        slim_dir = write_slim(hf_dir, tmp_path / "new", new_names=True)
    name = re.escape("mlp.linear1.weight" if new_names else "mlp.dense_h_to_4h.weight")
    wrong = dataclasses.replace(config, intermediate_size=64)
    with pytest.raises(WeightsError,
                       match=rf"layer_02-model_00-model_states\.pt \(and the other 1 "
                             rf"partition\(s\)\): tensor '{name}': shape \(128, 32\) does not "
                             rf"match"):
        neox.from_pretrained(slim_dir, config=wrong)


def test_unknown_and_missing_keys(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    file0, file1 = work / slim_file_name(3, 0), work / slim_file_name(3, 1)
    original0 = torch.load(file0, weights_only=True)
    original1 = torch.load(file1, weights_only=True)

    torch.save({**original0, "attention.extra.weight": torch.zeros(2)}, file0)
    with pytest.raises(WeightsError, match=r"layer_03-model_00-model_states\.pt: unknown "
                                              r"tensor 'attention\.extra\.weight' for block 1"):
        neox.from_pretrained(work)

    torch.save(original0, file0)
    torch.save({k: v for k, v in original1.items() if k != "mlp.dense_4h_to_h.bias"}, file1)
    with pytest.raises(WeightsError, match=r"layer_03-model_01-model_states\.pt: tensor "
                                              r"'mlp\.dense_4h_to_h\.bias' is missing from this "
                                              r"partition"):
        neox.from_pretrained(work)

    torch.save({k: v for k, v in original0.items() if k != "mlp.dense_4h_to_h.bias"}, file0)
    with pytest.raises(WeightsError, match=r"layer_03-model_00-model_states\.pt .*tensor "
                                              r"'mlp\.dense_4h_to_h\.bias': missing"):
        neox.from_pretrained(work)


# -- the merge against NeoX's tensor-parallel computation ----------------------------------------

def random_partitions(config: NeoXConfig, tp: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """One block's partitions drawn independently, honouring only what Megatron guarantees:
    layer norms are identical on every rank, and so are row-parallel biases when they are
    added after the all-reduce (sequential residual). With the parallel residual the bias
    copies are arbitrary: only their sum reaches the output."""
    g = torch.Generator().manual_seed(seed)
    H, F_, tpp = config.hidden_size, config.intermediate_size, tp
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    shared = {"input_layernorm.weight": 1 + r(H), "input_layernorm.bias": r(H),
              "post_attention_layernorm.weight": 1 + r(H), "post_attention_layernorm.bias": r(H)}
    row_bias = {"attention.dense.bias": r(H), "mlp.dense_4h_to_h.bias": r(H)}
    parts = []
    for _ in range(tp):
        p = {k: v.clone() for k, v in shared.items()}
        p.update({
            "attention.query_key_value.weight": r(3 * H // tpp, H),
            "attention.query_key_value.bias": r(3 * H // tpp),
            "attention.dense.weight": r(H, H // tpp),
            "mlp.dense_h_to_4h.weight": r(F_ // tpp, H),
            "mlp.dense_h_to_4h.bias": r(F_ // tpp),
            "mlp.dense_4h_to_h.weight": r(H, F_ // tpp),
        })
        if config.use_parallel_residual:
            p.update({"attention.dense.bias": r(H), "mlp.dense_4h_to_h.bias": r(H)})
        else:
            p.update({k: v.clone() for k, v in row_bias.items()})
        parts.append(p)
    return parts


def neox_tp_block(parts: list[dict[str, torch.Tensor]], config: NeoXConfig,
                  x: torch.Tensor) -> torch.Tensor:
    """A transformer layer as NeoX computes it on len(parts) tensor-parallel ranks
    (ParallelTransformerLayer), written from its semantics: every rank sees the full input
    (B, T, H), runs its own heads -- its qkv output viewed as (heads on the rank, 3 * hs) --
    and its slice of the MLP, and produces partial (B, T, H) outputs that the all-reduce sums."""
    tp = len(parts)
    B, T, H = x.shape
    n_local, hs = config.num_attention_heads // tp, config.head_dim
    act = ACTIVATIONS[config.hidden_act]

    def norm(p, name, y):
        return F.layer_norm(y, (H,), parts[p][f"{name}.weight"], parts[p][f"{name}.bias"],
                            config.layer_norm_eps)

    def attention_partial(p, y):  # without the output bias
        qkv = F.linear(y, parts[p]["attention.query_key_value.weight"],
                       parts[p]["attention.query_key_value.bias"])
        q, k, v = qkv.view(B, T, n_local, 3 * hs).transpose(1, 2).chunk(3, dim=-1)
        cos, sin = rotary_cos_sin(config, torch.arange(T), y.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hs ** -0.5)
        ctx = ctx.transpose(1, 2).reshape(B, T, n_local * hs)
        return F.linear(ctx, parts[p]["attention.dense.weight"])

    def mlp_partial(p, y):  # without the output bias
        h = act(F.linear(y, parts[p]["mlp.dense_h_to_4h.weight"],
                         parts[p]["mlp.dense_h_to_4h.bias"]))
        return F.linear(h, parts[p]["mlp.dense_4h_to_h.weight"])

    if config.use_parallel_residual:
        # parallel_output=True: each rank adds its bias copies to its partial sums, then one
        # all-reduce of attn + mlp.
        per_rank = [attention_partial(p, norm(p, "input_layernorm", x))
                    + parts[p]["attention.dense.bias"]
                    + mlp_partial(p, norm(p, "post_attention_layernorm", x))
                    + parts[p]["mlp.dense_4h_to_h.bias"] for p in range(tp)]
        return x + sum(per_rank)
    # Sequential: each linear all-reduces, then every rank adds its (identical) bias to the
    # same full output; rank 0's result is everyone's.
    attn = sum(attention_partial(p, norm(p, "input_layernorm", x)) for p in range(tp))
    h = x + attn + parts[0]["attention.dense.bias"]
    mlp = sum(mlp_partial(p, norm(p, "post_attention_layernorm", h)) for p in range(tp))
    return h + mlp + parts[0]["mlp.dense_4h_to_h.bias"]


# The merged layer computes full-length dot products where NeoX adds TP partial sums, and the
# parallel-residual bias is added once instead of per rank: fp32 reassociation only. Over 20
# seeds the largest difference was 4e-6, on outputs up to ~11 (about 4e-7 relative); 2e-5
# absolute + 1e-5 relative is 5x that, and far below what a wrong merge gives (swapping the
# ranks' qkv rows: 4.3; the other row-parallel bias rule: > 1e-2).
SEMANTIC_ATOL, SEMANTIC_RTOL = 2e-5, 1e-5


def write_block_files(directory: Path, config: NeoXConfig,
                      parts: list[dict[str, torch.Tensor]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for r, state in enumerate(parts):
        torch.save(state, directory / slim_file_name(2, r))


@pytest.mark.parametrize("residual", ["parallel", "sequential"])
def test_merged_block_computes_what_neox_computes_on_two_ranks(residual, tmp_path):
    config = small_config(use_parallel_residual=residual == "parallel")
    parts = random_partitions(config, TP, seed=3)
    write_block_files(tmp_path, config, parts)
    # Other layers' files are not needed to read block 0.
    reader = SlimReader(tmp_path, config=config)
    block = build_layer("block", config, device="meta")
    block.load_state_dict(reader.read("block", 0), assign=True)
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = neox_tp_block(parts, config, x)
        got = block(x)
    torch.testing.assert_close(got, expected, atol=SEMANTIC_ATOL, rtol=SEMANTIC_RTOL)

    # The other choice of bias merge is measurably wrong, so the test decides it.
    other = "mean" if residual == "parallel" else "sum"
    wrong = build_layer("block", config, device="meta")
    with warnings.catch_warnings():
        # "mean" of the parallel residual's differing bias copies warns; expected here.
        warnings.simplefilter("ignore", PartitionsDifferWarning)
        wrong.load_state_dict(SlimReader(tmp_path, config=config,
                                         row_parallel_bias=other).read("block", 0),
                              assign=True)
    with torch.no_grad():
        assert (wrong(x) - expected).abs().max() > 1e-2


def test_embedding_and_readout_follow_the_vocabulary_split(tmp_path):
    config = small_config()
    g = torch.Generator().manual_seed(5)
    V, H = config.vocab_size, config.hidden_size
    emb = [torch.randn(V // TP, H, generator=g) for _ in range(TP)]
    out = [torch.randn(V // TP, H, generator=g) for _ in range(TP)]
    n = config.num_hidden_layers
    for r in range(TP):
        torch.save({"word_embeddings.weight": emb[r]}, tmp_path / slim_file_name(0, r))
        torch.save({"final_linear.weight": out[r]}, tmp_path / slim_file_name(n + 4, r))
    reader = SlimReader(tmp_path, config=config)
    ids = torch.randint(0, V, (3, 7), generator=g)
    # VocabParallelEmbedding: rank r looks up the ids in its range, the rest give 0; summed.
    expected = sum(F.embedding((ids - r * (V // TP)).clamp(0, V // TP - 1), emb[r])
                   * ((ids >= r * (V // TP)) & (ids < (r + 1) * (V // TP)))[..., None]
                   for r in range(TP))
    embed = build_layer("embed", config, device="meta")
    embed.load_state_dict(reader.read("embed"), assign=True)
    assert torch.equal(embed(ids), expected)
    # Column-parallel output layer: each rank's logits for its vocabulary slice, gathered in
    # rank order along the last dimension.
    x = torch.randn(3, 7, H, generator=g)
    expected = torch.cat([x @ w.T for w in out], dim=-1)
    readout = build_layer("readout", config, device="meta")
    readout.load_state_dict(reader.read("readout"), assign=True)
    with torch.no_grad():
        torch.testing.assert_close(readout(x), expected, atol=SEMANTIC_ATOL, rtol=SEMANTIC_RTOL)


def test_pre_zip_pickles_are_read_whole(tmp_path):
    # torch.save's format before 1.6 cannot be memory-mapped; the reader falls back.
    config = small_config()
    for r in range(TP):
        torch.save({"word_embeddings.weight": torch.full((51, 32), float(r))},
                   tmp_path / slim_file_name(0, r), _use_new_zipfile_serialization=False)
    weight = SlimReader(tmp_path, config=config).read("embed")["embed_in.weight"]
    assert torch.equal(weight, torch.cat([torch.zeros(51, 32), torch.ones(51, 32)]))


def test_row_parallel_bias_choice(tmp_path):
    parallel = small_config()
    parts = random_partitions(parallel, TP, seed=6)
    write_block_files(tmp_path, parallel, parts)
    p0, p1 = (p["attention.dense.bias"] for p in parts)
    assert not torch.equal(p0, p1)
    merged = SlimReader(tmp_path, config=parallel).read("block", 0)
    assert torch.equal(merged["attention.dense.bias"], p0 + p1)
    mean = SlimReader(tmp_path, config=parallel, row_parallel_bias="mean")
    assert mean.row_parallel_bias == "mean" and "merged by mean" in mean.description
    # "mean" expects identical copies; these are a parallel residual's, so it warns.
    with pytest.warns(PartitionsDifferWarning, match="of block 0 is merged by 'mean'"):
        assert torch.equal(mean.read("block", 0)["attention.dense.bias"], (p0 + p1) / 2)
    # Layer norms are averaged whatever the residual.
    ln = [p["input_layernorm.weight"] for p in parts]
    assert torch.equal(merged["input_layernorm.weight"], (ln[0] + ln[1]) / 2)

    sequential = SlimReader(tmp_path, config=dataclasses.replace(
        parallel, use_parallel_residual=False))
    assert sequential.row_parallel_bias == "mean"
    with pytest.raises(ValueError, match="row_parallel_bias"):
        SlimReader(tmp_path, config=parallel, row_parallel_bias="first")


def test_fp16_partitions_keep_their_dtype(tmp_path):
    config = small_config()
    model = random_model(config, seed=7).half()
    hf_dir = save_hf(tmp_path / "hf", config, iter_layer_states(model))
    slim_dir = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    slim_model = neox.from_pretrained(slim_dir)
    hf_model = neox.from_pretrained(hf_dir)
    for (name, a), (_, b) in zip(slim_model.state_dict().items(), hf_model.state_dict().items()):
        assert a.dtype == torch.float16, name
        assert torch.equal(a, b), name


# -- configuration and layout -------------------------------------------------------------------

def test_flat_parser_agrees_with_pyyaml():
    yaml = pytest.importorskip("yaml")
    text = neox_yaml(small_config())
    full = yaml.safe_load(text)
    scalars = {k: v for k, v in full.items() if not isinstance(v, (dict, list))}
    flat = parse_flat_yaml(text)
    # PyYAML follows YAML 1.1, where 1e-05 (no dot) is a string; the config reader converts it.
    assert flat == {k: float(v) if k == "layernorm-epsilon" else v for k, v in scalars.items()}
    assert (config_from_neox_yaml(flat, vocab_size=102)
            == config_from_neox_yaml(full, vocab_size=102) == small_config())
    block_style = "num-layers: 3   # blocks\nhidden-size: 32\noptimizer:\n  lr: 0.1\nname: 'a#b'\n"
    assert parse_flat_yaml(block_style) == {"num-layers": 3, "hidden-size": 32, "name": "a#b"}


def test_reads_the_yaml_without_pyyaml(dirs, monkeypatch):
    config, hf_dir, slim_dir = dirs
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` now raises ImportError
    with neox.open_weights(slim_dir) as reader:
        assert reader.config == config


def test_yaml_settings_map_to_the_config(tmp_path):
    base = {"num-layers": 2, "hidden-size": 16, "num-attention-heads": 2, "pos-emb": "rotary",
            "no-weight-tying": True}
    c = config_from_neox_yaml(base, vocab_size=10)
    # NeoX's defaults: rotary over the whole head, exact gelu, sequential residual, 4h MLP.
    assert (c.rotary_pct, c.hidden_act, c.use_parallel_residual, c.intermediate_size,
            c.tie_word_embeddings) == (1.0, "gelu", False, 64, False)
    c = config_from_neox_yaml({**base, "layernorm_epsilon": "1e-5", "openai-gelu": True,
                               "rotary-emb-base": 500}, vocab_size=10)
    assert (c.layer_norm_eps, c.hidden_act, c.rotary_emb_base) == (1e-5, "gelu_new", 500.0)
    for bad, match in [({"pos-emb": "learned"}, "pos-emb"), ({"norm": "rmsnorm"}, "norm"),
                       ({"gpt-j-tied": True}, "gpt-j-tied"), ({"activation": "geglu"}, "geglu"),
                       ({"attention-config": [[["local"], 2]]}, "local")]:
        with pytest.raises(WeightsError, match=match):
            config_from_neox_yaml({**base, **bad}, vocab_size=10, where="x.yml")
    with pytest.raises(WeightsError, match="'num-layers' is missing"):
        config_from_neox_yaml({k: v for k, v in base.items() if k != "num-layers"}, vocab_size=10)
    a, b = tmp_path / "a.yml", tmp_path / "b.yml"
    a.write_text('{"num-layers": 2}\n')
    b.write_text("num_layers: 3\n")
    with pytest.raises(WeightsError, match="must not disagree"):
        read_neox_yaml([a, b])


def test_without_yaml_the_20b_preset_is_used(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim")  # no YAML anywhere
    with neox.open_weights(work) as reader:
        assert reader.config == PRESETS["gpt-neox-20b"]
        assert "gpt-neox-20b preset" in reader.description
    # The small files are not a 20B: the first layer read says so, naming the file.
    with pytest.raises(WeightsError, match=r"layer_00-model_00-model_states\.pt .*"
                                              r"'word_embeddings\.weight': shape \(102, 32\)"):
        neox.from_pretrained(work)
    # A config passed in replaces the preset.
    with neox.open_weights(work, config=config) as reader:
        assert reader.config == config and "configuration passed in" in reader.description
    assert torch.equal(logits(neox.from_pretrained(work, config=config), IDS),
                       logits(neox.from_pretrained(hf_dir), IDS))


def test_release_directory_layout(dirs, tmp_path):
    """The 20B download: top/latest, top/configs/20B.yml, top/global_step150000/layer_*."""
    config, hf_dir, slim_dir = dirs
    top = tmp_path / "20B_checkpoints"
    step = write_slim(hf_dir, top / "global_step150000")
    (top / "configs").mkdir()
    (top / "configs" / "20B.yml").write_text(neox_yaml(config))
    (top / "latest").write_text("global_step150000")
    with neox.open_weights(step) as reader:  # finds ../configs/20B.yml
        assert reader.config == config
        assert str(top / "configs" / "20B.yml") in reader.description
    with open_slim(top) as reader:  # follows `latest`
        assert reader.path == step and reader.config == config
    (top / "latest").unlink()
    assert find_slim_directory(top) == step  # the only global_step* folder
    write_slim(hf_dir, top / "global_step100")
    with pytest.raises(WeightsError, match="several checkpoints"):
        open_slim(top)


def test_tied_output_reads_the_embedding(tmp_path):
    config = small_config(tie_word_embeddings=True)
    model = random_model(config, seed=8)
    with torch.no_grad():
        model[-1].embed_out.weight.copy_(model[0].embed_in.weight)
    hf_dir = save_hf(tmp_path / "hf", config, iter_layer_states(model))
    # NeoX ties by default (no "no-weight-tying"); then there is no output-layer file.
    slim_dir = write_slim(hf_dir, tmp_path / "slim", tied=True,
                          yaml_text=neox_yaml(config, tied=True))
    assert not (slim_dir / slim_file_name(config.num_hidden_layers + 4, 0)).exists()
    slim_model = neox.from_pretrained(slim_dir)
    assert slim_model.config.tie_word_embeddings
    assert torch.equal(slim_model[-1].embed_out.weight, model[0].embed_in.weight)
    assert torch.equal(logits(slim_model, IDS), logits(model, IDS))


def test_pipeline_stage_files(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    n = config.num_hidden_layers
    # The parameter-free stages (1 and L+2) may have (empty) files: tolerated, never read.
    for layer in (1, n + 2):
        for r in range(TP):
            (work / slim_file_name(layer, r)).write_bytes(b"")
    neox.from_pretrained(work)
    # A layer file the configuration has no place for means they do not match.
    torch.save({}, work / slim_file_name(n + 5, 0))
    with pytest.raises(WeightsError, match=rf"layer_{n + 5:02d}-model_00-model_states\.pt: "
                                              rf"pipeline layer {n + 5} does not exist"):
        neox.open_weights(work)
    (work / slim_file_name(n + 5, 0)).unlink()
    # A rank beyond the YAML's model-parallel-size.
    torch.save({}, work / slim_file_name(0, 2))
    with pytest.raises(WeightsError, match=r"layer_00-model_02-model_states\.pt: a "
                                              r"tensor-parallel rank beyond"):
        neox.open_weights(work)


# -- NeoX's newer MLP names and widths ------------------------------------------------------------

def test_new_mlp_names_load_to_the_same_model(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    new = write_slim(hf_dir, tmp_path / "new", yaml_text=neox_yaml(config), new_names=True)
    assert "mlp.linear1.weight" in torch.load(new / slim_file_name(2, 0), weights_only=True)
    with neox.open_weights(new) as reader:
        assert reader.config == config
    # The same partitions under other names: the same merge, so bitwise the same logits.
    assert torch.equal(logits(neox.from_pretrained(new), IDS),
                       logits(neox.from_pretrained(slim_dir), IDS))


def test_both_mlp_names_in_one_file_are_refused(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    for r in range(TP):
        file = work / slim_file_name(3, r)
        state = torch.load(file, weights_only=True)
        state["mlp.linear2.bias"] = state["mlp.dense_4h_to_h.bias"].clone()
        torch.save(state, file)
    with pytest.raises(WeightsError, match=r"layer_03-model_00-model_states\.pt: tensors "
                                           r"'mlp\.dense_4h_to_h\.bias' and 'mlp\.linear2\.bias' "
                                           r"are both block 1"):
        neox.from_pretrained(work)


def test_padded_mlp_width_is_read_from_the_weights(tmp_path):
    """NeoX from 2024-09-07 to 2024-09-10 rounded linear1 up to a multiple of 512: 4 x 32 = 128
    became 512, with nothing in the YAML saying so."""
    padded = small_config(intermediate_size=512)
    model = random_model(padded, seed=11)
    hf_dir = save_hf(tmp_path / "hf", padded, iter_layer_states(model))
    implied = dataclasses.replace(padded, intermediate_size=4 * padded.hidden_size)
    slim_dir = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(implied),
                          new_names=True)
    with neox.open_weights(slim_dir) as reader:
        assert reader.config == padded
        assert re.search(r"MLP width 512 from layer_02-model_00-model_states\.pt, where the "
                         r"YAML alone gives 128", reader.description)
    # Exact merge (concatenation, halves that sum back) of the reference model's own tensors.
    assert torch.equal(logits(neox.from_pretrained(slim_dir), IDS), logits(model, IDS))

    # A width the YAML states is checked: 100 rounds up to 512 in those versions (accepted) ...
    (slim_dir / "20B.yml").write_text(neox_yaml(implied, extra='  "intermediate-size": 100,\n'))
    with neox.open_weights(slim_dir) as reader:
        assert reader.config.intermediate_size == 512
    # ... 600 cannot become 512 in any NeoX version: the YAML is not these weights'.
    (slim_dir / "20B.yml").write_text(neox_yaml(implied, extra='  "intermediate-size": 600,\n'))
    with pytest.raises(WeightsError, match=r"layer_02-model_00-model_states\.pt: the MLP is "
                                           r"512 wide, but .*20B\.yml gives intermediate-size "
                                           r"600, from which NeoX builds 600 or 1024"):
        neox.open_weights(slim_dir)


def test_mlp_width_rules_of_the_yaml():
    base = {"num-layers": 2, "hidden-size": 16, "num-attention-heads": 2, "pos-emb": "rotary"}
    width = lambda extra, **kw: config_from_neox_yaml(  # noqa: E731
        {**base, **extra}, vocab_size=10, where="x.yml", **kw).intermediate_size
    assert width({}) == 64                                   # 4h
    assert width({"intermediate-size": 100}) == 100          # multiple of 2 x 1
    assert width({"expansion-factor": 2.5}) == 40
    assert width({"intermediate-size": 100, "mlp-multiple-of": 64}) == 128  # multiple of 128
    # From the weights: anything when the YAML states no width, a NeoX rounding when it does.
    assert width({}, mlp_width=96) == 96
    assert width({"intermediate-size": 100}, mlp_width=512) == 512
    with pytest.raises(WeightsError, match=r"w\.pt: the MLP is 128 wide, but x\.yml gives "
                                           r"intermediate-size 100, from which NeoX builds "
                                           r"100 or 512"):
        width({"intermediate-size": 100}, mlp_width=128, mlp_width_where="w.pt")
    with pytest.raises(WeightsError, match="both intermediate-size and expansion-factor"):
        width({"intermediate-size": 100, "expansion-factor": 2})
    with pytest.raises(WeightsError, match="mlp-multiple-of must be a positive integer"):
        width({"mlp-multiple-of": 0})


def gated_partitions(config: NeoXConfig, seed: int) -> list[dict[str, torch.Tensor]]:
    """A block as NeoX's swiglu/geglu stores it: linear1 twice as wide as linear2's input."""
    parts = random_partitions(config, TP, seed)
    for p in parts:
        w, b = p.pop("mlp.dense_h_to_4h.weight"), p.pop("mlp.dense_h_to_4h.bias")
        p["mlp.linear1.weight"], p["mlp.linear1.bias"] = torch.cat([w, w]), torch.cat([b, b])
        p["mlp.linear2.weight"] = p.pop("mlp.dense_4h_to_h.weight")
        p["mlp.linear2.bias"] = p.pop("mlp.dense_4h_to_h.bias")
    return parts


def test_gated_mlp_is_refused(tmp_path):
    config = small_config(num_hidden_layers=1)
    write_block_files(tmp_path, config, gated_partitions(config, seed=12))
    gated = (r"layer_02-model_00-model_states\.pt: 'mlp\.linear1\.weight' has 128 output rows, "
             r"twice the 64 input columns of 'mlp\.linear2\.weight': a gated MLP")
    with pytest.raises(WeightsError, match=gated):
        SlimReader(tmp_path, config=config).read("block", 0)
    # With a YAML that does not say so (NeoX's default activation), found on opening.
    for r in range(TP):
        torch.save({"word_embeddings.weight": torch.zeros(51, 32)},
                   tmp_path / slim_file_name(0, r))
    (tmp_path / "20B.yml").write_text(neox_yaml(config))
    with pytest.raises(WeightsError, match=gated):
        SlimReader(tmp_path)
    # A YAML that says so is refused before any block is read.
    (tmp_path / "20B.yml").write_text(neox_yaml(config, extra='  "activation": "swiglu",\n'))
    with pytest.raises(WeightsError, match=r"20B\.yml: activation is 'swiglu', a gated MLP"):
        SlimReader(tmp_path)


# -- settings that change the computation ---------------------------------------------------------

@pytest.mark.parametrize("key, value, why", [
    ("use-mup", True, "muP divides attention scores by the head size"),
    ("num-kv-heads", 1, "grouped-query attention"),
    ("use_qk_layernorm", True, "layer norm on queries and keys"),
    ("sliding-window-width", 16, "sliding-window attention"),
    ("moe-num-experts", 8, "mixture-of-experts"),
    ("mlp-type", "llama", "gated LLaMA MLP"),
    ("soft-prompt-tuning", {"enabled": True, "n_tokens": 10}, "soft prompt"),
    ("train-impl", "rm", "reward model"),
])
def test_settings_that_change_the_math_are_refused(key, value, why):
    base = {"num-layers": 2, "hidden-size": 16, "num-attention-heads": 2, "pos-emb": "rotary"}
    shown = key.replace("_", "-")
    with pytest.raises(WeightsError, match=rf"x\.yml: '{shown}' is {re.escape(repr(value))}: "
                                           rf"[^;]*{why}[^;]*; not supported"):
        config_from_neox_yaml({**base, key: value}, vocab_size=10, where="x.yml")


def test_settings_that_do_not_change_the_math_are_accepted():
    base = {"num-layers": 2, "hidden-size": 16, "num-attention-heads": 2, "pos-emb": "rotary"}
    plain = config_from_neox_yaml(base, vocab_size=10)
    harmless = {"use-mup": False, "num-kv-heads": 2, "moe-num-experts": 1, "mlp-type": "regular",
                "sliding-window-width": None, "train-impl": "normal", "soft-prompt-tuning":
                {"n_tokens": 10}, "apply-query-key-layer-scaling": True,
                "attention-softmax-in-fp32": True, "mup-embedding-mult": 10.0,
                "scaled-upper-triang-masked-softmax-fusion": True, "hidden-dropout": 0.1,
                "init-method": "small_init", "precision": "fp16"}
    assert config_from_neox_yaml({**base, **harmless}, vocab_size=10) == plain


def test_refusal_names_the_yaml_file(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim",
                      yaml_text=neox_yaml(config, extra='  "use-mup": true,\n'))
    with pytest.raises(WeightsError, match=re.escape(f"{work / '20B.yml'}: 'use-mup' is True")):
        neox.open_weights(work)


# -- replicated copies ----------------------------------------------------------------------------

def test_replicated_copies_that_differ_warn(tmp_path):
    # Sequential residual: every copy of the layer norms and of the row-parallel biases
    # is identical in a healthy checkpoint.
    config = small_config(use_parallel_residual=False)
    parts = random_partitions(config, TP, seed=13)
    write_block_files(tmp_path, config, parts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # identical copies: no warning at all
        SlimReader(tmp_path, config=config).read("block", 0)

    changed = {k: v.clone() for k, v in parts[1].items()}
    changed["post_attention_layernorm.weight"][5] += 0.25
    changed["attention.dense.bias"][0] -= 0.5
    write_block_files(tmp_path, config, [parts[0], changed])
    with pytest.warns(PartitionsDifferWarning) as record:
        merged = SlimReader(tmp_path, config=config).read("block", 0)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    file0 = re.escape(str(tmp_path / slim_file_name(2, 0)))
    assert re.fullmatch(
        rf"{file0}: tensor 'post_attention_layernorm\.weight' of block 0 is replicated across "
        rf"tensor-parallel partitions but its copy differs in layer_02-model_01-model_states\.pt "
        rf"\(largest absolute difference 0\.25\); averaging the copies, as EleutherAI's merge "
        rf"does", messages[0]), messages[0]
    assert re.search(r"'attention\.dense\.bias' of block 0 is merged by 'mean'.*largest "
                     r"absolute difference 0\.5\)", messages[1]), messages[1]
    # Averaged all the same.
    expected = (parts[0]["post_attention_layernorm.weight"]
                + changed["post_attention_layernorm.weight"]) / 2
    assert torch.equal(merged["post_attention_layernorm.weight"], expected)


# -- the weights directory is self-contained ------------------------------------------------------

def test_latest_leading_outside_is_refused(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    elsewhere = write_slim(hf_dir, tmp_path / "elsewhere" / "global_step7",
                           yaml_text=neox_yaml(config))
    top = tmp_path / "top"
    top.mkdir()
    (top / "latest").write_text("../elsewhere/global_step7\n")
    refused = (rf"{re.escape(str(top))}: its 'latest' file names '\.\./elsewhere/global_step7', "
               rf"which leads outside the weights directory .*allow_outside=True")
    for opener in (neox.open_weights, open_slim, find_slim_directory):
        with pytest.raises(WeightsError, match=refused):
            opener(top)
    assert find_slim_directory(top, allow_outside=True).resolve() == elsewhere
    with open_slim(top, allow_outside=True) as reader:
        assert reader.path.resolve() == elsewhere
    assert torch.equal(logits(neox.from_pretrained(top, allow_outside=True), IDS),
                       logits(neox.from_pretrained(slim_dir), IDS))


def test_layer_file_linked_outside_is_refused(dirs, tmp_path):
    config, hf_dir, slim_dir = dirs
    work = write_slim(hf_dir, tmp_path / "slim", yaml_text=neox_yaml(config))
    outside = tmp_path / "outside"
    outside.mkdir()
    name = slim_file_name(3, 1)
    os.replace(work / name, outside / name)
    (work / name).symlink_to(outside / name)
    with pytest.raises(WeightsError, match=rf"the layer file '{re.escape(name)}', which leads "
                                           rf"outside the weights directory"):
        neox.open_weights(work)
    assert torch.equal(logits(neox.from_pretrained(work, allow_outside=True), IDS),
                       logits(neox.from_pretrained(slim_dir), IDS))
    # A link that stays inside is fine.
    os.replace(outside / name, work / "real.pt")
    (work / name).unlink()
    (work / name).symlink_to("real.pt")
    neox.from_pretrained(work)
