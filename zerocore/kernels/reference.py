"""Plain-PyTorch definitions of what each zerocore op computes.

The tests compare the compiled kernels against these on random inputs. They follow
``torch.optim.adam._single_tensor_adam`` operation by operation, so a difference between a kernel
and its reference is a kernel bug or float rounding, never a different formula.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from zerocore.kernels.formats import NF4_CODE, quantize_fp8, quantize_nf4

__all__ = ["fused_adam", "fused_adam_multi", "grad_stats", "pack", "unpack", "quantize_blockwise",
           "dequantize_blockwise", "dequantize_nf4", "dequantize_fp8", "round_trip", "NF4_CODE"]


def fused_adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, model_copy: torch.Tensor | None = None, *, lr: float,
               beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, step: int, inv_grad_scale: float = 1.0,
               adamw: bool = True) -> None:
    """Reference for ``zerocore.ops.fused_adam`` (same arguments, same in-place effects)."""
    g = grad.float() * inv_grad_scale
    if adamw:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if model_copy is not None:
        model_copy.copy_(param)


def fused_adam_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                     model_copies: Sequence[torch.Tensor] | None = None, *,
                     lrs: Sequence[float], weight_decays: Sequence[float], beta1: float = 0.9,
                     beta2: float = 0.999, eps: float = 1e-8, step: int,
                     inv_grad_scale: float = 1.0, adamw: bool = True) -> None:
    """Reference for ``zerocore.ops.fused_adam_multi``: ``fused_adam`` on each shard."""
    copies = list(model_copies) if model_copies else [None] * len(params)
    for param, grad, m, v, copy, lr, wd in zip(params, grads, exp_avgs, exp_avg_sqs, copies,
                                               lrs, weight_decays, strict=True):
        fused_adam(param, grad, m, v, copy, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=wd, step=step, inv_grad_scale=inv_grad_scale, adamw=adamw)


def grad_stats(grad: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``zerocore.ops.grad_stats``: squares summed in float64."""
    if stats is None:
        stats = torch.zeros(2, dtype=torch.float32, device=grad.device)
    g = grad.double()
    stats[0] += g.square().sum().float()
    if not bool(torch.isfinite(g).all()):
        stats[1] = 1.0
    return stats


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int],
         flat: torch.Tensor) -> torch.Tensor:
    """Reference for ``zerocore.ops.pack``."""
    flat.zero_()
    for t, off in zip(tensors, offsets):
        flat[off:off + t.numel()].copy_(t.reshape(-1))
    return flat


def unpack(flat: torch.Tensor, offsets: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
    """Reference for ``zerocore.ops.unpack``."""
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off:off + t.numel()].view(t.shape))


def quantize_blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``zerocore.ops.quantize_blockwise``, bit for bit.

    The two divisions are done in float64 and rounded to float32: the quotient of two float32
    numbers rounded to float64 and then to float32 is the correctly rounded float32 quotient (53 >=
    2 * 24 + 2 bits), which is what the kernels' IEEE float32 divisions give. A float32 division in
    torch would not do: with a divisor that broadcasts as a scalar, torch may multiply by its
    reciprocal instead, which can differ in the last bit.
    """
    if block < 1 or x.dim() != 1 or x.numel() % block:
        raise ValueError(f"x must be 1-D with a length that is a multiple of block >= 1, got "
                         f"shape {tuple(x.shape)} and block {block}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x has an inf or nan; a non-finite weight cannot be quantized")
    xs = x.float().view(-1, block)                              # (n_blocks, block)
    absmax = xs.abs().amax(dim=1)                               # (n_blocks,)
    scales = (absmax.double() / 127.0).float()                  # (n_blocks,)
    ratio = (xs.double() / scales.double()[:, None]).float()   # nan where the scale is 0
    q = torch.round(ratio).clamp(-127, 127)                     # round: half to even
    q = torch.where(scales[:, None] == 0, 0.0, q)
    return q.to(torch.int8).view(-1), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, block: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """Reference for ``zerocore.ops.dequantize_blockwise``: the fp32 product (exact in float64,
    since an int8 times a float32 needs at most 32 bits, then rounded once to float32) rounded to
    ``dtype`` by ``.to``, round to nearest even."""
    prod = (q.double().view(-1, block) * scales.double()[:, None]).float()
    return prod.to(dtype).view(-1)


def _scaled(values: torch.Tensor, scales: torch.Tensor, block: int,
            dtype: torch.dtype) -> torch.Tensor:
    """values[i] * scales[i // block]: the product of two float32 numbers is exact in float64
    (48 <= 53 bits), so rounding it to float32 gives the correctly rounded fp32 product the
    kernels compute; then rounded once more, to nearest even, to ``dtype``."""
    per_element = scales.double().repeat_interleave(block)[:values.numel()]
    return (values.double() * per_element).float().to(dtype)


def dequantize_nf4(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Reference for ``zerocore.ops.dequantize_nf4_``: element 2i is the low nibble of byte i,
    element 2i + 1 the high one; each code's value from ``formats.NF4_CODE``, times its block's
    scale."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:n].long()
    return _scaled(NF4_CODE.to(packed.device)[codes], scales, block, dtype)


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, block: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Reference for ``zerocore.ops.dequantize_fp8_``: torch's own e4m3fn -> float32 conversion
    of each code (exact), times its block's scale."""
    return _scaled(codes.view(torch.float8_e4m3fn).float(), scales, block, dtype)


def round_trip(t: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    """``t`` as a frozen base computes with it under ``FrozenWeights(dtype, block)``: quantized
    from fp32 by blocks of ``block`` (the tensor alone, zero-padded to whole blocks: the engine
    starts every parameter of a quantized group on a block of its own) and dequantized to fp32
    by the references above. ``dtype``: "int8", "nf4" or "fp8"."""
    flat = t.detach().float().reshape(-1).cpu()
    padded = torch.zeros(-(-flat.numel() // block) * block)
    padded[:flat.numel()] = flat
    n = padded.numel()
    if dtype == "int8":
        q, scales = quantize_blockwise(padded, block)
        values = dequantize_blockwise(q, scales, block, torch.float32)
    elif dtype == "nf4":
        packed, scales = quantize_nf4(padded, block)
        values = dequantize_nf4(packed, scales, n, block, torch.float32)
    elif dtype == "fp8":
        codes, scales = quantize_fp8(padded, block)
        values = dequantize_fp8(codes, scales, block, torch.float32)
    else:
        raise ValueError(f"round_trip: {dtype!r} is not a frozen format (int8, nf4, fp8)")
    return values[:flat.numel()].view(t.shape).to(t.device)
