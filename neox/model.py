"""GPT-NeoX as a stack of layers: ``Embedding``, N ``Block``s, ``FinalNorm``, ``Readout``.

Each layer maps one tensor to one tensor (token ids -> hidden states -> ... -> logits), so a
sharding engine can wrap each one on its own; this file knows nothing of sharding. Parameter
names inside each layer are Hugging Face's, so reading a checkpoint is a prefix rename:

    Embedding   embed_in.weight                    <- gpt_neox.embed_in.weight
    Block i     input_layernorm.*, attention.*,    <- gpt_neox.layers.{i}.*
                post_attention_layernorm.*, mlp.*
    FinalNorm   final_layer_norm.*                 <- gpt_neox.final_layer_norm.*
    Readout     embed_out.weight                   <- embed_out.weight

The computation follows transformers' ``GPTNeoXForCausalLM`` step for step (same qkv head
layout, same rotary formula with fp32 angles, same residual order), with attention by
``F.scaled_dot_product_attention``. Shapes: B batch, T tokens, H hidden, nh heads, hs head size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from neox.config import SUPPORTED_ACTIVATIONS, NeoXConfig, normalize_filter_layers

__all__ = ["KVCache", "Embedding", "Block", "FinalNorm", "Readout", "NeoXModel", "LayerKind",
           "LayerSpec", "layer_specs", "build_layer", "build_layers", "allocated", "init_weights",
           "ACTIVATIONS"]

LayerKind = Literal["embed", "block", "final_norm", "readout"]


# -- activations, as transformers' ACT2FN defines them (same formulas, same op order) ----------

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:  # gelu_new, gelu_accurate, gelu_python_tanh
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return 0.5 * x * (1.0 + torch.tanh(inner))


def _gelu_tanh_python(x: torch.Tensor) -> torch.Tensor:  # same formula, other product order
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return x * 0.5 * (1.0 + torch.tanh(inner))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:  # GPT-NeoX-20B's activation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh_python,
    "gelu_fast": _gelu_fast,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "hardswish": F.hardswish,
    "linear": lambda x: x,
}
assert set(ACTIVATIONS) == SUPPORTED_ACTIVATIONS, "config.SUPPORTED_ACTIVATIONS is out of date"


# -- rotary position embedding ------------------------------------------------------------------

def rotary_cos_sin(config: NeoXConfig, positions: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``(T, rotary_dim)`` for integer ``positions`` ``(T,)``.

    Angles are computed in fp32 exactly as transformers does (same inverse frequencies, same
    product), then cast to the activations' dtype; bitwise equal on the CPU (transformers
    computes its inverse frequencies on the CPU once, so on a GPU the last bit of a ``pow`` may
    differ). Computed on the fly: it is a (T x rd/2) outer
    product, negligible next to the block's matmuls, and it keeps the layer free of buffers that
    a dtype cast of the module would round.
    """
    nd = config.rotary_ndims
    exponents = torch.arange(0, nd, 2, dtype=torch.float32, device=positions.device) / nd
    inv_freq = 1.0 / (config.rotary_emb_base ** exponents)                 # (rd/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]                 # (T, rd/2)
    angles = torch.cat((freqs, freqs), dim=-1)                             # (T, rd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first ``cos.shape[-1]`` dims of ``x`` (B, nh, T, hs); the rest pass through."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


# -- layers -----------------------------------------------------------------------------------

class Embedding(nn.Module):
    """Token ids (B, T) int64 -> hidden states (B, T, H)."""

    kind: LayerKind = "embed"

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        # On the meta device the weight is given, not initialised: nn.Embedding's normal_ runs
        # there through torch's Python reference kernels, whose first call imports torch's
        # compiler (seconds, during which a run's build showed nothing), to set no values.
        weight = (torch.empty(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
                  if device is not None and torch.device(device).type == "meta" else None)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight,
                                     device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_in(ids)


@dataclasses.dataclass
class KVCache:
    """Keys and values of the tokens one attention layer has already seen (generation)."""

    k: torch.Tensor | None = None  # (B, nh, T_past, hs), rotary already applied
    v: torch.Tensor | None = None  # (B, nh, T_past, hs)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


class Attention(nn.Module):
    """Causal self-attention with partial rotary embeddings."""

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.n_head = config.num_attention_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.query_key_value = nn.Linear(h, 3 * h, bias=config.attention_bias,
                                         device=device, dtype=dtype)
        self.dense = nn.Linear(h, h, bias=config.attention_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, H = x.shape
        # The checkpoint's fused projection is laid out per head as [q | k | v], so the
        # 3H outputs reshape to (nh, 3*hs) and split on the last axis (not (3, nh, hs)).
        qkv = self.query_key_value(x).view(B, T, self.n_head, 3 * self.head_dim)
        qkv = qkv.transpose(1, 2)                                    # (B, nh, T, 3hs)
        q, k, v = qkv.chunk(3, dim=-1)                               # (B, nh, T, hs) each
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + T, device=x.device)   # absolute positions
        cos, sin = rotary_cos_sin(self.config, positions, x.dtype)  # (T, rd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)                                # (B, nh, past + T, hs)
        scale = self.head_dim ** -0.5
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            # New token t (absolute position past + t) sees keys 0 .. past + t. SDPA's
            # is_causal aligns the mask top-left, which is wrong when T != past + T.
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        y = y.transpose(1, 2).reshape(B, T, H)                       # (B, T, H)
        return self.dense(y)


class MLP(nn.Module):
    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size,
                                       device=device, dtype=dtype)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size,
                                       device=device, dtype=dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class Block(nn.Module):
    """One GPT-NeoX transformer layer, (B, T, H) -> (B, T, H)."""

    kind: LayerKind = "block"

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        h, eps = config.hidden_size, config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(h, eps=eps, device=device, dtype=dtype)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=eps, device=device, dtype=dtype)
        self.attention = Attention(config, device=device, dtype=dtype)
        self.mlp = MLP(config, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), cache)
        # The sums are written in transformers' order so fp results agree bit for bit.
        if self.use_parallel_residual:
            # x + attn(ln1(x)) + mlp(ln2(x))
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        attn = attn + x
        return self.mlp(self.post_attention_layernorm(attn)) + attn


