"""neox.model and neox.config against transformers' GPT-NeoX.

The reference is ``transformers.GPTNeoXForCausalLM`` with random weights (layer norms and biases
randomised too, so a mistake in any of them shows), saved with ``save_pretrained`` and loaded
back through ``neox.from_pretrained``. transformers is a test dependency only.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from torch import nn

import neox
from tests.support import neox_testing
from neox.config import SUPPORTED_ACTIVATIONS, NeoXConfig
from neox.weights.hf import hf_key
from neox.config import normalize_filter_layers
from neox.model import ACTIVATIONS

transformers = pytest.importorskip("transformers")

# fp32, and our layers run the same ops as transformers in the same order; only attention may
# differ (our SDPA call vs its eager matmul-softmax-matmul or its own SDPA call with a mask),
# which changes the accumulation order: observed differences are <= 2e-6 on logits of magnitude
# ~5 after 3 layers. 2e-5 absolute + 1e-5 relative is ~10x that and still far below any real
# mistake (a wrong rotary or bias changes logits by > 1e-2).
ATOL, RTOL = 2e-5, 1e-5

VOCAB = 101


def random_hf_model(seed: int = 0, **overrides):
    """The test's small random configuration; see neox_testing.random_hf_model."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=80, max_position_embeddings=64)
    kwargs.update(overrides)
    return neox_testing.random_hf_model(transformers, seed, **kwargs)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


