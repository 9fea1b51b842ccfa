"""A frozen base as the engine holds it quantized (``zerocore.FrozenWeights(dtype=...)``), made
independently of the engine: each frozen parameter quantized alone, zero-padded to whole blocks,
and dequantized by the plain-PyTorch references (zerocore.kernels.reference). The engine puts
every parameter of a quantized group on its own blocks (``FlatLayout.build(block=)``), so this
is exactly what it computes with, at any world size and in either placement."""

from __future__ import annotations

import copy

import torch
from torch import nn

from zerocore.kernels.reference import round_trip

# Each format with a block other than its default where the engine allows it, so that a block
# size passed to the policy but not to the kernels would show.
FORMATS = {"int8": 64, "nf4": 64, "fp8": 96}


def dequantized(model: nn.Module, dtype: str, block: int) -> nn.Module:
    """A copy of ``model`` whose frozen parameters are replaced by their round trip."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.copy_(round_trip(p, dtype, block).to(p.dtype))
    return model