class FinalNorm(nn.Module):
    kind: LayerKind = "final_norm"

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                             device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(x)


class Readout(nn.Module):
    """Hidden states (B, T, H) -> logits (B, T, vocab)."""

    kind: LayerKind = "readout"

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                   device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_out(x)


_LAYER_CLASSES: dict[str, type[nn.Module]] = {
    "embed": Embedding, "block": Block, "final_norm": FinalNorm, "readout": Readout}


# -- the stack ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a (possibly filtered) stack: its kind and, for a block, its index in the
    checkpoint (``source``) and its index in the built stack (``index``)."""

    kind: LayerKind
    source: int | None = None
    index: int | None = None


def layer_specs(config: NeoXConfig, filter_layers: Iterable[int] | None = None) -> list[LayerSpec]:
    """The layers of the stack in order: embed, the kept blocks renumbered 0.., final_norm,
    readout."""
    kept = normalize_filter_layers(config, filter_layers)
    return ([LayerSpec("embed")]
            + [LayerSpec("block", source=s, index=i) for i, s in enumerate(kept)]
            + [LayerSpec("final_norm"), LayerSpec("readout")])


def build_layer(kind: LayerKind, config: NeoXConfig, *, device=None, dtype=None) -> nn.Module:
    """One layer, uninitialised values as ``nn`` modules leave them (use ``device="meta"`` to
    allocate nothing, then materialise with ``load_state_dict(..., assign=True)``)."""
    try:
        cls = _LAYER_CLASSES[kind]
    except KeyError:
        raise ValueError(f"unknown layer kind {kind!r}; expected one of "
                         f"{sorted(_LAYER_CLASSES)}") from None
    return cls(config, device=device, dtype=dtype)


def allocated(layer: nn.Module, device) -> nn.Module:
    """``layer``, built on the meta device, with its parameters and buffers allocated on
    ``device``, uninitialised: ``Module.to_empty``, but with ``torch.empty`` (the meta tensors
    are contiguous) instead of ``torch.empty_like``, whose first call on a meta tensor imports
    sympy: 0.3 s of CPU in every rank that builds a layer (measured 2026-12-06, torch 2.13)."""
    return layer._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


@torch.no_grad()
def init_weights(layer: nn.Module, *, std: float = 0.02,
                 generator: torch.Generator | None = None) -> nn.Module:
    """transformers' GPT-NeoX initialisation: linear and embedding weights N(0, std), biases 0,
    layer norms 1 and 0. ``generator`` (on the layer's device) makes it reproducible."""
    for m in layer.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.normal_(0.0, std, generator=generator)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
    return layer


def build_layers(config: NeoXConfig, *, filter_layers: Iterable[int] | None = None,
                 device=None, dtype=None, generator: torch.Generator | None = None,
                 ) -> list[nn.Module]:
    """The layer stack with random weights (``init_weights``), or unallocated with
    ``device="meta"``. ``filter_layers``: see ``normalize_filter_layers``."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    layers = []
    for spec in layer_specs(config, filter_layers):
        # Built on meta and then allocated, so nn's own initialisation (overwritten anyway)
        # is skipped.
        layer = build_layer(spec.kind, config, device="meta", dtype=dtype)
        if device.type != "meta":
            init_weights(allocated(layer, device), generator=generator)
        layers.append(layer)
    return layers


class NeoXModel(nn.Sequential):
    """Token ids (B, T) -> logits (B, T, vocab), running ``layers`` in order.

    ``config`` describes the built stack (``num_hidden_layers`` = blocks kept);
    ``source_layers`` are the kept blocks' indices in the checkpoint they came from.
    """

    def __init__(self, config: NeoXConfig, layers: Iterable[nn.Module], *,
                 source_layers: Iterable[int] | None = None):
        super().__init__(*layers)
        kinds = [getattr(m, "kind", None) for m in self]
        n_blocks = sum(k == "block" for k in kinds)
        if (len(kinds) < 3 or kinds[0] != "embed" or kinds[-2:] != ["final_norm", "readout"]
                or n_blocks != len(kinds) - 3):
            raise ValueError(f"NeoXModel expects embed, blocks..., final_norm, readout; got "
                             f"{kinds}")
        if n_blocks != config.num_hidden_layers:
            raise ValueError(f"NeoXModel: config has {config.num_hidden_layers} blocks but "
                             f"{n_blocks} were given")
        self.config = config
        self.source_layers = (tuple(source_layers) if source_layers is not None
                              else tuple(range(n_blocks)))

    def forward_cached(self, ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Logits (B, T, vocab) for new tokens ``ids`` (B, T) that follow the tokens already in
        ``caches`` (one ``KVCache`` per block, filled in place): the incremental forward of
        generation. With empty caches it equals ``forward``."""
        x = ids
        blocks = iter(caches)
        for layer in self:
            x = layer(x, next(blocks)) if layer.kind == "block" else layer(x)
        return x

    def new_caches(self) -> list[KVCache]:
        return [KVCache() for layer in self if layer.kind == "block"]
