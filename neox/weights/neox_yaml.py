"""GPT-NeoX (the EleutherAI training library) YAML configs: reading their top-level settings, and
translating them into a ``NeoXConfig``.

NeoX treats ``-`` and ``_`` in keys alike; everything here returns keys with ``_``. PyYAML is
used when installed, else a small parser of the top-level scalars (``parse_flat_yaml``), which
is all a model's shape needs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from neox.config import SUPPORTED_ACTIVATIONS, NeoXConfig
from neox.weights.base import WeightsError

__all__ = ["parse_flat_yaml", "read_neox_yaml", "config_from_neox_yaml", "normalize_keys",
           "GATED_ACTIVATIONS"]

# NeoX's gated activations (megatron/model/activations.py: get_activation returns is_gated):
# mlp.linear1 then holds two halves, per tensor-parallel rank, of which one gates the other.
# neox.model's MLP is not gated.
GATED_ACTIVATIONS = frozenset({"geglu", "reglu", "swiglu", "glu", "bilinear"})

# Settings of EleutherAI/gpt-neox (megatron/neox_arguments/neox_args.py) that change what the
# model computes and that neox.model does not implement, each with when it is on and why it
# matters. A YAML that turns one on is refused rather than loaded into a model computing
# something else. Checked elsewhere in config_from_neox_yaml: pos-emb, norm, gpt-j-tied,
# use-bias-in-*, rotary-interleaved, attention-config (sparse, local, mamba, rwkv, gmlp, ...),
# activation (gated and unknown ones), the MLP width. Deliberately ignored:
# - apply-query-key-layer-scaling: divides the scores by the layer number and the fused
#   softmax multiplies them back (megatron/model/transformer.py, norm_factor and coeff): a
#   guard against fp16 overflow, the same function;
# - the *-fusion flags except bias-gelu-fusion (same functions in fused kernels; bias-gelu
#   is a tanh approximation and becomes gelu_fast), attention-softmax-in-fp32, precision,
#   sequence-parallel, te-* (TransformerEngine kernels; its renamed tensors are refused as
#   unknown), rope-fusion: numerics and layout, not the function;
# - mup-* without use-mup, num-unique-layers (validated but unused by the model code),
#   opt-pos-emb-offset and rpe-* (learned/relative positions, refused through pos-emb);
# - dropout, initialisation, optimizer, data and logging settings.
_UNSUPPORTED: dict[str, tuple[Callable[[Any, Mapping[str, Any]], bool], str]] = {
    "use_mup": (lambda v, a: bool(v),
                "muP divides attention scores by the head size instead of its square root, "
                "scales the embedding by mup-embedding-mult and the logits by the width "
                "multiplier"),
    "num_kv_heads": (lambda v, a: v is not None and v != a.get("num_attention_heads"),
                     "grouped-query attention (fewer key/value heads than query heads)"),
    "use_qk_layernorm": (lambda v, a: bool(v), "a layer norm on queries and keys"),
    "sliding_window_width": (lambda v, a: v is not None,
                             "sliding-window attention (tokens see only the last N)"),
    "moe_num_experts": (lambda v, a: v is not None and v != 1, "a mixture-of-experts MLP"),
    "mlp_type": (lambda v, a: v not in (None, "regular"),
                 "the gated LLaMA MLP (w1, w2, w3) of older NeoX versions"),
    # megatron/training.py inserts the soft prompt when the dict has enabled: true (default off)
    "soft_prompt_tuning": (lambda v, a: isinstance(v, Mapping) and bool(v.get("enabled", False)),
                           "a learned soft prompt prepended to every input"),
    "train_impl": (lambda v, a: v == "rm",
                   "a reward model: the output layer is a one-value head, not the vocabulary"),
}


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment (a ``#`` inside quotes is kept)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[:i]
    return line


def _depth_change(code: str) -> int:
    depth, quote = 0, None
    for c in code:
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
    return depth


def _scalar(text: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "none", "~", ""):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


_KEY_VALUE = re.compile(r"""\s*["']?([A-Za-z0-9_.\-]+)["']?\s*:\s*(.*?)\s*,?\s*""")


def parse_flat_yaml(text: str) -> dict[str, Any]:
    """The top-level scalar ``key: value`` entries of a NeoX config file, without PyYAML.

    NeoX configs are either one JSON-like mapping with comments (``{ "num-layers": 44, ... }``,
    trailing commas, Python-style ``True``) or plain block YAML. Nested mappings and lists
    (optimizer, zero_optimization, ...) are skipped: the model's shape needs only scalars.
    """
    code_lines = [_strip_comment(line) for line in text.splitlines()]
    significant = "".join(code_lines).strip()
    flow = significant.startswith("{")
    top = 1 if flow else 0
    out: dict[str, Any] = {}
    depth = 0
    for code in code_lines:
        at_top = depth == top and (flow or not code[:1].isspace())
        if at_top:
            m = _KEY_VALUE.fullmatch(code)
            if m and not m.group(2).startswith(("{", "[")) and m.group(2) != "":
                out[m.group(1)] = _scalar(m.group(2))
        depth += _depth_change(code)
    return out


def normalize_keys(d: Mapping[str, Any]) -> dict[str, Any]:
    """NeoX treats ``-`` and ``_`` in keys alike; use ``_``."""
    return {str(k).replace("-", "_"): v for k, v in d.items()}


def read_neox_yaml(files: Iterable[str | Path]) -> dict[str, Any]:
    """The merged top-level settings of NeoX config files (keys with ``_``). Uses PyYAML when
    installed, else ``parse_flat_yaml``. A key set to different values in two files is an
    error, as in NeoX."""
    try:
        import yaml
    except ImportError:
        yaml = None
    merged: dict[str, Any] = {}
    origin: dict[str, Path] = {}
    for file in files:
        file = Path(file)
        try:
            text = file.read_text()
        except OSError as e:
            raise WeightsError(f"{file}: cannot read ({e})") from None
        if yaml is not None:
            try:
                loaded = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise WeightsError(f"{file}: not a readable NeoX config ({e})") from None
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise WeightsError(f"{file}: a NeoX config must be a mapping, got "
                                      f"{type(loaded).__name__}")
        else:
            loaded = parse_flat_yaml(text)
        for key, value in normalize_keys(loaded).items():
            if key in merged and merged[key] != value:
                raise WeightsError(f"{file}: '{key}' is {value!r} here but {merged[key]!r} in "
                                      f"{origin[key]}; NeoX config files must not disagree")
            merged[key] = value
            origin[key] = file
    return merged



def _number(args: Mapping[str, Any], key: str, default: Any, where: str) -> Any:
    value = args.get(key, default)
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise WeightsError(f"{where}: '{key}' must be a number, got {value!r}") from None
    return value


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _mlp_width(a: Mapping[str, Any], where: str, found: int | None, found_where: str) -> int:
    """The MLP width (``linear1``'s outputs, ``linear2``'s inputs) of a NeoX model: ``found``
    (read from the weights, by ``found_where``) checked against the YAML, or the YAML's own
    width when None.

    NeoX (megatron/model/transformer.py, ParallelMLP) starts from intermediate-size, else
    expansion-factor x hidden-size, else 4 x hidden-size, and rounds linear1's width up to a
    multiple of 2 x mlp-multiple-of (default 1, so 4h stays 4h) and linear2's to a multiple of
    mlp-multiple-of; a working non-gated model has the two equal. Between 2024-09-07 (commit
    0d4bdb96, which introduced the rounding and the linear1/linear2 names) and 2024-09-10
    (adbf5d6f, which added mlp-multiple-of) the multiple was a fixed 256, so linear1 was
    rounded up to a multiple of 512 whatever the YAML said; weights from those versions are
    wider than their YAML implies."""
    hidden = a["hidden_size"]
    stated, factor = a.get("intermediate_size"), a.get("expansion_factor")
    if stated is not None and factor is not None:
        raise WeightsError(f"{where}: both intermediate-size and expansion-factor are set; "
                           f"NeoX accepts only one")
    if stated is not None:
        if isinstance(stated, bool) or not isinstance(stated, int) or stated < 1:
            raise WeightsError(f"{where}: intermediate-size must be a positive integer, got "
                               f"{stated!r}")
        base, said = stated, f"intermediate-size {stated}"
    elif factor is not None:
        factor = _number(a, "expansion_factor", None, where)
        base, said = int(factor * hidden), f"expansion-factor {factor} (x hidden-size {hidden})"
    else:
        base, said = 4 * hidden, None
    multiple = a.get("mlp_multiple_of", 1)
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise WeightsError(f"{where}: mlp-multiple-of must be a positive integer, got "
                           f"{multiple!r}")
    width = _round_up(base, 2 * multiple)
    if found is None or found == width:
        return width
    if said is None:
        # Nothing stated: NeoX's implied width has changed between versions, and the weights
        # are what the model computes with.
        return found
    allowed = sorted({width, _round_up(base, 512)})
    if found not in allowed:
        raise WeightsError(
            f"{found_where}: the MLP is {found} wide, but {where} gives {said}, from which "
            f"NeoX builds {' or '.join(map(str, allowed))}; the YAML does not belong to these "
            f"weights")
    return found


def config_from_neox_yaml(args: Mapping[str, Any], *, vocab_size: int,
                          where: str = "NeoX config", mlp_width: int | None = None,
                          mlp_width_where: str = "the weights") -> NeoXConfig:
    """A ``NeoXConfig`` from NeoX settings (``read_neox_yaml``'s output; ``-`` or ``_`` keys).
    ``vocab_size``: NeoX pads the tokenizer's size, so it comes from the weights. Settings the
    model cannot represent (learned positions, RMSNorm, tied block norms, gated MLPs, sparse
    attention, muP, grouped-query attention, ...: see ``_UNSUPPORTED``) are errors naming
    ``where`` and the setting. ``mlp_width``: the MLP width the weights have (read at
    ``mlp_width_where``), used as ``intermediate_size`` after checking it is one the YAML's
    stated width can become in NeoX (see ``_mlp_width``); None uses the YAML's."""
    a = normalize_keys(args)

    def need(key: str) -> Any:
        if key not in a:
            raise WeightsError(f"{where}: '{key.replace('_', '-')}' is missing")
        return a[key]

    def unsupported(what: str) -> WeightsError:
        return WeightsError(f"{where}: {what}; GPT-NeoX in Hugging Face form (and this "
                               f"model) does not support that")

    for key, (is_on, why) in _UNSUPPORTED.items():
        if key in a and is_on(a[key], a):
            raise WeightsError(f"{where}: '{key.replace('_', '-')}' is {a[key]!r}: {why}, "
                               f"which this model does not implement; not supported")

    pos_emb = a.get("pos_emb", "learned")  # NeoX's default
    if pos_emb != "rotary":
        raise unsupported(f"pos-emb is {pos_emb!r} (NeoX's default is 'learned'), not 'rotary'")
    norm = a.get("norm", "layernorm")
    if norm != "layernorm":
        raise unsupported(f"norm is {norm!r}, not 'layernorm'")
    if a.get("gpt_j_tied", False):
        raise unsupported("gpt-j-tied is true (one layer norm shared by attention and MLP)")
    for key in ("use_bias_in_norms", "use_bias_in_mlp"):
        if a.get(key, True) is False:
            raise unsupported(f"{key.replace('_', '-')} is false")
    if a.get("rotary_interleaved", False):
        raise unsupported("rotary-interleaved is true")
    attention_config = a.get("attention_config")
    if attention_config:
        kinds = set()
        try:
            for types, _count in attention_config:
                kinds.update(types)
        except (TypeError, ValueError):
            raise WeightsError(f"{where}: attention-config {attention_config!r} is not a "
                                  f"list of [[types], count]") from None
        if not kinds <= {"global", "flash"}:
            raise unsupported(f"attention-config uses {sorted(kinds - {'global', 'flash'})}")

    activation = a.get("activation", "gelu")
    if activation in GATED_ACTIVATIONS:
        raise unsupported(f"activation is {activation!r}, a gated MLP (mlp.linear1 holds the "
                          f"value and the gate halves), which this model does not implement")
    if activation == "gelu":
        if a.get("bias_gelu_fusion", False):
            # NeoX's fused kernel is the tanh approximation x*(1 + 0.044715 x^2) form, which
            # is transformers' "gelu_fast" (what the 20B config.json says).
            activation = "gelu_fast"
        elif a.get("openai_gelu", False):
            activation = "gelu_new"
    elif activation == "swish":
        activation = "silu"
    if activation not in SUPPORTED_ACTIVATIONS:
        raise unsupported(f"activation is {activation!r}")

    hidden = need("hidden_size")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise WeightsError(f"{where}: hidden-size must be a positive integer, got {hidden!r}")
    max_pos = a.get("max_position_embeddings") or a.get("seq_length") or 2048
    intermediate = _mlp_width(a, where, mlp_width, mlp_width_where)
    try:
        return NeoXConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_hidden_layers=need("num_layers"),
            num_attention_heads=need("num_attention_heads"),
            intermediate_size=intermediate,
            hidden_act=activation,
            rotary_pct=float(_number(a, "rotary_pct", 1.0, where)),  # NeoX's default is 1.0
            rotary_emb_base=float(_number(a, "rotary_emb_base", 10000.0, where)),
            max_position_embeddings=max_pos,
            layer_norm_eps=float(_number(a, "layernorm_epsilon", 1e-5, where)),
            use_parallel_residual=bool(a.get("gpt_j_residual", False)),
            attention_bias=bool(a.get("use_bias_in_attn_linear", True)),
            tie_word_embeddings=not a.get("no_weight_tying", False),
        )
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{where}: {e}") from None

