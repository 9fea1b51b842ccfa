"""Typed wrappers over the compiled ops ``torch.ops.zerocore.*``, and their fake (meta)
implementations so the ops trace under ``torch.compile``.

Every op works in place on tensors the caller owns; none allocates in the hot path. The plain
PyTorch definitions of what each op computes are in ``zerocore.reference``.
``quantize_blockwise`` is the exception to "in place": it returns new tensors, since it prepares
frozen weights once rather than running every step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from zerocore.kernels import _extension
from zerocore.kernels.formats import FP8_BLOCK, NF4_BLOCK
# Re-exported beside the int8 quantizer: plain PyTorch, run once at load (the dequantizations
# below run after every gather, and are compiled).
from zerocore.kernels.formats import quantize_fp8 as quantize_fp8
from zerocore.kernels.formats import quantize_nf4 as quantize_nf4

__all__ = ["BUILD", "fused_adam", "fused_adam_multi", "grad_stats", "pack", "unpack",
           "quantize_blockwise", "dequantize_blockwise_", "dequantize_blockwise",
           "quantize_nf4", "dequantize_nf4_", "dequantize_nf4", "quantize_fp8", "dequantize_fp8_",
           "dequantize_fp8", "NF4_BLOCK", "FP8_BLOCK"]

# The compiled library registers torch.ops.zerocore.*; loading it here, where the ops are used,
# makes this module work whoever imports it first.
BUILD = _extension.load()
_ops = torch.ops.zerocore


def fused_adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, model_copy: torch.Tensor | None = None, *, lr: float,
               beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, step: int, inv_grad_scale: float = 1.0,
               adamw: bool = True) -> None:
    """One Adam (``adamw=False``, L2 decay) or AdamW (decoupled decay) step on a flat shard.

    param, exp_avg, exp_avg_sq: fp32, contiguous, updated in place. grad: fp32/fp16/bf16, read
    only, multiplied by ``inv_grad_scale`` first (fold loss-scale unscaling and clipping into it).
    model_copy: optional fp16/bf16/fp32 tensor that receives the new parameters in its dtype in
    the same pass. step: the step count including this one (>= 1), for bias correction.
    Same results as ``torch.optim.AdamW``/``Adam`` up to float rounding.
    """
    _ops.fused_adam(param, grad, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps,
                    weight_decay, step, inv_grad_scale, adamw)


def fused_adam_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                     model_copies: Sequence[torch.Tensor] | None = None, *,
                     lrs: Sequence[float], weight_decays: Sequence[float], beta1: float = 0.9,
                     beta2: float = 0.999, eps: float = 1e-8, step: int,
                     inv_grad_scale: float = 1.0, adamw: bool = True) -> None:
    """``fused_adam`` on many flat shards in one launch (one parallel region on the CPU, one
    kernel on CUDA): shard i with ``lrs[i]`` and ``weight_decays[i]``, the other settings and the
    step count shared. Every shard's elements get exactly the bits ``fused_adam`` would give them
    on that shard alone. All on one device; the grads of one dtype, the model copies (None, or
    one per shard) of one dtype. A call with no shards does nothing."""
    if not params:
        return
    _ops.fused_adam_multi(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                          list(model_copies or ()), [float(x) for x in lrs],
                          [float(x) for x in weight_decays], beta1, beta2, eps, step,
                          inv_grad_scale, adamw)


def _cpu_adam_isa(isa: str | None = None) -> str:
    """Which CPU kernels ``fused_adam`` runs on: "scalar", "avx2" or "avx512" (by default the
    widest this CPU supports, or the environment variable ``ZEROCORE_CPU_ISA``, read at the first
    step). With ``isa``, switches this process to those kernels. Every choice computes the same
    bits; this is for tests and benchmarks. Returns the name now in use."""
    return _ops._cpu_adam_isa(isa)


def _cpu_adam_isas() -> list[str]:
    """The CPU kernel sets ``_cpu_adam_isa`` accepts on this CPU and build, narrowest first."""
    return list(_ops._cpu_adam_isas())


def grad_stats(grad: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Accumulates gradient statistics without a host synchronisation.

    ``stats`` (fp32, shape [2], on grad's device; zeros if not given) gets ``stats[0] +=
    sum(grad**2)`` and ``stats[1] = 1`` if any element of grad is inf or nan. Returns stats. Call
    it on several shards with one ``stats`` and all-reduce (sum) that one tensor to get the global
    squared norm and a flag that every rank agrees on.
    """
    if stats is None:
        stats = torch.zeros(2, dtype=torch.float32, device=grad.device)
    _ops.grad_stats(grad, stats)
    return stats


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int],
         flat: torch.Tensor) -> torch.Tensor:
    """Copies each ``tensors[i]`` (any strides, fp32/fp16/bf16) into
    ``flat[offsets[i]:offsets[i] + numel]``, converting to flat's dtype, and zeros every element of
    flat that no tensor covers. Ranges must not overlap. Returns flat."""
    _ops.pack(list(tensors), list(offsets), flat)
    return flat


