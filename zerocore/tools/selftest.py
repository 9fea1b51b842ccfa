"""``python -m zerocore.selftest``: checks a zerocore installation on the devices this machine has,
in under two minutes, and says in one table what works.

On the CPU always, and on the current CUDA device when one is visible:

- **ops**: every kernel against its plain-PyTorch definition (``zerocore.reference``) at odd sizes
  and every dtype combination, misaligned views included; on CUDA also against the CPU kernels,
  bit for bit, at a size that makes every grid-stride loop go round several times;
- **engine**: ``zerocore.shard`` at world size 1 (gloo on the CPU, NCCL on a GPU) trained against
  the unsharded model with ``torch.optim.AdamW``, on a model whose flat groups end in padding and
  on one whose groups end in real values (so that a reduction that leaves the end of its output
  unwritten shows), and CPU offload against no offload;
- **bandwidth**: ``tensor.copy_`` of a large buffer, and the fused Adam step's bandwidth as a
  fraction of it (a measurement: it never fails the run).

Exit status: 0 when every check passed, 1 when one failed, 2 on a usage error. ``--quick`` runs
smaller sizes and fewer steps; ``--list`` prints the plan without running it.

The engine checks need a process group of their own. They run in this process, with a world of
one created on a private in-memory ``HashStore`` and destroyed afterwards: no second interpreter
to start (importing torch costs seconds on a small machine), no port or file to collide with
other runs, and a failure comes back as an exception with its traceback, into the table like any
other. The price: they cannot run inside a program that already initialised torch.distributed,
and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import math
import statistics
import sys
import time
import traceback
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore.kernels import formats, ops, reference
from zerocore.kernels._extension import BuildInfo

F32_EPS = torch.finfo(torch.float32).eps  # 2^-23, one ulp of 1.0 in float32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", None: "none"}
# Integer dtypes of the same width, to compare floats bit for bit (NaN-free, -0.0 kept apart).
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ------------------------------------------------------------------------------------------------
# What a check reports, and how much work the checks do


@dataclasses.dataclass(frozen=True)
class Result:
    """One row of the table."""

    check: str
    device: str
    status: str                # "PASS", "FAIL", or "INFO" (a measurement, never a failure)
    error: float | None        # the largest error found (or, for INFO, the measured value)
    tolerance: float | None    # what error may be; None for INFO rows and crashed checks
    unit: str                  # of error and tolerance
    seconds: float
    detail: str = ""           # the worst case, or what went wrong

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def _judged(check: str, device: str, error: float, tolerance: float, unit: str, seconds: float,
            detail: str = "") -> Result:
    ok = error <= tolerance  # NaN compares False: a NaN error fails
    return Result(check, device, "PASS" if ok else "FAIL", error, tolerance, unit, seconds, detail)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much work the checks do. ``full()`` is the default run; ``quick()`` is ``--quick``."""

    op_sizes: tuple[int, ...]    # element counts of the op checks
    large: dict[str, int]        # per device type: a size past one full grid of the GPU kernels
    adam_steps: int              # consecutive fused Adam steps per case
    train_steps: int             # optimizer steps of the engine checks
    copy_mib: dict[str, int]     # per device type: MiB read (and as many written) by the copy
    adam_numel: dict[str, int]   # per device type: parameters of the timed Adam step
    rounds: dict[str, int]       # per device type: timed repetitions (the median is reported)

    @staticmethod
    def full() -> Sizes:
        # 1: no vector work at all; 17: one vector block and a tail; 4099 and 278011: several CPU
        # blocks (32768 elements each at 278011) ending in a tail shorter than one vector.
        # large: on a GPU every kernel grid-strides several times only past #SMs x 2048 threads
        # x 8 elements (2.2M on an H200; 2.4M on a 148-SM B200), so 5M; pack's blocks take 8192
        # elements each, a whole grid of them up to ~8.7M there, so its large tensor is twice
        # this size (see _pack_tensors).
        return Sizes(op_sizes=(1, 17, 4099, 278011), large={"cpu": 1_000_003, "cuda": 5_000_011},
                     adam_steps=3, train_steps=8, copy_mib={"cpu": 256, "cuda": 1024},
                     adam_numel={"cpu": 1 << 23, "cuda": 1 << 26},
                     rounds={"cpu": 5, "cuda": 20})

    @staticmethod
    def quick() -> Sizes:
        # The bandwidth buffers stay several times larger than a server CPU's L3 cache (32 MiB
        # here) and a GPU's L2 (60 MiB on an H200), or they would measure the cache.
        return Sizes(op_sizes=(1, 17, 4099), large={"cpu": 278011, "cuda": 5_000_011},
                     adam_steps=2, train_steps=4, copy_mib={"cpu": 128, "cuda": 256},
                     adam_numel={"cpu": 1 << 22, "cuda": 1 << 24},
                     rounds={"cpu": 3, "cuda": 10})

    def sizes_for(self, device: torch.device) -> tuple[int, ...]:
        return self.op_sizes + (self.large[device.type],)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The ops under test. The default is zerocore's compiled kernels; tests pass a wrong one to
    see that the selftest catches it."""

    fused_adam: Callable[..., None] = ops.fused_adam
    fused_adam_multi: Callable[..., None] = ops.fused_adam_multi
    grad_stats: Callable[..., torch.Tensor] = ops.grad_stats
    pack: Callable[..., torch.Tensor] = ops.pack
    unpack: Callable[..., None] = ops.unpack
    quantize_blockwise: Callable[..., tuple[torch.Tensor, torch.Tensor]] = ops.quantize_blockwise
    dequantize_blockwise_: Callable[..., torch.Tensor] = ops.dequantize_blockwise_
    dequantize_nf4_: Callable[..., torch.Tensor] = ops.dequantize_nf4_
    dequantize_fp8_: Callable[..., torch.Tensor] = ops.dequantize_fp8_


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """Seeded on the CPU, so both devices see the same values."""
    return torch.randn(n, generator=_gen(seed)).to(device)


def _placed(values: torch.Tensor, offset: int) -> torch.Tensor:
    """``values`` copied into a buffer at element ``offset`` (offset > 0: a view whose data is
    not 16-byte aligned, which sends the kernels down their scalar paths)."""
    buf = torch.empty(offset + values.numel(), dtype=values.dtype, device=values.device)
    view = buf[offset:]
    view.copy_(values)
    return view


def _bit_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ; both contiguous, same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(a.numel(), b.numel(), 1)
    return int((a.reshape(-1).view(BITS[a.dtype]) != b.reshape(-1).view(BITS[b.dtype])).sum())


# ------------------------------------------------------------------------------------------------
# ops against zerocore.reference


ADAM_HYPER = dict(lr=3e-3, beta1=0.85, beta2=0.98, eps=1e-6)
# Tolerances of fused Adam against the reference, in float32 ulps of a per-element scale (those
# of tests/kernels/test_ops.py, measured there over 5 steps; these runs take fewer). The reference
# computes the same formula with torch's float32 ops, which round differently only where they
# fuse multiply-adds (lerp, addcmul, addcdiv) or, on the CPU, where torch.sqrt is one ulp off:
# about one ulp of each operation's largest term, carried over the steps. A wrong formula or
# constant is off by far more (eps off by 1% fails with these gradients, some near eps).
ADAM_ULPS = {
    "param": 5.0,       # of |param| + the largest step (lr / (1 - beta1)): near 0 the update's
                        # own rounding dominates
    "exp_avg": 3.0,     # of the largest decayed |grad| the element has seen: the lerp's terms
    "exp_avg_sq": 8.0,  # of |exp_avg_sq|: a sum of non-negative terms, no cancellation
}


def _adam_cases(sizes: Sequence[int]) -> Iterator[tuple[int, torch.dtype, torch.dtype | None,
                                                       bool, float, int]]:
    """(n, grad dtype, model-copy dtype, adamw, loss scale, misalignment). Every dtype pair and
    both Adam variants at the small sizes; at the largest, one case per gradient dtype (each
    pass over millions of elements costs a CPU real time)."""
    k = 0
    for n in sizes:
        pairs = [(g, c) for g in FLOAT_DTYPES for c in (None,) + FLOAT_DTYPES]
        if n == max(sizes) and len(sizes) > 1:
            pairs = [(g, FLOAT_DTYPES[(i + 1) % 3]) for i, g in enumerate(FLOAT_DTYPES)]
        for grad_dtype, copy_dtype in pairs:
            for adamw in (True, False):
                yield n, grad_dtype, copy_dtype, adamw, (1.0, 1024.0)[k % 2], (0, 3)[k // 2 % 2]
                k += 1


def _adam_inputs(n: int, seed: int, device: torch.device, misalign: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _placed(_randn(n, seed, device), misalign)
    m = _placed(torch.zeros(n, device=device), 2 * misalign)
    v = _placed(torch.zeros(n, device=device), 3 * misalign)
    return p, m, v


def _adam_grad(n: int, seed: int, step: int, device: torch.device, p: torch.Tensor,
               adamw: bool) -> torch.Tensor:
    """Gradients whose magnitudes vary per element from 1e-4 to 10 (log-uniform), like a real
    model's; with Adam's L2 term the sign follows the parameter's, so grad + wd·param never
    cancels (where it nearly does, any two float32 implementations disagree by far more than a
    few ulps: the update becomes a ratio of rounding noise)."""
    magnitude = 10.0 ** (torch.rand(n, generator=_gen(seed + 99)) * 5 - 4)
    g = (torch.randn(n, generator=_gen(seed + step)) * magnitude).to(device)
    if not adamw:
        g = g.abs() * torch.where(p < 0, -1.0, 1.0)
    return g


def check_fused_adam(device: torch.device, sizes: Sequence[int], *,
                     kernel: Callable[..., None] = ops.fused_adam, steps: int = 3) -> Result:
    """``kernel`` against ``reference.fused_adam``, ``steps`` consecutive steps per case; the
    model copy must be exactly the new master weights rounded to its dtype."""
    t0 = time.perf_counter()
    # The case with the largest error over its tolerance: (ratio, error, tolerance, where).
    worst = (0.0, 0.0, ADAM_ULPS["param"], "")
    copy_wrong = ""  # the first case whose model copy is not exactly the rounded master
    for case, (n, grad_dtype, copy_dtype, adamw, scale, misalign) in enumerate(_adam_cases(sizes)):
        where = (f"n={n} grad {DTYPE_NAMES[grad_dtype]} copy {DTYPE_NAMES[copy_dtype]} "
                 f"{'adamw' if adamw else 'adam-l2'} x{scale:g}"
                 f"{' misaligned' if misalign else ''}")
        p, m, v = _adam_inputs(n, 1000 + case, device, misalign)
        copy_out = None if copy_dtype is None else torch.zeros(n, dtype=copy_dtype, device=device)
        ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
        g_max = torch.zeros(n, device=device)
        for step in range(1, steps + 1):
            g_vals = _adam_grad(n, 1000 + case, step, device, p, adamw)
            g = _placed((g_vals * scale).to(grad_dtype), misalign)
            decayed = g.float().abs() / scale + (0.0 if adamw else 0.1) * p.abs()
            g_max = torch.maximum(g_max, decayed)
            kw = dict(ADAM_HYPER, weight_decay=0.1, step=step, inv_grad_scale=1.0 / scale,
                      adamw=adamw)
            kernel(p, g, m, v, copy_out, **kw)
            reference.fused_adam(ref_p, g, ref_m, ref_v, None, **kw)
        largest_step = ADAM_HYPER["lr"] / (1.0 - ADAM_HYPER["beta1"])
        for name, got, want, scale_of in (("param", p, ref_p, ref_p.abs() + largest_step),
                                          ("exp_avg", m, ref_m, g_max),
                                          ("exp_avg_sq", v, ref_v, ref_v.abs())):
            ulps = ((got.double() - want.double()).abs() / (F32_EPS * scale_of.double()))
            err = ulps.nan_to_num(nan=math.inf).max().item() if n else 0.0
            tol = ADAM_ULPS[name]
            if not err / tol <= worst[0]:  # NaN too
                worst = (err / tol, err, tol, f"{name}, {where}")
        if (copy_out is not None and not copy_wrong
                and _bit_mismatches(copy_out, p.to(copy_dtype))):
            copy_wrong = where
    _sync(device)
    seconds = time.perf_counter() - t0
    if copy_wrong:
        # Exactly one rounding of the new fp32 master weights: any difference is a bug.
        return _judged("fused_adam vs reference", device.type, math.inf, 0, "ulp", seconds,
                       f"model copy is not the master rounded to its dtype, {copy_wrong}")
    _, err, tol, where = worst
    return _judged("fused_adam vs reference", device.type, err, tol, "ulp", seconds, where)


def check_fused_adam_multi(device: torch.device, sizes: Sequence[int], *,
                           kernel: Callable[..., None] = ops.fused_adam_multi) -> Result:
    """``kernel`` (one launch over many shards, what the optimizer runs every step) against
    ``ops.fused_adam`` on each shard alone, bit for bit: a shard of every size, each with its own
    lr and weight decay, every other one misaligned, a bf16 model copy, two steps."""
    t0 = time.perf_counter()
    lrs = [ADAM_HYPER["lr"] * (1 + i % 3) for i in range(len(sizes))]
    wds = [0.1 * (i % 2) for i in range(len(sizes))]
    runs = []  # [shards of the launch, shards stepped one by one]
    for alone in (False, True):
        shards = [(*_adam_inputs(n, 7000 + i, device, i % 2),
                   torch.zeros(n, dtype=torch.bfloat16, device=device))
                  for i, n in enumerate(sizes)]
        for step in (1, 2):
            grads = [_adam_grad(n, 7000 + i, step, device, shards[i][0], adamw=True)
                     for i, n in enumerate(sizes)]
            kw = dict(beta1=ADAM_HYPER["beta1"], beta2=ADAM_HYPER["beta2"],
                      eps=ADAM_HYPER["eps"], step=step, inv_grad_scale=0.5, adamw=True)
            if alone:
                for (p, m, v, copy), g, lr, wd in zip(shards, grads, lrs, wds):
                    ops.fused_adam(p, g, m, v, copy, lr=lr, weight_decay=wd, **kw)
            else:
                params, exp_avgs, exp_avg_sqs, copies = (list(a) for a in zip(*shards))
                kernel(params, grads, exp_avgs, exp_avg_sqs, copies, lrs=lrs,
                       weight_decays=wds, **kw)
        runs.append(shards)
    worst, where = 0, ""
    for n, got, want in zip(sizes, *runs):
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "model copy"), got, want):
            bad = _bit_mismatches(a.contiguous(), b.contiguous())
            if bad > worst:
                worst, where = bad, f"{name}, shard of {n}"
    _sync(device)
    return _judged("fused_adam_multi = fused_adam per shard", device.type, worst, 0,
                   "elements differ", time.perf_counter() - t0, where)


# Relative error of grad_stats' sum of squares against float64. The CPU kernel sums float32
# squares within each vector lane over a 32768-element block (2048 additions per lane) before
# adding blocks in float64: at most 2048 float32 roundings of a sum of non-negative terms,
# 2048·2^-24 ≈ 1.2e-4. The CUDA kernel sums in float64 throughout, far inside this.
GRAD_STATS_RTOL = 2048 * 2.0**-24


def check_grad_stats(device: torch.device, sizes: Sequence[int], *,
                     kernel: Callable[..., torch.Tensor] = ops.grad_stats) -> Result:
    """The sum of squares within GRAD_STATS_RTOL of float64's; the inf/nan flag set exactly when
    an element is inf or nan (one placed at a random position, the last one among them)."""
    t0 = time.perf_counter()
    worst, where = 0.0, ""
    for n in sizes:
        for i, dtype in enumerate(FLOAT_DTYPES):
            label = f"n={n} {DTYPE_NAMES[dtype]}"
            g = _placed((_randn(n, 2000 + n + i, device) * 3).to(dtype), i)
            stats = kernel(g, torch.zeros(2, device=device))
            want = g.double().square().sum().item()
            err = abs(stats[0].item() - want) / want if want else abs(stats[0].item())
            if stats[1].item() != 0.0:
                err, label = math.inf, f"finite values flagged non-finite, {label}"
            if err > worst or math.isnan(err):
                worst, where = err, label
            bad = g.clone()
            position = int(torch.randint(n, (1,), generator=_gen(n + i)))
            for at, value in ((position, math.nan), (n - 1, -math.inf)):
                bad[at] = value
                if kernel(bad, torch.zeros(2, device=device))[1].item() != 1.0:
                    worst, where = math.inf, f"{value} at {at} not flagged, {label}"
    _sync(device)
    return _judged("grad_stats vs reference", device.type, worst, GRAD_STATS_RTOL, "rel",
                   time.perf_counter() - t0, where)


def _values(n: int, seed: int) -> torch.Tensor:
    """Random values with the awkward ones every conversion must get right (no NaN, so results
    compare bit for bit): infinities, -0.0, a float32 subnormal, values that overflow fp16 and
    exact ties of bf16 and fp16 rounding, which go to even."""
    x = torch.randn(n, generator=_gen(seed)) * 10
    specials = torch.tensor([math.inf, -math.inf, -0.0, 1e-40, 7e4, 1 + 2**-8, 1 + 2**-11])
    x[:min(n, len(specials))] = specials[:n]
    return x[torch.randperm(n, generator=_gen(seed + 1))]


def _pack_tensors(largest: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """Tensors of mixed dtypes and layouts: contiguous, transposed, every other column, starting
    3 elements into their storage, a scalar, an empty one, and one long contiguous tensor."""
    def vals(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return _values(math.prod(shape), seed + len(shape) + sum(shape)).to(dtype).to(
            device).view(shape)

    long_n = 2 * largest if device.type == "cuda" else largest
    return [vals(7, 13, dtype=torch.float32),
            vals(9, 5, dtype=torch.float16).t(),
            vals(6, 23, dtype=torch.bfloat16)[:, ::2],
            vals(40, dtype=torch.float32)[3:].view(37),
            vals(1, dtype=torch.float16).view(()),
            vals(3, 0, dtype=torch.float32),
            vals(long_n, dtype=FLOAT_DTYPES[seed % 3])]


def _offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor after the last with a gap of 0 to 6 elements (padding pack must zero), the
    list in reverse order of the flat buffer; and the buffer's length with a tail gap of 5."""
    offsets, cursor = [], 0
    for i, t in enumerate(reversed(tensors)):
        offsets.append(cursor)
        cursor += t.numel() + (i * 5) % 7
    return offsets[::-1], cursor + 5


