"""What the fused-Adam tests share (tests/kernels/test_ops.py, test_cpu_adam.py): seeded
inputs, views placed in NaN-filled buffers so that a kernel writing outside its view is caught,
and an exact float32 replay of the CPU kernel's arithmetic to compare with bit for bit."""

from __future__ import annotations

import math

import torch

# Elements of NaN left after every view we hand to a kernel: more than one 16-element vector block,
# so a kernel that writes a whole block past the end is caught.
SLACK = 19
# Adam's hyper-parameters in the fused-Adam comparisons with the exact replay.
HYPER = dict(lr=3e-3, beta1=0.85, beta2=0.98, eps=1e-6)


def randn(shape, seed: int, device: str, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device)


def placed(values: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): ``view`` holds ``values`` at ``buffer[offset:]``; everything else is NaN.
    offset > 0 gives a view whose data pointer is not 16-byte aligned."""
    n = values.numel()
    buf = torch.full((offset + n + SLACK,), float("nan"), dtype=values.dtype, device=values.device)
    view = buf[offset:offset + n]
    view.copy_(values)
    return buf, view


def assert_slack_untouched(buf: torch.Tensor, offset: int, n: int) -> None:
    assert torch.isnan(buf[:offset]).all() and torch.isnan(buf[offset + n:]).all(), \
        "the kernel wrote outside its view"


def f32(x: float) -> float:
    """The float32 value nearest to x, as the kernel narrows each double-precision constant."""
    return torch.tensor(x, dtype=torch.float32).item()


def exact_adam(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, inv_grad_scale,
               adamw) -> None:
    """Replays the CPU kernel's float32 arithmetic exactly, in place on float32 CPU tensors: one
    torch op per float operation, each correctly rounded, in the kernel's order, which is what the
    kernel's scalar tail and its AVX2 body both compute (built with -ffp-contract=off). Two
    torch shortcuts would round differently and are avoided: fused ops (lerp, addcmul, add with
    alpha) multiply-add in one rounding, and torch.sqrt on float32 is not always correctly
    rounded, so the square root is taken in float64 and rounded once (exact for sqrt)."""
    # The constants of AdamConsts in csrc/checks.cpp, computed in double, narrowed to float.
    one_minus_beta1 = f32(1.0 - beta1)
    one_minus_beta2 = f32(1.0 - beta2)
    wd = 0.0 if adamw else f32(weight_decay)
    decay = f32(1.0 - lr * weight_decay) if adamw else 1.0
    step_size = f32(lr / (1.0 - beta1**step))
    bc2_sqrt = f32(math.sqrt(1.0 - beta2**step))

    g = g.float() * f32(inv_grad_scale)
    g = g + wd * p
    p.mul_(decay)
    m.add_(one_minus_beta1 * (g - m))
    v.copy_(v * f32(beta2) + one_minus_beta2 * (g * g))
    denom = v.double().sqrt().float() / bc2_sqrt + f32(eps)
    p.add_(-step_size * (m / denom))
