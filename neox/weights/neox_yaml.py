"""GPT-NeoX (the EleutherAI training library) YAML configs: reading their top-level settings, and
translating them into a ``NeoXConfig``.

NeoX treats ``-`` and ``_`` in keys alike; everything here returns keys with ``_``. PyYAML is
used when installed, else a small parser of the top-level scalars (``parse_flat_yaml``), which
is all a model's shape needs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from neox.config import SUPPORTED_ACTIVATIONS, NeoXConfig
from neox.weights.base import WeightsError

__all__ = ["parse_flat_yaml", "read_neox_yaml", "config_from_neox_yaml", "normalize_keys"]


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


def config_from_neox_yaml(args: Mapping[str, Any], *, vocab_size: int,
                          where: str = "NeoX config") -> NeoXConfig:
    """A ``NeoXConfig`` from NeoX settings (``read_neox_yaml``'s output; ``-`` or ``_`` keys).
    ``vocab_size``: NeoX pads the tokenizer's size, so it comes from the weights. Settings the
    model cannot represent (learned positions, RMSNorm, tied block norms, gated MLPs, sparse
    attention) are errors naming ``where``."""
    a = normalize_keys(args)

    def need(key: str) -> Any:
        if key not in a:
            raise WeightsError(f"{where}: '{key.replace('_', '-')}' is missing")
        return a[key]

    def unsupported(what: str) -> WeightsError:
        return WeightsError(f"{where}: {what}; GPT-NeoX in Hugging Face form (and this "
                               f"model) does not support that")

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
    max_pos = a.get("max_position_embeddings") or a.get("seq_length") or 2048
    try:
        return NeoXConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_hidden_layers=need("num_layers"),
            num_attention_heads=need("num_attention_heads"),
            intermediate_size=a.get("intermediate_size") or 4 * hidden,
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