def check_pack(device: torch.device, sizes: Sequence[int], *,
               kernel: Callable[..., torch.Tensor] = ops.pack) -> Result:
    """``kernel`` against ``reference.pack`` into a flat buffer of each dtype, bit for bit: a
    copy or a conversion (round to nearest even) has exactly one right answer."""
    t0 = time.perf_counter()
    worst, where = 0, ""
    for i, flat_dtype in enumerate(FLOAT_DTYPES):
        tensors = _pack_tensors(max(sizes), device, seed=3000 + i)
        offsets, total = _offsets(tensors)
        got = torch.full((total,), math.nan, dtype=flat_dtype, device=device)
        want = torch.empty_like(got)
        kernel(tensors, offsets, got)
        reference.pack(tensors, offsets, want)
        bad = _bit_mismatches(got, want)
        if bad > worst:
            worst, where = bad, f"into {DTYPE_NAMES[flat_dtype]}, {total} elements"
    _sync(device)
    return _judged("pack vs reference", device.type, worst, 0, "elements differ",
                   time.perf_counter() - t0, where)


def check_unpack(device: torch.device, sizes: Sequence[int], *,
                 kernel: Callable[..., None] = ops.unpack) -> Result:
    """``kernel`` against ``reference.unpack`` from a flat buffer of each dtype into tensors of
    check_pack's shapes, dtypes and layouts (transposed ones stay transposed), bit for bit."""
    t0 = time.perf_counter()
    worst, where = 0, ""
    for i, flat_dtype in enumerate(FLOAT_DTYPES):
        shapes = _pack_tensors(max(sizes), device, seed=4000 + i)
        offsets, total = _offsets(shapes)
        flat = _values(total, 4100 + i).to(flat_dtype).to(device)
        got = [torch.full_like(t, -1.0) for t in shapes]
        want = [torch.full_like(t, -1.0) for t in shapes]
        kernel(flat, offsets, got)
        reference.unpack(flat, offsets, want)
        for k, (a, b) in enumerate(zip(got, want)):
            bad = _bit_mismatches(a.contiguous(), b.contiguous())
            if bad > worst:
                worst, where = bad, f"tensor {k} from {DTYPE_NAMES[flat_dtype]}"
    _sync(device)
    return _judged("unpack vs reference", device.type, worst, 0, "elements differ",
                   time.perf_counter() - t0, where)


