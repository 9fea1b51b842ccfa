"""``NeoXConfig``: the hyper-parameters of a GPT-NeoX model, named as in Hugging Face's
``config.json`` so a checkpoint's configuration reads in without a translation table.

Only what changes the computation is kept. Dropout, initialisation range and cache flags are
not: every GPT-NeoX checkpoint is fine-tuned here without dropout, and initialisation is an
argument of the function that initialises (``neox.model.init_weights``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from neox.setting import UsageError

__all__ = ["NeoXConfig", "PRESETS", "SUPPORTED_ACTIVATIONS", "normalize_filter_layers",
           "filtered_config", "preset_config", "VOCAB_MULTIPLE"]

# The activations neox.model implements, under transformers' ACT2FN names. Kept here (not
# imported from model.py) so the config can be validated without building a model; model.py
# checks at import that its table has exactly these names.
SUPPORTED_ACTIVATIONS = frozenset({
    "gelu", "gelu_python", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python_tanh",
    "gelu_accurate", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "leaky_relu", "silu",
    "swish", "mish", "sigmoid", "tanh", "hardswish", "linear",
})


@dataclasses.dataclass(frozen=True)
class NeoXConfig:
    """Hyper-parameters of a GPT-NeoX model. Validated on construction (``ValueError``).

    ``dataclasses.replace(config, vocab_size=n)`` derives a variant (for instance the ``tiny``
    preset with the vocabulary of the tokenizer in use); it is validated again.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    rotary_pct: float = 0.25          # fraction of each head's dimensions that get rotary
    rotary_emb_base: float = 10000.0  # rotary base ("rope_theta" in transformers 5)
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True
    attention_bias: bool = True       # bias of attention.query_key_value and attention.dense
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NeoXConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"NeoXConfig: hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"NeoXConfig.hidden_act {self.hidden_act!r} is not supported; "
                             f"choose one of {sorted(SUPPORTED_ACTIVATIONS)}")
        if not (isinstance(self.rotary_pct, (int, float)) and 0.0 <= self.rotary_pct <= 1.0):
            raise ValueError(f"NeoXConfig.rotary_pct must be in [0, 1], got {self.rotary_pct!r}")
        if not (isinstance(self.rotary_emb_base, (int, float)) and self.rotary_emb_base > 0
                and math.isfinite(self.rotary_emb_base)):
            raise ValueError(f"NeoXConfig.rotary_emb_base must be a positive number, got "
                             f"{self.rotary_emb_base!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ValueError(f"NeoXConfig.layer_norm_eps must be positive, got "
                             f"{self.layer_norm_eps!r}")
        for name in ("use_parallel_residual", "attention_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"NeoXConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"NeoXConfig.{name} must be an integer or None, got {value!r}")
        if self.rotary_dim > self.head_dim:
            # transformers rounds an odd rotary width up to even (see rotary_dim); with an odd
            # head size and rotary_pct 1.0 that exceeds the head, and its model fails too.
            raise ValueError(f"NeoXConfig: rotary_pct {self.rotary_pct} of head size "
                             f"{self.head_dim} gives {self.rotary_ndims} rotary dimensions, "
                             f"rounded up to {self.rotary_dim} which exceeds the head size; "
                             f"use an even head size or a smaller rotary_pct")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_ndims(self) -> int:
        """Rotary dimensions as configured: ``int(head_dim * rotary_pct)``."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def rotary_dim(self) -> int:
        """Dimensions actually rotated. The frequencies are ``arange(0, rotary_ndims, 2)``, each
        used twice, so an odd ``rotary_ndims`` is rounded up to even, as transformers does."""
        return 2 * ((self.rotary_ndims + 1) // 2)

    def num_parameters(self) -> int:
        """Parameter count of the whole model (embedding and readout counted separately)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn_bias = 4 * h if self.attention_bias else 0
        block = 4 * h + (3 * h * h + h * h + attn_bias) + (2 * h * f + f + h)
        return v * h + self.num_hidden_layers * block + 2 * h + h * v

    # -- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "NeoXConfig":
        """Reads a GPT-NeoX ``config.json`` (as a dict). Accepts the keys of every transformers
        generation: legacy ``rotary_pct``/``rotary_emb_base``; top-level ``partial_rotary_factor``
        /``rope_theta`` (late 4.x); ``rope_parameters`` (5.x, which wins when present). Keys this
        model does not use (dropout, ``use_cache``, ...) are ignored."""
        model_type = d.get("model_type", "gpt_neox")
        if model_type != "gpt_neox":
            raise ValueError(f"config model_type is {model_type!r}, expected 'gpt_neox'")
        _refuse_unsupported_hf_keys(d)
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"GPT-NeoX config is missing {missing}")
        head_dim = d.get("head_dim")
        if head_dim is not None and head_dim != d["hidden_size"] // d["num_attention_heads"]:
            raise ValueError(f"config head_dim {head_dim} differs from hidden_size / "
                             f"num_attention_heads; GPT-NeoX does not support that")

        pct = d.get("rotary_pct", 0.25)
        base = d.get("rotary_emb_base", 10000.0)
        pct = d.get("partial_rotary_factor", pct)
        base = d.get("rope_theta", base)
        for key in ("rope_parameters", "rope_scaling"):
            rope = d.get(key)
            if rope is None:
                continue
            if not isinstance(rope, Mapping):
                raise ValueError(f"config {key} must be a mapping, got {rope!r}")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"config {key} asks for rope_type {rope_type!r}; only the "
                                 f"default rotary embedding is supported")
            pct = rope.get("partial_rotary_factor", pct)
            base = rope.get("rope_theta", base)

        eos = d.get("eos_token_id", 0)
        if isinstance(eos, (list, tuple)):
            # Several end tokens: the first is the one generation appends.
            eos = eos[0] if eos else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            hidden_act=d.get("hidden_act", "gelu"),
            rotary_pct=float(pct),
            rotary_emb_base=float(base),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-5)),
            use_parallel_residual=d.get("use_parallel_residual", True),
            attention_bias=d.get("attention_bias", True),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_id=eos,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict for ``transformers.GPTNeoXForCausalLM``. Carries both the
        transformers-5 ``rope_parameters`` and the legacy rotary keys, so 4.x reads it too."""
        base = self.rotary_emb_base
        base = int(base) if float(base).is_integer() else base
        return {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "default", "rope_theta": base,
                                "partial_rotary_factor": self.rotary_pct},
            "rotary_pct": self.rotary_pct,
            "rotary_emb_base": base,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_norm_eps": self.layer_norm_eps,
            "use_parallel_residual": self.use_parallel_residual,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "use_cache": True,
        }


# Hugging Face config.json settings that change what a GPT-NeoX checkpoint computes and that
# neox.model does not implement (checked against transformers' GPTNeoXConfig and
# modeling_gpt_neox.py, which read only the keys NeoXConfig has plus ``head_dim`` and the rope
# settings, both checked in from_hf_dict):
# - quantization_config: the stored tensors are quantized (GPTQ, AWQ, bitsandbytes ...) and
#   transformers swaps in layers that dequantize them; read as plain weights they are garbage.
# - architectures other than the causal LM (or the bare model): a ...ForSequenceClassification,
#   ...ForTokenClassification or ...ForQuestionAnswering checkpoint ends in a task head, not in
#   next-token logits.
# Ignored on purpose: dropout, initializer_range, use_cache, dtype, attention implementation,
# output flags, labels; and keys transformers' GPT-NeoX does not read (num_key_value_heads,
# sliding_window, ...): transformers computes without them too, and weights shaped for them
# fail the shape check with the tensor named.
_HF_ARCHITECTURES = frozenset({"GPTNeoXForCausalLM", "GPTNeoXModel"})


def _refuse_unsupported_hf_keys(d: Mapping[str, Any]) -> None:
    if d.get("quantization_config") is not None:
        method = d["quantization_config"]
        if isinstance(method, Mapping):
            method = method.get("quant_method", "unnamed method")
        raise ValueError(f"config quantization_config is set ({method}): quantized weights "
                         f"are not supported; use the unquantized checkpoint")
    architectures = d.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    heads = sorted(set(architectures) - _HF_ARCHITECTURES)
    if heads:
        raise ValueError(f"config architectures is {list(architectures)}: {heads[0]} ends in a "
                         f"task head, not next-token logits; only GPTNeoXForCausalLM (or the "
                         f"bare GPTNeoXModel) is supported")


def normalize_filter_layers(config: NeoXConfig,
                            filter_layers: Iterable[int] | None) -> tuple[int, ...]:
    """The kept block indices, sorted and de-duplicated. ``None`` keeps every block.

    ``filter_layers`` counts transformer blocks from 0 as the checkpoint does
    (``gpt_neox.layers.{i}``): valid values are ``0 .. num_hidden_layers-1``. The embedding,
    final norm and readout are always kept. (labml's reference counted the embedding as layer
    0 and the blocks from 1, so its ``{0, 1}`` -- embedding plus first block -- is ``{0}`` here.)
    """
    n = config.num_hidden_layers
    if filter_layers is None:
        return tuple(range(n))
    if isinstance(filter_layers, (str, bytes)):
        raise ValueError(f"filter_layers must be a collection of block indices, got "
                         f"{filter_layers!r}")
    chosen = list(filter_layers)
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"filter_layers must contain integers (block indices 0..{n - 1}), "
                             f"got {i!r}")
    if not chosen:
        raise ValueError(f"filter_layers is empty; give at least one block index in "
                         f"0..{n - 1} (embedding, final norm and readout are always kept)")
    bad = sorted({i for i in chosen if not 0 <= i < n})
    if bad:
        raise ValueError(f"filter_layers {bad} out of range: this model has {n} blocks, "
                         f"valid indices are 0..{n - 1} (0-based, as gpt_neox.layers.{{i}} in "
                         f"the checkpoint; the embedding is not counted)")
    return tuple(sorted(set(chosen)))


def filtered_config(config: NeoXConfig, filter_layers: Iterable[int] | None) -> NeoXConfig:
    """The configuration of the stack that keeps only ``filter_layers`` (see
    ``normalize_filter_layers``): the same model with ``num_hidden_layers`` = kept blocks. What
    a filtered model is exported, loaded and described as."""
    kept = normalize_filter_layers(config, filter_layers)
    return dataclasses.replace(config, num_hidden_layers=len(kept))


# Published hyper-parameters (the config.json of each EleutherAI checkpoint). "tiny" is ours:
# random initialisation for machines without weights; 4 small blocks, so the embedding and the
# readout (vocab x 64 each) are most of its 6.7M parameters. Its vocab_size (50304, Pythia's
# padded size, which covers every id of the GPT-NeoX-20B tokenizer) is meant to be replaced by
# the tokenizer's size: dataclasses.replace(PRESETS["tiny"], vocab_size=n).
PRESETS: dict[str, NeoXConfig] = {
    "tiny": NeoXConfig(vocab_size=50304, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=256),
    "pythia-70m": NeoXConfig(vocab_size=50304, hidden_size=512, num_hidden_layers=6,
                             num_attention_heads=8, intermediate_size=2048),
    "pythia-160m": NeoXConfig(vocab_size=50304, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072),
    "pythia-410m": NeoXConfig(vocab_size=50304, hidden_size=1024, num_hidden_layers=24,
                              num_attention_heads=16, intermediate_size=4096),
    "pythia-1b": NeoXConfig(vocab_size=50304, hidden_size=2048, num_hidden_layers=16,
                            num_attention_heads=8, intermediate_size=8192),
    "pythia-1.4b": NeoXConfig(vocab_size=50304, hidden_size=2048, num_hidden_layers=24,
                              num_attention_heads=16, intermediate_size=8192),
    "gpt-neox-20b": NeoXConfig(vocab_size=50432, hidden_size=6144, num_hidden_layers=44,
                               num_attention_heads=64, intermediate_size=24576,
                               hidden_act="gelu_fast"),
}


# The tiny preset's vocabulary is the tokenizer's, rounded up as GPT-NeoX pads its embedding.
VOCAB_MULTIPLE = 128


def preset_config(name: str, *, tokenizer_rows: int | None = None) -> NeoXConfig:
    """A preset's configuration. The tiny preset takes the tokenizer's vocabulary (rounded up
    to ``VOCAB_MULTIPLE``): it is meant for whatever tokenizer the run trains."""
    if name not in PRESETS:
        raise UsageError(f"unknown --model {name!r}; presets: {', '.join(sorted(PRESETS))}")
    config = PRESETS[name]
    if name == "tiny" and tokenizer_rows is not None:
        config = dataclasses.replace(
            config, vocab_size=-(-tokenizer_rows // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    return config
