"""LoRA adapters for the linear projections of GPT-NeoX blocks.

``LoRALinear`` replaces an ``nn.Linear`` and keeps its parameter names (``weight``, ``bias``), so
the base checkpoint loads unchanged, and adds ``lora_A`` (r, in) and ``lora_B`` (out, r):

    y = x W^T + b + (alpha / r) · x A^T B^T

B starts at zero, so a fresh adapter leaves the model's output unchanged. Merged for export as
W + (alpha / r) · B A.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # (out, in), frozen by the fine-tuning mode
        self.bias = base.bias      # (out,) or None
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        # Kaiming-uniform as nn.Linear initialises its weight; drawn from an explicit generator so
        # that every rank creates the same adapter.
        bound = 1.0 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(base.weight.dtype))                   # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank,
                                               dtype=base.weight.dtype))      # (out, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        return y + nn.functional.linear(nn.functional.linear(x, self.lora_A),
                                        self.lora_B) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scaling * (self.lora_B.float() @ self.lora_A.float()).to(
            self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, alpha={self.alpha}"


def add_lora(module: nn.Module, targets: list[str], rank: int, alpha: float,
             generator: torch.Generator) -> list[str]:
    """Replaces every ``nn.Linear`` submodule whose name ends with one of ``targets`` (e.g.
    "query_key_value", "attention.dense", "dense_h_to_4h") by a ``LoRALinear``; returns the
    replaced names. Raises if a target matches nothing."""
    replaced = []
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear) and any(name == t or name.endswith("." + t)
                                                for t in targets):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, LoRALinear(child, rank, alpha, generator))
            replaced.append(name)
    unmatched = [t for t in targets if not any(r == t or r.endswith("." + t) for r in replaced)]
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no linear layer of the block; valid "
                         f"targets: query_key_value, attention.dense, dense_h_to_4h, "
                         f"dense_4h_to_h")
    return replaced


def merge_lora(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A layer's state dict with every adapter (``<m>.lora_A``, ``<m>.lora_B``) merged into its
    base weight (``<m>.weight``) and removed: what a plain GPT-NeoX layer loads."""
    out = dict(state)
    for key in [k for k in state if k.endswith(".lora_A")]:
        prefix = key[: -len("lora_A")]
        a, b = out.pop(prefix + "lora_A"), out.pop(prefix + "lora_B")
        w = out[prefix + "weight"]
        out[prefix + "weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out
