"""What is trained: the fine-tuning modes, applied to each layer before it is sharded.

- ``biases`` (default, as in the source article): per transformer block the attention qkv bias,
  the attention output bias and the MLP h→4h bias; everything else frozen.
- ``lora``: LoRA adapters on the chosen projections of every block are the only trainable
  parameters.
- ``full``: every parameter.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from neox.lora import add_lora

MODES = ("biases", "lora", "full")
BIAS_NAMES = ("attention.query_key_value.bias", "attention.dense.bias", "mlp.dense_h_to_4h.bias")


@dataclasses.dataclass(frozen=True)
class FinetuneMode:
    mode: str = "biases"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query_key_value", "attention.dense")
    seed: int = 0  # for the LoRA initialisation, identical on every rank

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown fine-tuning mode {self.mode!r}; choose one of {MODES}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) \
                or self.lora_rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.lora_rank!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) \
                or not math.isfinite(self.lora_alpha) or self.lora_alpha <= 0:
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.lora_alpha!r}")
        if not isinstance(self.lora_targets, tuple) or not self.lora_targets or not all(
                isinstance(t, str) and t for t in self.lora_targets):
            raise ValueError(f"LoRA targets must be projection names, got {self.lora_targets!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"the LoRA seed must be an integer, got {self.seed!r}")

    @property
    def lora_scaling(self) -> float:
        """What each adapter's B A is multiplied by: alpha / r."""
        return self.lora_alpha / self.lora_rank


def is_block(layer: nn.Module) -> bool:
    return hasattr(layer, "attention") and hasattr(layer, "mlp")


def prepare_layer(layer: nn.Module, index: int, mode: FinetuneMode) -> nn.Module:
    """Sets requires_grad (and inserts LoRA adapters) on one layer; ``index`` is the layer's
    position in the stack, used to seed its adapters."""
    if mode.mode == "full":
        layer.requires_grad_(True)
        return layer
    layer.requires_grad_(False)
    if not is_block(layer):
        return layer
    if mode.mode == "biases":
        params = dict(layer.named_parameters())
        for name in BIAS_NAMES:
            # A model without attention biases (attention_bias=False) trains the MLP bias only.
            if name in params:
                params[name].requires_grad_(True)
    else:
        gen = torch.Generator().manual_seed(mode.seed * 100003 + index)
        add_lora(layer, list(mode.lora_targets), mode.lora_rank, mode.lora_alpha, gen)
        for name, p in layer.named_parameters():
            p.requires_grad_(name.endswith("lora_A") or name.endswith("lora_B"))
    return layer