INT8_BLOCK = 128  # FrozenWeights' default


def check_int8(device: torch.device, sizes: Sequence[int], *,
               quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = ops.quantize_blockwise,
               dequantize: Callable[..., torch.Tensor] = ops.dequantize_blockwise_) -> Result:
    """``quantize`` and ``dequantize`` (int8 frozen weights) against ``reference``, bit for bit:
    values over seven orders of magnitude and an all-zero block, rounded up to whole blocks,
    quantized from each float dtype, dequantized into each at an odd offset of a larger buffer
    (the rest of which must stay untouched)."""
    t0 = time.perf_counter()
    worst, where = 0, ""
    for i, dtype in enumerate(FLOAT_DTYPES):
        for n in sizes:
            n = -(-n // INT8_BLOCK) * INT8_BLOCK
            # finite (a weight with inf or nan cannot be quantized: the op refuses it)
            x = (torch.randn(n, generator=_gen(5000 + i)) * 10.0 ** torch.randint(
                -4, 3, (n,), generator=_gen(5100 + i))).to(dtype)
            x[INT8_BLOCK:2 * INT8_BLOCK] = 0  # an all-zero block (scale 0)
            x = x.to(device)
            q, scales = quantize(x, INT8_BLOCK)
            want_q, want_scales = reference.quantize_blockwise(x, INT8_BLOCK)
            bad = int((q != want_q).sum()) + _bit_mismatches(scales, want_scales)
            got = torch.full((n + 6,), math.nan, dtype=dtype, device=device)
            dequantize(got[3:3 + n], want_q, want_scales, INT8_BLOCK)
            want = reference.dequantize_blockwise(want_q, want_scales, INT8_BLOCK, dtype)
            bad += _bit_mismatches(got[3:3 + n], want)
            bad += int((~torch.isnan(got[:3])).sum() + (~torch.isnan(got[3 + n:])).sum())
            if bad > worst:
                worst, where = bad, f"{DTYPE_NAMES[dtype]}, {n} elements"
    _sync(device)
    return _judged("int8 quantize/dequantize vs reference", device.type, worst, 0,
                   "elements differ", time.perf_counter() - t0, where)


def check_lowbit(device: torch.device, sizes: Sequence[int], *,
                 dequantize_nf4: Callable[..., torch.Tensor] = ops.dequantize_nf4_,
                 dequantize_fp8: Callable[..., torch.Tensor] = ops.dequantize_fp8_) -> Result:
    """The NF4 and fp8 dequantizations (zerocore.kernels.formats, quantized at their own block
    sizes) against ``reference``, bit for bit: values over seven orders of magnitude, an
    all-zero block, lengths as they come (not whole blocks), into each float dtype at an odd
    offset of a larger buffer (the rest of which must stay untouched)."""
    t0 = time.perf_counter()
    worst, where = 0, ""
    for fmt, block, dequantize in (("nf4", formats.NF4_BLOCK, dequantize_nf4),
                                   ("fp8", formats.FP8_BLOCK, dequantize_fp8)):
        for i, dtype in enumerate(FLOAT_DTYPES):
            for n in sizes:
                x = (torch.randn(n, generator=_gen(5200 + i)) * 10.0 ** torch.randint(
                    -4, 3, (n,), generator=_gen(5300 + i))).to(dtype)
                x[block:2 * block] = 0  # an all-zero block (scale 0), where n reaches it
                x = x.to(device)
                quantize = ops.quantize_nf4 if fmt == "nf4" else ops.quantize_fp8
                q, scales = quantize(x, block)
                got = torch.full((n + 6,), math.nan, dtype=dtype, device=device)
                dequantize(got[3:3 + n], q, scales, block)
                want = (reference.dequantize_nf4(q, scales, n, block, dtype) if fmt == "nf4"
                        else reference.dequantize_fp8(q, scales, block, dtype))
                bad = _bit_mismatches(got[3:3 + n], want)
                bad += int((~torch.isnan(got[:3])).sum() + (~torch.isnan(got[3 + n:])).sum())
                if bad > worst:
                    worst, where = bad, f"{fmt} -> {DTYPE_NAMES[dtype]}, {n} elements"
    _sync(device)
    return _judged("nf4/fp8 dequantize vs reference", device.type, worst, 0, "elements differ",
                   time.perf_counter() - t0, where)


def check_cuda_matches_cpu(device: torch.device, sizes: Sequence[int], *,
                           kernels: Kernels = Kernels()) -> Result:
    """The CUDA kernels against the CPU kernels on the same inputs, bit for bit: both use IEEE
    round-to-nearest operations in the same order with no fused multiply-adds (csrc/cuda/
    fused_adam_cuda.cu), so the results must be identical, whatever the grid. grad_stats sums in
    another order on each device, so it gets values whose every partial sum is exact."""
    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    worst, where = 0, ""
    for case, n in enumerate(sizes):
        grad_dtype, copy_dtype = FLOAT_DTYPES[case % 3], FLOAT_DTYPES[(case + 1) % 3]
        runs = []  # the CPU's tensors, then the device's
        for dev in (cpu, device):
            p, m, v = _adam_inputs(n, 5000 + case, dev, 0)
            copy_out = torch.zeros(n, dtype=copy_dtype, device=dev)
            for step in (1, 2):
                g = _adam_grad(n, 5000 + case, step, dev, p, adamw=case % 2 == 0).to(grad_dtype)
                kernels.fused_adam(p, g, m, v, copy_out, **ADAM_HYPER, weight_decay=0.1,
                                   step=step, inv_grad_scale=0.5, adamw=case % 2 == 0)
            runs.append([t.cpu() for t in (p, m, v, copy_out)])
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "model copy"), *runs):
            bad = _bit_mismatches(a, b)
            if bad > worst:
                worst, where = bad, f"fused_adam {name}, n={n}"

        # Multiples of 1/2 up to 2 in magnitude: squares are multiples of 1/4, every partial sum
        # below 2^22 is exact in float32, so any order of summation gives the same sum.
        k = torch.randint(-4, 5, (n,), generator=_gen(6000 + case)).float() / 2
        stats = [kernels.grad_stats(k.to(grad_dtype).to(dev), torch.zeros(2, device=dev)).cpu()
                 for dev in (cpu, device)]
        bad = _bit_mismatches(stats[0], stats[1])
        if bad > worst:
            worst, where = bad, f"grad_stats, n={n}: {stats[0].tolist()} vs {stats[1].tolist()}"
    _sync(device)
    return _judged("cuda kernels = cpu kernels", device.type, worst, 0, "elements differ",
                   time.perf_counter() - t0, where)


