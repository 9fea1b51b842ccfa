"""A frozen base as the engine holds it quantized (``zerocore.FrozenWeights(dtype=...)``), made
independently of the engine: each frozen parameter quantized alone, zero-padded to whole blocks,
and dequantized by the plain-PyTorch references (zerocore.kernels.reference). The engine puts
every parameter of a quantized group on its own blocks (``FlatLayout.build(block=)``), so this
is exactly what it computes with, at any world size and in either placement."""

from __future__ import annotations

import copy

import torch
from torch import nn

from zerocore.kernels import formats, reference

# Each format with a block other than its default where the engine allows it, so that a block
# size passed to the policy but not to the kernels would show.
FORMATS = {"int8": 64, "nf4": 64, "fp8": 96}


def round_trip(t: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    """``t`` quantized in ``dtype`` by blocks of ``block`` (from fp32) and dequantized to fp32."""
    flat = t.detach().float().reshape(-1)
    padded = torch.zeros(-(-flat.numel() // block) * block)
    padded[:flat.numel()] = flat
    n = padded.numel()
    if dtype == "int8":
        q, scales = reference.quantize_blockwise(padded, block)
        values = reference.dequantize_blockwise(q, scales, block, torch.float32)
    elif dtype == "nf4":
        packed, scales = formats.quantize_nf4(padded, block)
        values = reference.dequantize_nf4(packed, scales, n, block, torch.float32)
    else:
        codes, scales = formats.quantize_fp8(padded, block)
        values = reference.dequantize_fp8(codes, scales, block, torch.float32)
    return values[:flat.numel()].view(t.shape)


def dequantized(model: nn.Module, dtype: str, block: int) -> nn.Module:
    """A copy of ``model`` whose frozen parameters are replaced by their round trip."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.copy_(round_trip(p, dtype, block).to(p.dtype))
    return model