def unpack(flat: torch.Tensor, offsets: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
    """The reverse of ``pack``: ``tensors[i].copy_(flat[offsets[i]:offsets[i] + numel]
    .view_as(tensors[i]))`` for every i, converting dtype."""
    _ops.unpack(flat, list(offsets), list(tensors))


def quantize_blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of a flat tensor by blocks of ``block`` consecutive elements.

    x: 1-D, contiguous, fp32/fp16/bf16, its length a multiple of ``block`` (>= 1). Returns
    ``(q, scales)``: q int8 like x, scales fp32 with one element per block, ``scales[b] = absmax of
    block b / 127`` (in fp32), ``q = x / scales[b]`` rounded half to even, clamped to [-127, 127],
    and 0 where the scale is 0 (an all-zero block). Raises if x holds an inf or nan (on CUDA this
    synchronises with the host once). Exactly ``zerocore.reference.quantize_blockwise``.
    """
    q, scales = _ops.quantize_blockwise(x, block)
    return q, scales


def dequantize_blockwise_(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                          block: int) -> torch.Tensor:
    """``out[i] = q[i] * scales[i // block]``, the product in fp32 rounded once to out's dtype
    (fp32/fp16/bf16, round to nearest even). out: contiguous, as many elements as q; typically a
    slice of a flat buffer at any offset. Returns out. Exactly
    ``zerocore.reference.dequantize_blockwise``."""
    _ops.dequantize_blockwise_(out, q, scales, block)
    return out


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, block: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_blockwise_`` into a new 1-D tensor of ``dtype``."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _ops.dequantize_blockwise_(out, q, scales, block)
    return out


def dequantize_nf4_(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    block: int = NF4_BLOCK) -> torch.Tensor:
    """NF4 codes (``formats.quantize_nf4``'s ``packed``, uint8, two per byte, low nibble first)
    into ``out`` (contiguous fp32/fp16/bf16 of any number n of elements, at any offset of a larger
    buffer): ``out[i] = NF4_CODE[code i] * scales[i // block]``, the product in fp32 rounded once
    to out's dtype (nearest even). Returns out. Exactly ``zerocore.reference.dequantize_nf4``."""
    _ops.dequantize_nf4_(out, packed, scales, block)
    return out


def dequantize_nf4(packed: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype,
                   block: int = NF4_BLOCK) -> torch.Tensor:
    """``dequantize_nf4_`` into a new 1-D tensor of n elements of ``dtype``."""
    out = torch.empty(n, dtype=dtype, device=packed.device)
    return dequantize_nf4_(out, packed, scales, block)


def dequantize_fp8_(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    block: int = FP8_BLOCK) -> torch.Tensor:
    """fp8 e4m3fn codes (``formats.quantize_fp8``'s, their bits as uint8, one per element) into
    ``out`` (as ``dequantize_nf4_``): ``out[i] = e4m3fn value of codes[i] * scales[i // block]``.
    Returns out. Exactly ``zerocore.reference.dequantize_fp8`` (the NaN codes, never produced by
    the quantizer, give NaN)."""
    _ops.dequantize_fp8_(out, codes, scales, block)
    return out


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   block: int = FP8_BLOCK) -> torch.Tensor:
    """``dequantize_fp8_`` into a new 1-D tensor of ``dtype``, one element per code."""
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    return dequantize_fp8_(out, codes, scales, block)


def _cpu_lowbit_isa(isa: str | None = None) -> str:
    """Which CPU kernels ``dequantize_nf4_`` and ``dequantize_fp8_`` run on, as
    ``_cpu_adam_isa`` for Adam: "scalar", "avx2" or "avx512". With ``isa``, switches this process
    to those. Every choice computes the same bits. Returns the name now in use."""
    return _ops._cpu_lowbit_isa(isa)


def _cpu_lowbit_isas() -> list[str]:
    """The CPU kernel sets ``_cpu_lowbit_isa`` accepts on this CPU and build, narrowest first."""
    return list(_ops._cpu_lowbit_isas())


# Fake implementations: shapes and dtypes only, for torch.compile and FakeTensor tracing. Every op
# but quantize_blockwise returns nothing and mutates its (a!) arguments, so there is nothing to
# compute here.
@torch.library.register_fake("zerocore::fused_adam")
def _fused_adam_fake(param, grad, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps,
                     weight_decay, step, inv_grad_scale, adamw) -> None:
    return None


@torch.library.register_fake("zerocore::fused_adam_multi")
def _fused_adam_multi_fake(params, grads, exp_avgs, exp_avg_sqs, model_copies, lrs,
                           weight_decays, beta1, beta2, eps, step, inv_grad_scale, adamw) -> None:
    return None


@torch.library.register_fake("zerocore::grad_stats")
def _grad_stats_fake(grad, stats) -> None:
    return None


@torch.library.register_fake("zerocore::pack")
def _pack_fake(tensors, offsets, flat) -> None:
    return None


@torch.library.register_fake("zerocore::unpack")
def _unpack_fake(flat, offsets, tensors) -> None:
    return None


@torch.library.register_fake("zerocore::quantize_blockwise")
def _quantize_blockwise_fake(x, block):
    # The shape checks of csrc/checks.cpp that decide the outputs' shapes; the kernel repeats
    # them all with their full messages.
    torch._check(block >= 1,
                 lambda: f"zerocore.quantize_blockwise: block must be >= 1, got {block}")
    torch._check(x.dim() == 1, lambda: "zerocore.quantize_blockwise: x must be a contiguous 1-D "
                                       f"tensor, got shape {tuple(x.shape)}")
    n = x.shape[0]
    torch._check(n % block == 0, lambda: f"zerocore.quantize_blockwise: x has {n} elements, not "
                                         f"a multiple of block = {block}")
    return (x.new_empty((n,), dtype=torch.int8),
            x.new_empty((n // block,), dtype=torch.float32))


@torch.library.register_fake("zerocore::dequantize_blockwise_")
def _dequantize_blockwise_fake(out, q, scales, block) -> None:
    return None


@torch.library.register_fake("zerocore::dequantize_nf4_")
def _dequantize_nf4_fake(out, packed, scales, block) -> None:
    return None


@torch.library.register_fake("zerocore::dequantize_fp8_")
def _dequantize_fp8_fake(out, codes, scales, block) -> None:
    return None