# ------------------------------------------------------------------------------------------------
# The engine at world size 1


ENGINE_LR = 1e-2
ENGINE_WEIGHT_DECAY = 0.1  # large enough that a step missing the decoupled decay shows
# Losses, sharded against unsharded, relative. The same float32 operations in another order (the
# fused Adam kernel rounds where torch fuses multiply-adds; gathered weights sit at other
# alignments, which can change a matmul's blocking): a few ulps, measured <= 4.3e-7 in
# tests/engine/test_shard.py. A real bug (a gradient lost, a layer skipped) moves the loss far
# more.
ENGINE_LOSS_RTOL = 1e-5
# Parameters, in units of lr: an Adam update is ~lr whatever the gradient's size, so rounding
# noise in a nearly cancelling gradient becomes a visible fraction of lr (measured worst case
# 3e-4·lr over 12 steps in tests/engine/test_shard.py). 2e-3·lr still fails on a missing weight
# decay (lr·wd·|p| = 1e-3·|p| per step), a skipped update (~lr) or a wrong learning rate.
ENGINE_PARAM_TOL_LR = 2e-3
BATCH = 24  # rows of a step's batch: whole for 1, 2, 3, 4, 6 and 8 ranks


@dataclasses.dataclass(frozen=True)
class MlpShape:
    """Widths of the selftest's MLP stack (in, hidden, out)."""

    d_in: int
    hidden: int
    d_out: int