CONFIGS = {
    "parallel-gelu": dict(),
    "sequential-fullrotary-gelu_new": dict(use_parallel_residual=False, rotary_pct=1.0,
                                           hidden_act="gelu_new", num_attention_heads=3),
    "gelu_fast-base-eps": dict(hidden_act="gelu_fast", rotary_pct=0.5, rotary_emb_base=500,
                               layer_norm_eps=1e-3),
    # head size 9: odd, and int(9 * 0.25) = 2 rotary dims
    "oddhead-sequential-relu": dict(hidden_size=45, num_attention_heads=5, hidden_act="relu",
                                    use_parallel_residual=False),
    # head size 10 with rotary_pct 0.3: 3 rotary dims, which transformers rounds up to 4
    "odd-rotary-dims": dict(hidden_size=40, num_attention_heads=4, rotary_pct=0.3),
    "no-attention-bias-tanh-gelu": dict(attention_bias=False, hidden_act="gelu_pytorch_tanh",
                                        rotary_emb_base=12345.5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved_model(request, tmp_path_factory):
    """(HF model, directory it was saved to with save_pretrained)."""
    model = random_hf_model(**CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_transformers(saved_model, attn):
    hf, path = saved_model
    ref = transformers.GPTNeoXForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    ours = neox.from_pretrained(path)
    assert ours.config.num_hidden_layers == hf.config.num_hidden_layers
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(ref, ids)
    got = our_logits(ours, ids)
    assert got.shape == (2, 23, VOCAB)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_filter_layers_match_transformers_with_deleted_layers(tmp_path):
    hf = random_hf_model(num_hidden_layers=5)
    hf.save_pretrained(tmp_path)
    keep = [3, 1]  # order and duplicates do not matter: blocks keep checkpoint order
    ours = neox.from_pretrained(tmp_path, filter_layers=keep + [1])
    assert ours.source_layers == (1, 3)
    assert ours.config.num_hidden_layers == 2
    assert len(ours) == 2 + 3
    # The same subset in transformers: drop the other blocks and fix the count.
    hf.gpt_neox.layers = nn.ModuleList([hf.gpt_neox.layers[i] for i in sorted(keep)])
    hf.config.num_hidden_layers = 2
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(our_logits(ours, ids), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("bad, message", [
    ([], "empty"),
    (set(), "empty"),
    ([5], r"out of range.*0\.\.4"),
    ([-1, 2], r"\[-1\] out of range.*0\.\.4"),
    ([0.5], "integers"),
    (["1"], "integers"),
    ("01", "collection"),
])
def test_filter_layers_errors(bad, message):
    config = dataclasses.replace(neox.PRESETS["tiny"], num_hidden_layers=5)
    with pytest.raises(ValueError, match=message):
        normalize_filter_layers(config, bad)
    with pytest.raises(ValueError, match=message):
        neox.build_layers(config, filter_layers=bad, device="meta")


def test_layer_specs_renumber_kept_blocks():
    config = dataclasses.replace(neox.PRESETS["tiny"], num_hidden_layers=6)
    specs = neox.layer_specs(config, {4, 0, 2})
    assert [s.kind for s in specs] == ["embed", "block", "block", "block", "final_norm",
                                       "readout"]
    assert [(s.source, s.index) for s in specs if s.kind == "block"] == [(0, 0), (2, 1), (4, 2)]
    assert len(neox.layer_specs(config)) == 6 + 3


@pytest.mark.parametrize("name", sorted(SUPPORTED_ACTIVATIONS))
def test_activations_match_transformers(name):
    from transformers.activations import ACT2FN
    x = torch.linspace(-12, 12, 2001, dtype=torch.float32)
    # Same formulas and op order as transformers, so the results are bitwise equal.
    torch.testing.assert_close(ACTIVATIONS[name](x), ACT2FN[name](x), atol=0, rtol=0)


def test_parameter_names_are_hf_names_and_meta_build_allocates_nothing():
    hf = random_hf_model(num_hidden_layers=2)
    hf_names = {("embed_out.weight" if k == "lm_head.weight" else k): v.shape
                for k, v in hf.state_dict().items()}
    config = NeoXConfig.from_hf_dict(hf.config.to_dict())
    layers = neox.build_layers(config, device="meta")
    ours = {}
    for kind, index, state in neox.iter_layer_states(layers):
        for name, t in state.items():
            assert t.is_meta
            ours[hf_key(kind, index, name)] = t.shape
    assert ours == hf_names


def test_build_layers_random_init_trains():
    config = dataclasses.replace(neox.PRESETS["tiny"], vocab_size=300, num_hidden_layers=2)
    model = neox.NeoXModel(config, neox.build_layers(
        config, generator=torch.Generator().manual_seed(0)))
    ids = torch.randint(0, 300, (2, 9))
    logits = model(ids)
    assert logits.shape == (2, 9, 300)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # Every block bias the bias fine-tuning mode trains receives a gradient.
    assert model[1].attention.query_key_value.bias.grad.abs().sum() > 0
    assert model[1].mlp.dense_h_to_4h.bias.grad.abs().sum() > 0


def test_neox_model_checks_its_layers():
    config = dataclasses.replace(neox.PRESETS["tiny"], vocab_size=50, num_hidden_layers=2)
    layers = neox.build_layers(config, device="meta")
    with pytest.raises(ValueError, match="config has 1 blocks but 2"):
        neox.NeoXModel(dataclasses.replace(config, num_hidden_layers=1), layers)
    with pytest.raises(ValueError, match="embed, blocks"):
        neox.NeoXModel(config, layers[1:])


# -- configuration ----------------------------------------------------------------------------

def test_config_reads_every_transformers_generation():
    legacy = {  # a Pythia config.json as transformers 4.x wrote it
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "bos_token_id": 0,
        "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": 512, "intermediate_size": 2048,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "num_attention_heads": 8,
        "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25,
        "rope_scaling": None, "tie_word_embeddings": False, "use_parallel_residual": True,
        "vocab_size": 50304, "attention_probs_dropout_prob": 0.1,
    }
    assert NeoXConfig.from_hf_dict(legacy) == neox.PRESETS["pythia-70m"]
    late4 = {**legacy, "rope_theta": 500, "partial_rotary_factor": 0.5}
    late4.pop("rotary_pct"), late4.pop("rotary_emb_base")
    c = NeoXConfig.from_hf_dict(late4)
    assert (c.rotary_pct, c.rotary_emb_base) == (0.5, 500)
    # What transformers 5 writes: rope_parameters.
    hf5 = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=96, vocab_size=77, rotary_pct=0.5,
                                     rotary_emb_base=321, hidden_act="gelu_fast").to_dict()
    assert "rope_parameters" in hf5
    c = NeoXConfig.from_hf_dict(hf5)
    assert (c.rotary_pct, c.rotary_emb_base, c.hidden_act) == (0.5, 321, "gelu_fast")


@pytest.mark.parametrize("name", sorted(neox.PRESETS))
def test_config_round_trips_through_transformers(name, tmp_path):
    config = neox.PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.rope_parameters["partial_rotary_factor"] == config.rotary_pct
    assert hf.rope_parameters["rope_theta"] == config.rotary_emb_base
    assert NeoXConfig.from_hf_dict(hf.to_dict()) == config


def test_presets_have_the_published_parameter_counts():
    # Totals published for the Pythia suite and GPT-NeoX-20B (embedding and readout included).
    published = {"pythia-70m": 70_426_624, "pythia-160m": 162_322_944,
                 "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632,
                 "gpt-neox-20b": 20_554_567_680}
    for name, count in published.items():
        assert neox.PRESETS[name].num_parameters() == count, name
    config = neox.PRESETS["tiny"]
    counted = sum(p.numel() for m in neox.build_layers(config, device="meta")
                  for p in m.parameters())
    assert counted == config.num_parameters()


def test_tiny_preset_vocab_is_replaceable():
    tiny = dataclasses.replace(neox.PRESETS["tiny"], vocab_size=50277)
    assert tiny.vocab_size == 50277 and tiny.hidden_size == neox.PRESETS["tiny"].hidden_size
    with pytest.raises(ValueError, match="vocab_size"):
        dataclasses.replace(neox.PRESETS["tiny"], vocab_size=0)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=50), "divisible"),
    (dict(hidden_act="gelu_magic"), "hidden_act 'gelu_magic' is not supported"),
    (dict(rotary_pct=1.5), r"rotary_pct must be in \[0, 1\]"),
    (dict(rotary_emb_base=0), "rotary_emb_base"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    (dict(num_hidden_layers=-1), "num_hidden_layers must be a positive integer"),
    (dict(intermediate_size=2.5), "intermediate_size"),
    (dict(use_parallel_residual="yes"), "use_parallel_residual must be a bool"),
    # head size 9 with every dim rotary: 9 rounds up to 10 > 9, which transformers cannot run
    (dict(hidden_size=36, num_attention_heads=4, rotary_pct=1.0), "exceeds the head size"),
])
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(neox.PRESETS["tiny"], **change)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama"), "model_type"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type 'linear'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
    (dict(head_dim=32), "head_dim"),
])
def test_config_from_hf_dict_errors(change, message):
    d = {**neox.PRESETS["pythia-70m"].to_hf_dict(), **change}
    with pytest.raises(ValueError, match=message):
        NeoXConfig.from_hf_dict(d)
    d = neox.PRESETS["pythia-70m"].to_hf_dict()
    del d["hidden_size"]
    with pytest.raises(ValueError, match="missing.*hidden_size"):
        NeoXConfig.from_hf_dict(d)


# What a neox rank does before its first step (a layer built at random, zerocore's AdamW built,
# stepped, zeroed and read), in a fresh interpreter.
RANK_START = """
import sys, torch, zerocore
from neox.config import preset_config
from neox.weights.random_init import RandomInit
state = RandomInit(preset_config("tiny"), seed=1).read("block", 0)
params = [torch.nn.Parameter(t) for t in state.values()]
opt = zerocore.optim.AdamW(params, lr=1e-3)
for p in params:
    p.grad = torch.ones_like(p)
opt.step()
opt.zero_grad()
opt.state_dict()
print(" ".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_a_rank_imports_neither_dynamo_nor_sympy_before_its_first_step():
    """torch.optim.Optimizer's add_param_group, zero_grad and state_dict import torch._dynamo on
    their first call, and Module.to_empty imports sympy: about 1.3 s of CPU in every rank
    (zerocore/optim.py's ``_torch_optimizer``, neox/model.py's ``allocated``). Neither is used
    unless something is compiled."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", RANK_START], env=neox_testing.cli_env(),
                          cwd=neox_testing.REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"imported: {proc.stdout.strip()}"
