"""Plain-PyTorch definitions of what each zerocore op computes.

The tests compare the compiled kernels against these on random inputs. They follow
``torch.optim.adam._single_tensor_adam`` operation by operation, so a difference between a kernel
and its reference is a kernel bug or float rounding, never a different formula.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


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