# Odd sizes: every flat group is padded at its end (9-11 elements at world size 1).
PADDED = MlpShape(13, 37, 7)
# Every parameter a multiple of 16 elements (flat_layout.ALIGN) and every layer's total a
# multiple of 16 x 6: no gap, no padding at world sizes 1, 2, 3 and 6, so each group ends with
# its last bias and a reduction's last elements are real gradients.
UNPADDED = MlpShape(32, 96, 96)


def mlp(shape: MlpShape = PADDED) -> list[nn.Module]:
    """The same small MLP stack every call, without disturbing the caller's random state."""
    d_in, hidden, d_out = shape.d_in, shape.hidden, shape.d_out
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(d_in, hidden), nn.GELU()),
                nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()),
                nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, d_out))]


def batch(step: int, device: torch.device, shape: MlpShape = PADDED
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and learnable targets (a fixed random teacher), the same for every run: the
    whole step's ``BATCH`` rows (ranks take their slice)."""
    x = torch.randn(BATCH, shape.d_in, generator=_gen(100 + step))
    w = torch.randn(shape.d_in, shape.d_out, generator=_gen(7)) / math.sqrt(shape.d_in)
    return x.to(device), torch.tanh(x @ w).to(device)


def padded_groups(model: zerocore.ShardedSequential) -> list[str]:
    """The flat groups of ``model`` that end in padding (or have gaps), by layer index."""
    return [f"layer {i}" for i, layer in enumerate(model.layers) for g in layer.groups
            if g.layout.padded_numel != g.layout.numel]


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[dist.ProcessGroup]:
    """A process group of this process alone (gloo for the CPU, NCCL for a GPU), on a private
    in-memory store; destroyed on exit."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process, and the "
                           "engine checks need a process group of their own: run "
                           "`python -m zerocore.selftest` as a program of its own")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield dist.group.WORLD
    finally:
        # Whatever still holds the group (a model from a failed check) goes first: destroying a
        # group that objects still use can abort the process at exit.
        gc.collect()
        dist.destroy_process_group()


def _train(device: torch.device, steps: int, *, offload: bool, param_dtype: torch.dtype,
           group: dist.ProcessGroup, with_reference: bool, shape: MlpShape = PADDED) -> dict:
    """Trains the sharded MLP (and, with_reference, an unsharded copy with torch.optim.AdamW in
    lockstep). Returns the losses, the final parameters by name, on the CPU, and the groups
    that end in padding."""
    layers = mlp(shape)
    ref = nn.Sequential(*copy.deepcopy(layers)).to(device) if with_reference else None
    model = zerocore.shard(layers, group=group, device=device,
                           mixed_precision=zerocore.MixedPrecision(param_dtype),
                           offload=zerocore.Offload(optimizer=offload))
    opt = zerocore.optim.AdamW(model.parameters(), lr=ENGINE_LR, weight_decay=ENGINE_WEIGHT_DECAY)
    if ref is not None:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=ENGINE_LR,
                                    weight_decay=ENGINE_WEIGHT_DECAY)
    out: dict = {"losses": [], "ref_losses": [], "padded": padded_groups(model)}
    for step in range(steps):
        x, y = batch(step, device, shape)
        loss = (model(x.to(param_dtype)).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        if ref is not None:
            ref_loss = (ref(x) - y).pow(2).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            out["ref_losses"].append(ref_loss.item())
    report = model.memory_report()
    out["arena"] = (report.host_arena_bytes, report.pinned_bytes)
    out["params"] = {f"{i}.{name}": t.float().cpu() for i, state in model.iter_full_states()
                     for name, t in state.items()}
    if ref is not None:
        out["ref_params"] = {n: p.detach().cpu() for n, p in ref.named_parameters()}
    return out


def _params_row(check: str, device: torch.device, run: dict, seconds: float,
                detail: str = "") -> Result:
    """The parameters of a run against its reference's, in units of lr."""
    if set(run["params"]) != set(run["ref_params"]):
        return Result(check, device.type, "FAIL", None, None, "", seconds,
                      f"names differ: {sorted(run['params'])} vs {sorted(run['ref_params'])}")
    err, name = max(((run["params"][n] - w).abs().max().item() / ENGINE_LR, n)
                    for n, w in run["ref_params"].items())
    return _judged(check, device.type, err, ENGINE_PARAM_TOL_LR, "x lr", seconds,
                   f"worst: {name}" + (f"; {detail}" if detail else ""))


def check_engine(device: torch.device, steps: int) -> list[Result]:
    """Four rows: the losses and the parameters of zerocore.shard + zerocore.optim.AdamW
    against the unsharded model with torch.optim.AdamW (fp32); the parameters again for a model
    whose groups end without padding (the last elements a reduction writes are real gradients);
    and bf16 training with CPU offload against the same without (bit for bit: offload moves the
    optimizer's work to the CPU kernel, which computes exactly what the device's kernel
    does)."""
    rows = []
    with world_of_one(device) as group:
        t0 = time.perf_counter()
        run = _train(device, steps, offload=False, param_dtype=torch.float32, group=group,
                     with_reference=True)
        seconds = time.perf_counter() - t0
        losses, ref_losses = torch.tensor(run["losses"]), torch.tensor(run["ref_losses"])
        rel = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
        first, last = ref_losses[0].item(), ref_losses[-1].item()
        rows.append(_judged("engine ws1 losses vs torch AdamW", device.type, rel,
                            ENGINE_LOSS_RTOL, "rel", seconds,
                            f"{steps} steps, loss {first:.4f} -> {last:.4f}"))
        rows.append(_params_row("engine ws1 params vs torch AdamW", device, run, 0.0))

        t0 = time.perf_counter()
        run = _train(device, steps, offload=False, param_dtype=torch.float32, group=group,
                     with_reference=True, shape=UNPADDED)
        check = "engine ws1 unpadded groups vs torch AdamW"
        if run["padded"]:
            rows.append(Result(check, device.type, "FAIL", None, None, "",
                               time.perf_counter() - t0,
                               f"the model's groups are padded ({', '.join(run['padded'])})"))
        else:
            rows.append(_params_row(check, device, run, time.perf_counter() - t0,
                                    "every group ends with a real value"))

        t0 = time.perf_counter()
        plain, offloaded = (_train(device, steps, offload=o, param_dtype=torch.bfloat16,
                                   group=group, with_reference=False) for o in (False, True))
        seconds = time.perf_counter() - t0
        bad = sum(_bit_mismatches(offloaded["params"][n], w) for n, w in plain["params"].items())
        bad += sum(a != b for a, b in zip(plain["losses"], offloaded["losses"]))
        # The offloaded state is one arena, pinned whole on a GPU (exactly its bytes, so no
        # rounded-up blocks of torch's caching host allocator), and nothing pinned on a CPU.
        arena, pinned = offloaded["arena"]
        expected = arena if device.type == "cuda" else 0
        bad += pinned != expected
        rows.append(_judged("offload vs no offload (bf16)", device.type, bad, 0,
                            "elements differ", seconds,
                            f"{steps} steps, bit for bit; arena {arena} B, pinned {pinned} B"))
    return rows


def _frozen_mlp(dtype: str | None) -> list[nn.Module]:
    """The unpadded MLP with its Linear weights frozen (a bias and LayerNorm fine-tune), their
    values replaced by their ``dtype`` round trip when given (the unsharded reference)."""
    layers = mlp(UNPADDED)
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                m.weight.requires_grad_(False)
                if dtype is not None:
                    with torch.no_grad():
                        m.weight.copy_(reference.round_trip(m.weight, dtype,
                                                            zerocore.FROZEN_FORMATS[dtype]))
    return layers


def _train_frozen(device: torch.device, steps: int, dtype: str, placement: str | None,
                  group: dist.ProcessGroup) -> dict:
    """The frozen-weight MLP trained sharded with ``FrozenWeights(dtype, placement=)``, or
    (``placement`` None) unsharded with torch.optim.AdamW from the round-tripped weights:
    losses and trainable parameters by name, on the CPU."""
    if placement is None:
        model = nn.Sequential(*_frozen_mlp(dtype)).to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                lr=ENGINE_LR, weight_decay=ENGINE_WEIGHT_DECAY)
    else:
        model = zerocore.shard(_frozen_mlp(None), group=group, device=device,
                               frozen_weights=zerocore.FrozenWeights(dtype, placement=placement))
        opt = zerocore.optim.AdamW(model.trainable_shards(), lr=ENGINE_LR,
                                   weight_decay=ENGINE_WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        x, y = batch(step, device, UNPADDED)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if placement is None:
        params = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    else:
        params = {f"{i}.{n}": t.float().cpu()
                  for i, state in model.iter_full_states(trainable_only=True)
                  for n, t in state.items()}
    return {"losses": losses, "params": params}


def check_frozen(device: torch.device, steps: int) -> list[Result]:
    """Per quantized format (NF4, fp8): the replicated frozen base (every rank holds it whole and
    dequantizes a unit locally before it runs) against the sharded one (gathered, then
    dequantized), bit for bit: both compute with the same dequantized values; and the sharded
    one against the unsharded model given the round-tripped weights, trained by
    torch.optim.AdamW (the losses, ``ENGINE_LOSS_RTOL``)."""
    rows = []
    with world_of_one(device) as group:
        for dtype in ("nf4", "fp8"):
            t0 = time.perf_counter()
            sharded, replicated = (_train_frozen(device, steps, dtype, p, group)
                                   for p in ("sharded", "replicated"))
            ref = _train_frozen(device, steps, dtype, None, group)
            seconds = time.perf_counter() - t0
            names = sorted(sharded["params"])
            if names != sorted(replicated["params"]):
                rows.append(Result(f"frozen {dtype}: replicated = sharded", device.type, "FAIL",
                                   None, None, "", seconds, f"names differ: {names}"))
                continue
            bad = sum(_bit_mismatches(replicated["params"][n], sharded["params"][n])
                      for n in names)
            bad += sum(a != b for a, b in zip(sharded["losses"], replicated["losses"]))
            rows.append(_judged(f"frozen {dtype}: replicated = sharded", device.type, bad, 0,
                                "elements differ", seconds, f"{steps} steps, bit for bit"))
            losses, ref_losses = (torch.tensor(r["losses"]) for r in (sharded, ref))
            rel = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
            rows.append(_judged(f"frozen {dtype}: losses vs torch AdamW", device.type, rel,
                                ENGINE_LOSS_RTOL, "rel", seconds,
                                f"loss {ref_losses[0].item():.4f} -> "
                                f"{ref_losses[-1].item():.4f}, round-tripped weights"))
    return rows


# ------------------------------------------------------------------------------------------------
# Bandwidth


def _median_seconds(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    """Median time of one call, after two untimed ones; CUDA calls timed with events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _copy_gbps(device: torch.device, n: int, rounds: int) -> float:
    """GB/s of ``dst.copy_(src)`` for n-byte buffers, counting bytes read plus written; the
    buffers are freed on return, before the Adam step's are allocated."""
    src = torch.full((n,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / _median_seconds(lambda: dst.copy_(src), device, rounds) / 1e9


# Bytes per parameter of an AdamW step with an fp16 gradient and an fp16 model copy: read the
# gradient (2) and master, exp_avg, exp_avg_sq (12); write those three (12) and the copy (2).
ADAM_BYTES_PER_PARAM = 28


def measure_bandwidth(device: torch.device, sizes: Sizes, *,
                      kernel: Callable[..., None] = ops.fused_adam) -> list[Result]:
    """Copy bandwidth (bytes read plus written, per second) and the fused Adam step's, with its
    fraction of the copy's: how close the kernel comes to the memory's speed. Measurements, not
    checks: another process's load changes them. On a CPU the fraction can exceed 1: copy_
    reads every destination line into the cache before writing it (a third more traffic than
    counted), while the kernel stores to lines it has just read or streams past the cache."""
    kind = device.type
    t0 = time.perf_counter()
    copy_gbps = _copy_gbps(device, sizes.copy_mib[kind] << 20, sizes.rounds[kind])
    rows = [Result("copy bandwidth", kind, "INFO", copy_gbps, None, "GB/s",
                   time.perf_counter() - t0,
                   f"tensor.copy_ of {sizes.copy_mib[kind]} MiB, median of {sizes.rounds[kind]}")]

    t0 = time.perf_counter()
    numel = sizes.adam_numel[kind]
    p = torch.randn(numel, device=device)
    g = (torch.randn(numel, device=device) * 1e-2).half()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    model_copy = torch.empty(numel, dtype=torch.float16, device=device)
    step = 0

    def adam_step() -> None:
        nonlocal step
        step += 1
        kernel(p, g, m, v, model_copy, lr=1e-3, weight_decay=0.01, step=step, adamw=True)

    adam_s = _median_seconds(adam_step, device, sizes.rounds[kind])
    adam_gbps = ADAM_BYTES_PER_PARAM * numel / adam_s / 1e9
    rows.append(Result("fused_adam bandwidth", kind, "INFO", adam_gbps, None, "GB/s",
                       time.perf_counter() - t0,
                       f"{adam_gbps / copy_gbps:.2f} of copy; 2^{numel.bit_length() - 1} params, "
                       f"fp16 grad + copy, {1e3 * adam_s:.3f} ms"))

    # Dequantizing int8 frozen weights into bf16 (issue 12's target on a GPU: >= 80% of copy):
    # reads a byte and 4/128 of a scale, writes two bytes, per element.
    t0 = time.perf_counter()
    q = torch.randint(-127, 128, (numel,), dtype=torch.int8, device=device)
    scales = torch.rand(numel // INT8_BLOCK, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    deq_s = _median_seconds(lambda: ops.dequantize_blockwise_(out, q, scales, INT8_BLOCK),
                            device, sizes.rounds[kind])
    deq_gbps = (3 + 4 / INT8_BLOCK) * numel / deq_s / 1e9
    rows.append(Result("int8 dequantize bandwidth", kind, "INFO", deq_gbps, None, "GB/s",
                       time.perf_counter() - t0,
                       f"{deq_gbps / copy_gbps:.2f} of copy; 2^{numel.bit_length() - 1} "
                       f"elements into bf16, block {INT8_BLOCK}, {1e3 * deq_s:.3f} ms"))
    return rows


# ------------------------------------------------------------------------------------------------
# The plan, the table, the command


@dataclasses.dataclass(frozen=True)
class Planned:
    """A check to run: its name in --list and a function returning its rows."""

    name: str
    device: torch.device
    run: Callable[[], list[Result]]


def plan(devices: Sequence[torch.device], sizes: Sizes, kernels: Kernels = Kernels()
         ) -> list[Planned]:
    """Every check, device by device. Builds closures only: nothing here touches a device, so
    the plan of a CUDA run can be listed on a machine without one."""
    steps: list[Planned] = []
    for dev in devices:
        op_sizes = sizes.sizes_for(dev)
        steps += [
            Planned("fused_adam vs reference", dev, lambda d=dev, s=op_sizes: [check_fused_adam(
                d, s, kernel=kernels.fused_adam, steps=sizes.adam_steps)]),
            Planned("fused_adam_multi = fused_adam per shard", dev,
                    lambda d=dev, s=op_sizes: [check_fused_adam_multi(
                        d, s, kernel=kernels.fused_adam_multi)]),
            Planned("grad_stats vs reference", dev, lambda d=dev, s=op_sizes: [check_grad_stats(
                d, s, kernel=kernels.grad_stats)]),
            Planned("pack vs reference", dev, lambda d=dev, s=op_sizes: [check_pack(
                d, s, kernel=kernels.pack)]),
            Planned("unpack vs reference", dev, lambda d=dev, s=op_sizes: [check_unpack(
                d, s, kernel=kernels.unpack)]),
            Planned("int8 quantize/dequantize vs reference", dev,
                    lambda d=dev, s=op_sizes: [check_int8(
                        d, s, quantize=kernels.quantize_blockwise,
                        dequantize=kernels.dequantize_blockwise_)]),
            Planned("nf4/fp8 dequantize vs reference", dev,
                    lambda d=dev, s=op_sizes: [check_lowbit(
                        d, s, dequantize_nf4=kernels.dequantize_nf4_,
                        dequantize_fp8=kernels.dequantize_fp8_)]),
        ]
        if dev.type == "cuda":
            steps.append(Planned("cuda kernels = cpu kernels", dev,
                                 lambda d=dev: [check_cuda_matches_cpu(
                                     d, (1, 17, 278011, sizes.large["cuda"]), kernels=kernels)]))
        steps += [
            Planned("engine ws1 vs torch AdamW; offload vs no offload", dev,
                    lambda d=dev: check_engine(d, sizes.train_steps)),
            Planned("frozen nf4/fp8: replicated = sharded; vs torch AdamW", dev,
                    lambda d=dev: check_frozen(d, sizes.train_steps)),
            Planned("copy and fused_adam bandwidth", dev,
                    lambda d=dev: measure_bandwidth(d, sizes, kernel=kernels.fused_adam)),
        ]
    return steps


def run_planned(step: Planned) -> list[Result]:
    """Runs one planned check; an exception becomes a FAIL row with its last line, so one broken
    check does not hide the others."""
    t0 = time.perf_counter()
    try:
        return step.run()
    except Exception as e:  # noqa: BLE001  (any failure is the check's result)
        last = traceback.format_exception_only(type(e), e)[-1].strip().replace("\n", " ")
        return [Result(step.name, step.device.type, "FAIL", None, None, "",
                       time.perf_counter() - t0, f"raised {last[:300]}")]


def _format_error(r: Result) -> str:
    if r.error is None:
        return "-"
    if r.tolerance is None:
        return f"{r.error:.4g} {r.unit}"
    return f"{r.error:.3g} vs {r.tolerance:.3g} {r.unit}"


def table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, one row per result."""
    head = ("check", "device", "result", "max error vs tolerance", "time", "detail")
    rows = [head] + [(r.check, r.device, r.status, _format_error(r), f"{r.seconds:.2f} s",
                      r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i != 4 else c.rjust(w) for i, (c, w) in
                 enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(head[-1]))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerocore.selftest",
        description="Checks zerocore on this machine's devices in under two minutes: every op "
                    "against its plain-PyTorch reference, the engine at world size 1 against "
                    "unsharded torch.optim.AdamW training, CPU offload against no offload, and "
                    "the copy and fused-Adam bandwidth. Prints a table; exits 1 if a check "
                    "failed, 2 on a usage error.")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): the CPU, then the current CUDA device when one is "
                        "visible; cpu or cuda: that one only (cuda fails without a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes and fewer steps (about 10 s on a 2-core CPU)")
    p.add_argument("--list", action="store_true",
                   help="print the checks that would run, and exit without running them")
    return p


def _devices(choice: str, build: BuildInfo, cuda_visible: bool,
             listing: bool) -> tuple[list[torch.device], str | None]:
    """The devices to check, or an error message for a choice this machine cannot do. Listing
    the plan needs no device."""
    if choice == "cpu":
        return [torch.device("cpu")], None
    cuda = torch.device("cuda", torch.cuda.current_device()) if cuda_visible else None
    if choice == "cuda" and listing:
        return [cuda or torch.device("cuda", 0)], None
    if choice == "cuda" and cuda is None:
        return [], ("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is "
                    "False; torch " + torch.__version__ + ")")
    if cuda is not None and not build.has_cuda:
        return [], (f"a CUDA device is visible but {build}: rebuild with a CUDA toolkit and a "
                    f"CUDA build of torch (pip install --no-build-isolation -e .), or hide the "
                    f"GPU with CUDA_VISIBLE_DEVICES= to check the CPU alone")
    if choice == "cuda":
        return [cuda], None
    return [torch.device("cpu")] + ([cuda] if cuda is not None else []), None


def main(argv: Sequence[str] | None = None, *, kernels: Kernels = Kernels()) -> int:
    """The command. Returns the exit status: 0 all passed, 1 a check failed, 2 a usage error."""
    args = _parser().parse_args(argv)
    devices, problem = _devices(args.device, zerocore.BUILD, torch.cuda.is_available(),
                                args.list)
    if problem:
        print(f"zerocore.selftest: {problem}", file=sys.stderr)
        return 2
    sizes = Sizes.quick() if args.quick else Sizes.full()
    steps = plan(devices, sizes, kernels)
    if args.list:
        for s in steps:
            print(f"{s.device}: {s.name}")
        return 0

    print(f"zerocore {zerocore.__version__}, {zerocore.BUILD}")
    print(f"torch {torch.__version__}; checking {', '.join(str(d) for d in devices)}"
          + (f" ({torch.cuda.get_device_name(devices[-1])})" if devices[-1].type == "cuda" else "")
          + (" (--quick)" if args.quick else ""), flush=True)
    t0 = time.perf_counter()
    results: list[Result] = []
    for s in steps:
        # Progress on stderr as each check starts, so a run that hangs or is killed shows where.
        print(f"selftest: {s.device}: {s.name} ...", file=sys.stderr, flush=True)
        results += run_planned(s)
    print(table(results))
    failed = [r for r in results if r.failed]
    passed = sum(r.status == "PASS" for r in results)
    print(f"selftest: {passed} passed, {len(failed)} failed, "
          f"{sum(r.status == 'INFO' for r in results)} measured, "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
