"""EleutherAI GPT-NeoX "slim weights" written by the tests: a small NeoX configuration, its
NeoX-style YAML, a random model, and a Hugging Face directory split into tensor-parallel slim
partitions (the inverse of neox.weights.slim's merge, written here independently of the module's
rule table). Used by tests/neox/test_neox_weights_slim.py and test_neox_rank_local.py."""

from __future__ import annotations

from pathlib import Path

import torch

import neox
from neox.config import NeoXConfig
from neox.model import NeoXModel, build_layers
from neox.weights.slim import slim_file_name

TP = 2


def small_config(**overrides) -> NeoXConfig:
    # intermediate = 4 * hidden, as NeoX builds it when the YAML gives no intermediate-size;
    # vocab and heads divisible by TP, as Megatron requires.
    kw = dict(vocab_size=102, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              intermediate_size=128, hidden_act="gelu_fast", rotary_pct=0.25,
              max_position_embeddings=64, use_parallel_residual=True)
    kw.update(overrides)
    return NeoXConfig(**kw)


def neox_yaml(config: NeoXConfig, *, tp: int = TP, tied: bool = False, extra: str = "") -> str:
    """A config file in the style of NeoX's 20B.yml (JSON-like, comments, nested sections,
    Python-style True, trailing commas) describing ``config``; ``extra``: more settings
    (lines of ``"key": value,``)."""
    residual = "true" if config.use_parallel_residual else "false"
    fusion = "true" if config.hidden_act == "gelu_fast" else "false"
    tying = "" if tied else '  "no-weight-tying": true,\n'
    return (
        "# a small model in the layout of the GPT-NeoX-20B release\n"
        "{\n"
        "  # parallelism\n"
        '  "pipe-parallel-size": 2,\n'
        f'  "model-parallel-size": {tp},\n'
        "\n"
        "  # model\n"
        f'  "num-layers": {config.num_hidden_layers},\n'
        f'  "hidden-size": {config.hidden_size},\n'
        f'  "num-attention-heads": {config.num_attention_heads},\n'
        f'  "seq-length": {config.max_position_embeddings},\n'
        f'  "max-position-embeddings": {config.max_position_embeddings},\n'
        '  "norm": "layernorm",\n'
        '  "pos-emb": "rotary",\n'
        f'  "rotary_pct": {config.rotary_pct},\n'
        f"{tying}"
        f'  "gpt_j_residual": {residual},\n'
        '  "output_layer_parallelism": "column",\n'
        f'  "bias-gelu-fusion": {fusion},\n'
        f'  "layernorm-epsilon": {config.layer_norm_eps!r},\n'
        '  "optimizer": {\n'
        '    "type": "Adam",\n'
        '    "params": {"lr": 0.97e-4, "betas": [0.9, 0.95], "eps": 1.0e-8,},\n'
        "  },\n"
        '  "zero_optimization": {\n'
        '    "stage": 1,\n'
        '    "allgather_partitions": True,\n'
        "  },\n"
        '  "hidden-dropout": 0,  # no dropout\n'
        '  "tokenizer_type": "HFTokenizer",\n'
        f"{extra}"
        "}\n")


def random_model(config: NeoXConfig, seed: int = 0) -> NeoXModel:
    """Every parameter random (layer-norm gains around 1), so a mistake in any shows."""
    g = torch.Generator().manual_seed(seed)
    model = NeoXModel(config, build_layers(config, generator=g))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


# The inverse of the merge, stated on its own: local name -> (Megatron name, how it is cut).
_SPLIT_BLOCK = {
    "input_layernorm.weight": "copy", "input_layernorm.bias": "copy",
    "post_attention_layernorm.weight": "copy", "post_attention_layernorm.bias": "copy",
    "attention.query_key_value.weight": "rows", "attention.query_key_value.bias": "rows",
    "attention.dense.weight": "cols", "attention.dense.bias": "row_bias",
    "mlp.dense_h_to_4h.weight": "rows", "mlp.dense_h_to_4h.bias": "rows",
    "mlp.dense_4h_to_h.weight": "cols", "mlp.dense_4h_to_h.bias": "row_bias",
}
_SPLIT_OTHER = {
    "embed_in.weight": ("word_embeddings.weight", "rows"),
    "final_layer_norm.weight": ("norm.weight", "copy"),
    "final_layer_norm.bias": ("norm.bias", "copy"),
    "embed_out.weight": ("final_linear.weight", "rows"),
}


def split_tensor(t: torch.Tensor, how: str, tp: int,
                 parallel_residual: bool) -> list[torch.Tensor]:
    if how == "rows":
        parts = t.chunk(tp, dim=0)
    elif how == "cols":
        parts = t.chunk(tp, dim=1)
    elif how == "row_bias" and parallel_residual:
        # Each rank adds its copy to its partial output before the all-reduce: copies that
        # sum to the bias. Halving is exact in binary floating point, so the sum is too.
        parts = [t / tp] * tp
    else:  # replicated, or a sequential-residual bias: identical copies
        parts = [t] * tp
    # clone: torch.save of a view would write the whole underlying storage
    return [p.contiguous().clone() for p in parts]


# NeoX's MLP names since 2024-09 (gpt-neox commit 0d4bdb96), for the same tensors.
NEW_MLP_NAMES = {"mlp.dense_h_to_4h.weight": "mlp.linear1.weight",
                 "mlp.dense_h_to_4h.bias": "mlp.linear1.bias",
                 "mlp.dense_4h_to_h.weight": "mlp.linear2.weight",
                 "mlp.dense_4h_to_h.bias": "mlp.linear2.bias"}


def write_slim(hf_dir: Path, slim_dir: Path, *, tp: int = TP, yaml_text: str | None = None,
               tied: bool = False, dtype: torch.dtype | None = None,
               new_names: bool = False) -> Path:
    """Splits the Hugging Face directory ``hf_dir`` into slim-weights files in ``slim_dir``;
    ``new_names``: the MLP under NeoX's newer names (linear1/linear2)."""
    slim_dir.mkdir(parents=True, exist_ok=True)
    with neox.open_weights(hf_dir) as reader:
        config = reader.config
        n = config.num_hidden_layers
        order = ([("embed", None, 0)] + [("block", i, i + 2) for i in range(n)]
                 + [("final_norm", None, n + 3)] + ([] if tied else [("readout", None, n + 4)]))
        for kind, index, layer in order:
            full = reader.read(kind, index)
            ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
            for local, t in full.items():
                if dtype is not None:
                    t = t.to(dtype)
                if kind == "block":
                    key, how = local, _SPLIT_BLOCK[local]
                    if new_names:
                        key = NEW_MLP_NAMES.get(key, key)
                else:
                    key, how = _SPLIT_OTHER[local]
                for rank, part in zip(ranks, split_tensor(t, how, tp,
                                                          config.use_parallel_residual)):
                    rank[key] = part
            if kind == "block":  # the buffer NeoX saves; the reader must skip it
                inv_freq = 1.0 / 10000 ** (torch.arange(0, 2, 2).float() / 2)
                for rank in ranks:
                    rank["attention.rotary_emb.inv_freq"] = inv_freq
            for r, state in enumerate(ranks):
                torch.save(state, slim_dir / slim_file_name(layer, r))
    if yaml_text is not None:
        (slim_dir / "20B.yml").write_text(yaml_text)
    return slim_dir
