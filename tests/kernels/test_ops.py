"""Tests of the kernel ops in ``zerocore.ops``: fused_adam, grad_stats, pack and unpack.

Each op is compared with its plain-PyTorch definition in ``zerocore.reference`` on fresh random
inputs (odd sizes, every dtype combination, misaligned and non-contiguous tensors), fused_adam also
with ``torch.optim.Adam``/``AdamW`` and, on the CPU, bit for bit with an exact float32 replay of
the kernel's arithmetic. Then: every malformed argument raises an error naming it,
``torch.library.opcheck`` passes on every op, and the ops work under ``torch.compile``.

Inputs come from seeded generators, so every failure reproduces. Every device-taking test runs on
the CPU and, when a GPU is present, on CUDA (see conftest.py).
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

import zerocore  # noqa: F401  (registers torch.ops.zerocore)
from zerocore.kernels import ops, reference
from tests.support.exact_adam import HYPER, assert_slack_untouched, exact_adam, placed, randn

F32_EPS = torch.finfo(torch.float32).eps  # 2^-23, one ulp of 1.0 in float32
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", None: "none"}

# 278011: several 32768-element pieces for the CPU threads, then a tail shorter than one 16-element
# vector block; 15 and 17: just under and just over one block; 1 and 0: no vector work at all.
SIZES = [278011, 1, 15, 17, 0]

def _rand_uniform(shape, seed: int, device: str) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor,
                        ulps: float, what: str) -> None:
    """|actual - expected| <= ulps * F32_EPS * scale, elementwise."""
    err = (actual.double() - expected.double()).abs() / (F32_EPS * scale.double())
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= ulps, f"{what}: off by {worst:.2f} ulps of its scale (allowed {ulps})"


def _assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and values, NaN where expected has NaN, and the same sign of zero."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    not_nan = ~torch.isnan(expected)
    assert torch.equal(torch.signbit(actual[not_nan]), torch.signbit(expected[not_nan]))


# ------------------------------------------------------------------------------------------------
# fused_adam


ADAM_VARIANTS = {  # name: (adamw, weight_decay)
    "adamw": (True, 0.0), "adamw-wd": (True, 0.1), "adam": (False, 0.0), "adam-l2": (False, 0.1)}
# (offset of param, grad, exp_avg, exp_avg_sq, model_copy) in their buffers: all aligned, or each
# starting at a different odd element so no two arguments share an alignment.
OFFSETS = {"aligned": (0, 0, 0, 0, 0), "misaligned": (1, 3, 5, 7, 1)}
# (loss scale, layout): the gradient is stored multiplied by the loss scale and the kernel gets
# inv_grad_scale = 1 / loss scale.
SCALINGS = [(1.0, "aligned"), (1024.0, "misaligned"), (1.0, "misaligned"), (1024.0, "aligned")]
STEPS = 5  # consecutive steps on the same buffers, so moments and bias correction build up


def _fused_adam_cases():
    """Every size x grad dtype x model-copy dtype x Adam variant. Small sizes also take every
    loss scale and layout; at 278011 (the slow size) each variant takes one of the four, in turn,
    so every dtype pair still meets every scaling and layout once."""
    for n in SIZES:
        for grad_dtype in FLOAT_DTYPES:
            for copy_dtype in [None] + FLOAT_DTYPES:
                for k, variant in enumerate(ADAM_VARIANTS):
                    scalings = SCALINGS[k:k + 1] if n == max(SIZES) else SCALINGS
                    for loss_scale, layout in scalings:
                        yield pytest.param(n, grad_dtype, copy_dtype, variant, loss_scale, layout,
                                           id=f"{n}-grad_{DTYPE_IDS[grad_dtype]}-copy_"
                                              f"{DTYPE_IDS[copy_dtype]}-{variant}-x"
                                              f"{loss_scale:g}-{layout}")


# Tolerances against zerocore.reference, in float32 ulps of a per-element scale. The reference
# computes the same formula with torch's float32 ops, which differ from the kernel by rounding
# only: torch's lerp/addcmul/addcdiv fuse multiply-adds and torch.sqrt may be one ulp off on the
# CPU; a CUDA kernel contracts multiply-adds as well. Each op then differs by about one ulp of its
# largest term, and errors carry over the steps (measured on the CPU over all cases here: at most
# 2.4 for param, 1.3 for exp_avg, 4.0 for exp_avg_sq in these units). The bounds allow about
# twice that, still far below what a wrong constant or formula produces (eps off by 1% fails).
PARAM_ULPS = 5.0     # of |param| + step size: near 0 the update's own rounding dominates
EXP_AVG_ULPS = 3.0   # of the largest decayed |grad| the element has seen: the lerp's terms
EXP_AVG_SQ_ULPS = 8.0  # of |exp_avg_sq|: a sum of non-negative terms, so no cancellation


def _without_cancellation(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """grad with each element's sign made that of param, so Adam's L2 term (grad + weight_decay *
    param) adds magnitudes and never cancels. Where it nearly cancels, the decayed gradient is
    mostly rounding noise, and since Adam normalises it by its own size the update becomes a ratio
    of noise: any two float32 implementations then differ by far more than a few ulps (up to ~80
    seen here). The exact replay still covers such elements bit for bit on the CPU."""
    return grad.abs() * torch.where(param < 0, -1.0, 1.0)


def _max_step_size(hyper) -> float:
    """lr / (1 - beta1), the step size at step 1: the largest an update gets (|exp_avg| / sqrt(
    exp_avg_sq) stays around 1 with random gradients)."""
    return hyper["lr"] / (1.0 - hyper["beta1"])


@pytest.mark.parametrize("n,grad_dtype,copy_dtype,variant,loss_scale,layout",
                         list(_fused_adam_cases()))
def test_fused_adam_matches_reference(device, n, grad_dtype, copy_dtype, variant, loss_scale,
                                      layout):
    adamw, weight_decay = ADAM_VARIANTS[variant]
    seed = zlib.crc32(repr((n, grad_dtype, copy_dtype, variant, loss_scale, layout)).encode())
    off = OFFSETS[layout]
    p_buf, p = placed(randn(n, seed, device), off[0])
    m_buf, m = placed(torch.zeros(n, device=device), off[2])
    v_buf, v = placed(torch.zeros(n, device=device), off[3])
    c_buf = copy = None
    if copy_dtype is not None:
        c_buf, copy = placed(torch.zeros(n, dtype=copy_dtype, device=device), off[4])
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    exact = device == "cpu"
    if exact:
        ex_p, ex_m, ex_v = p.clone(), m.clone(), v.clone()
    g_max = torch.zeros(n, device=device)  # largest |decayed grad| each element has seen
    # Each element's gradients have their own magnitude, from 1e-4 to 10 (log-uniform), like the
    # parameters of a real model; the smallest are near eps, which then matters.
    magnitude = 10.0 ** (_rand_uniform(n, seed + 100, device) * 5 - 4)

    for step in range(1, STEPS + 1):
        # The gradient as a loss-scaled backward pass would leave it, in its storage dtype;
        # inv_grad_scale undoes the scale inside the kernel.
        g_vals = randn(n, seed + step, device) * magnitude
        if not adamw and weight_decay:
            g_vals = _without_cancellation(g_vals, p)
        g_buf, g = placed((g_vals * loss_scale).to(grad_dtype), off[1])
        # Adam's decayed gradient, the term exp_avg moves towards; the L2 term never cancels.
        g_max = torch.maximum(g_max, g.float().abs() / loss_scale
                              + (0.0 if adamw else weight_decay) * p.abs())
        kw = dict(HYPER, weight_decay=weight_decay, step=step, inv_grad_scale=1.0 / loss_scale,
                  adamw=adamw)
        ops.fused_adam(p, g, m, v, copy, **kw)
        reference.fused_adam(ref_p, g, ref_m, ref_v, None, **kw)
        if exact:
            exact_adam(ex_p, g.cpu(), ex_m, ex_v, **kw)
        assert_slack_untouched(g_buf, off[1], n)

    for buf, o in [(p_buf, off[0]), (m_buf, off[2]), (v_buf, off[3])]:
        assert_slack_untouched(buf, o, n)
    if exact:
        # Bit for bit: same float32 operations in the same order, vector body and tail alike.
        assert torch.equal(p, ex_p), "param differs from the exact float32 replay"
        assert torch.equal(m, ex_m), "exp_avg differs from the exact float32 replay"
        assert torch.equal(v, ex_v), "exp_avg_sq differs from the exact float32 replay"
    _assert_within_ulps(p, ref_p, ref_p.abs() + _max_step_size(HYPER), PARAM_ULPS, "param")
    _assert_within_ulps(m, ref_m, g_max, EXP_AVG_ULPS, "exp_avg")
    _assert_within_ulps(v, ref_v, ref_v.abs(), EXP_AVG_SQ_ULPS, "exp_avg_sq")
    if copy is not None:
        # Exactly the rounding of the new fp32 master weights to the copy's dtype.
        assert torch.equal(copy, p.to(copy_dtype))
        assert_slack_untouched(c_buf, off[4], n)


# The CPU kernels switch to streaming (non-temporal) stores, with a scalar head up to the first
# 32-byte boundary, once a call touches more than this many bytes (kStreamingMinBytes in
# csrc/cpu/vec_io.h); the tests below go past it so that path is checked too.
STREAMING_MIN_BYTES = 32 << 20


@pytest.mark.parametrize("copy_offset", [0, 1, 3], ids=["aligned", "off1", "off3"])
@pytest.mark.parametrize("copy_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_fused_adam_large_shard(device, copy_dtype, copy_offset):
    """A shard big enough for streaming stores of the model copy, at 32-byte-misaligned starts."""
    n = 1_300_007
    grad_dtype = torch.float16
    touched = n * (3 * 2 * 4 + grad_dtype.itemsize + copy_dtype.itemsize)
    assert touched > STREAMING_MIN_BYTES
    seed = zlib.crc32(repr((n, copy_dtype, copy_offset)).encode())
    p = randn(n, seed, device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    c_buf, copy = placed(torch.zeros(n, dtype=copy_dtype, device=device), copy_offset)
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    ex_p, ex_m, ex_v = (t.to("cpu", copy=True) for t in (p, m, v))
    for step in (1, 2):
        g = randn(n, seed + step, device).to(grad_dtype)
        kw = dict(HYPER, weight_decay=0.1, step=step, inv_grad_scale=1.0, adamw=True)
        ops.fused_adam(p, g, m, v, copy, **kw)
        reference.fused_adam(ref_p, g, ref_m, ref_v, None, **kw)
        if device == "cpu":
            exact_adam(ex_p, g, ex_m, ex_v, **kw)
    if device == "cpu":
        assert torch.equal(p, ex_p) and torch.equal(m, ex_m) and torch.equal(v, ex_v)
    # The bounds of test_fused_adam_matches_reference; unit-variance gradients bound exp_avg's
    # terms by max |grad|.
    _assert_within_ulps(p, ref_p, ref_p.abs() + _max_step_size(HYPER), PARAM_ULPS, "param")
    _assert_within_ulps(m, ref_m, torch.full_like(m, 6.0), EXP_AVG_ULPS, "exp_avg")
    _assert_within_ulps(v, ref_v, ref_v.abs(), EXP_AVG_SQ_ULPS, "exp_avg_sq")
    assert torch.equal(copy, p.to(copy_dtype))
    assert_slack_untouched(c_buf, copy_offset, n)


def test_fused_adam_late_step_and_nonzero_state(device):
    """Bias corrections near 1 (step 10000) and moments that did not start at zero."""
    n = 4099
    kw = dict(lr=1e-2, beta1=0.5, beta2=0.9, eps=1e-8, weight_decay=0.3, step=10_000,
              inv_grad_scale=0.37, adamw=False)
    p = randn(n, 1, device)
    g = _without_cancellation(randn(n, 2, device), p).to(torch.bfloat16)
    m = randn(n, 3, device, scale=0.1)
    v = randn(n, 4, device, scale=0.1).square()
    copy = torch.empty(n, dtype=torch.float16, device=device)
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    ex_p, ex_m, ex_v = (t.to("cpu", copy=True) for t in (p, m, v))
    g_decayed = g.float().abs() * kw["inv_grad_scale"] + kw["weight_decay"] * p.abs()
    m_before = m.abs()
    ops.fused_adam(p, g, m, v, copy, **kw)
    reference.fused_adam(ref_p, g, ref_m, ref_v, None, **kw)
    if device == "cpu":
        exact_adam(ex_p, g, ex_m, ex_v, **kw)
        assert torch.equal(p, ex_p) and torch.equal(m, ex_m) and torch.equal(v, ex_v)
    # One step from the same state: the bounds of test_fused_adam_matches_reference apply, with
    # the exp_avg scale being its two terms, the old exp_avg and the decayed gradient.
    _assert_within_ulps(p, ref_p, ref_p.abs() + _max_step_size(kw), PARAM_ULPS, "param")
    _assert_within_ulps(m, ref_m, m_before + g_decayed, EXP_AVG_ULPS, "exp_avg")
    _assert_within_ulps(v, ref_v, ref_v.abs(), EXP_AVG_SQ_ULPS, "exp_avg_sq")
    assert torch.equal(copy, p.half())


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_fused_adam_matches_torch_optim(device, adamw, impl):
    """Ten steps against torch.optim on two ordinary parameters, the kernel running on their
    concatenation as one flat shard."""
    shapes = [(123, 457), (1001,)]
    hyper = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    params = [torch.nn.Parameter(randn(s, i, device)) for i, s in enumerate(shapes)]
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
             "fused": dict(fused=True)}[impl]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(params, **hyper, **flags)
    flat = torch.cat([q.detach().reshape(-1) for q in params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    g_max = torch.zeros_like(flat)  # largest |decayed grad| each element has seen
    for step in range(1, 11):
        grads = [randn(s, 100 * step + i, device) for i, s in enumerate(shapes)]
        if not adamw:
            grads = [_without_cancellation(g, q.detach()) for g, q in zip(grads, params)]
        for q, g in zip(params, grads):
            q.grad = g
        opt.step()
        g_flat = torch.cat([g.reshape(-1) for g in grads])
        g_max = torch.maximum(g_max, g_flat.abs()
                              + (0.0 if adamw else hyper["weight_decay"]) * flat.abs())
        ops.fused_adam(flat, g_flat, m, v, lr=hyper["lr"],
                       beta1=hyper["betas"][0], beta2=hyper["betas"][1], eps=hyper["eps"],
                       weight_decay=hyper["weight_decay"], step=step, adamw=adamw)
    expected = torch.cat([q.detach().reshape(-1) for q in params])
    exp_avg = torch.cat([opt.state[q]["exp_avg"].reshape(-1) for q in params])
    exp_avg_sq = torch.cat([opt.state[q]["exp_avg_sq"].reshape(-1) for q in params])
    # torch.optim rounds differently from the kernel in the same ways as zerocore.reference (fused
    # multiply-adds; its fused and foreach paths also order some products differently), over 10
    # steps instead of 5: twice the bounds used against the reference.
    step_size = _max_step_size(dict(lr=hyper["lr"], beta1=hyper["betas"][0]))
    _assert_within_ulps(flat, expected, expected.abs() + step_size, 2 * PARAM_ULPS, "param")
    _assert_within_ulps(m, exp_avg, g_max, 2 * EXP_AVG_ULPS, "exp_avg")
    _assert_within_ulps(v, exp_avg_sq, exp_avg_sq.abs(), 2 * EXP_AVG_SQ_ULPS, "exp_avg_sq")


# ------------------------------------------------------------------------------------------------
# grad_stats


def _exactly_summable(n: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random nonzero values from {±0.5, ±1, ±1.5, ±2}: exact in fp32, fp16 and bf16; squares are
    multiples of 1/4 no larger than 4, so for n <= 2^20 every partial sum, in any order and in
    float32, is exact (below 2^22). A dropped or doubled element changes the sum by >= 1/4."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 5, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return (k.float() / 2).to(dtype).to(device)


@pytest.mark.parametrize("layout", ["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("n", SIZES)
def test_grad_stats_sum_of_squares(device, n, dtype, layout):
    off = 3 if layout == "misaligned" else 0
    values = randn(n, n + off, device, scale=3.0).to(dtype)
    buf, grad = placed(values, off)
    stats = ops.grad_stats(grad)
    expected = values.double().square().sum().item()
    assert stats[1].item() == 0.0
    # Float32 partial sums: on the CPU each of the 16 vector lanes adds up to 2048 squares
    # (a 32768-element block) before the blocks are summed in float64, so the worst-case relative
    # error is 2048 float32 roundings, 2048 * 2^-24 (no cancellation: all terms are >= 0).
    assert stats[0].item() == pytest.approx(expected, rel=2048 * 2.0**-24, abs=0.0)
    assert_slack_untouched(buf, off, n)

    # Exact values exactly summed: every element counted once, including the scalar tail.
    grad = _exactly_summable(n, n, dtype, device)
    stats = ops.grad_stats(grad)
    assert stats.tolist() == [grad.double().square().sum().item(), 0.0]


def test_grad_stats_2d_grad(device):
    grad = _exactly_summable(37 * 41, 5, torch.float16, device).view(37, 41)
    assert ops.grad_stats(grad).tolist() == [grad.double().square().sum().item(), 0.0]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("n", [278011, 17, 1])
def test_grad_stats_flags_one_nonfinite_element(device, n, dtype, bad):
    values = _exactly_summable(n, 7, dtype, device)
    rng = random.Random(n)
    # The first element, the last (in the scalar tail for n = 278011 and 17), a random one, and
    # either side of the CPU's 32768-element block boundary.
    positions = sorted({0, n - 1, rng.randrange(n)} | {i for i in (32767, 32768) if i < n})
    for i in positions:
        grad = values.clone()
        grad[i] = bad
        stats = ops.grad_stats(grad)
        assert stats[1].item() == 1.0, f"non-finite element at {i} of {n} not flagged"
        assert not math.isfinite(stats[0].item()), "the sum of squares must include it"


@pytest.mark.parametrize("dtype,value", [(torch.float32, 1e20), (torch.bfloat16, 1e30),
                                         (torch.float16, 65504.0)], ids=["fp32", "bf16", "fp16"])
def test_grad_stats_huge_finite_value_is_not_flagged(device, dtype, value):
    """A finite element whose square overflows float32 (fp32, bf16) is not an inf or nan: the CPU
    kernel re-reads a block whose float32 sum overflowed in float64 to tell the two apart. The sum
    of squares itself is then +inf in float32, as in the float64 reference rounded to float32.
    fp16's largest value squares to 4.3e9, which float32 holds: there, the sum stays finite."""
    n = 100_003
    grad = randn(n, 11, device).to(dtype)
    grad[random.Random(1).randrange(n)] = value
    grad[-1] = -value
    stats = ops.grad_stats(grad)
    assert stats[1].item() == 0.0
    expected = reference.grad_stats(grad)[0].item()
    # Finite case (fp16): the float32-partial-sum bound of test_grad_stats_sum_of_squares.
    assert stats[0].item() == pytest.approx(expected, rel=2048 * 2.0**-24, abs=0.0)


def test_grad_stats_accumulates(device):
    a = _exactly_summable(50_001, 1, torch.bfloat16, device)
    b = _exactly_summable(70_001, 2, torch.float32, device)
    stats = torch.tensor([5.0, 0.0], device=device)
    ops.grad_stats(a, stats)
    ops.grad_stats(b, stats)
    # Exact: every value involved is a multiple of 1/4 below 2^22.
    total = 5.0 + a.double().square().sum().item() + b.double().square().sum().item()
    assert stats.tolist() == [total, 0.0]

    # The flag is only ever set, never cleared: a later finite shard leaves it at 1.
    bad = a.clone()
    bad[17] = math.nan
    stats = torch.zeros(2, device=device)
    ops.grad_stats(bad, stats)
    ops.grad_stats(b, stats)
    assert stats[1].item() == 1.0
    stats = torch.tensor([0.0, 1.0], device=device)
    ops.grad_stats(b, stats)
    assert stats[1].item() == 1.0


def test_grad_stats_empty_grad_leaves_stats(device):
    for before in ([3.5, 0.0], [3.5, 1.0]):
        stats = torch.tensor(before, device=device)
        ops.grad_stats(torch.empty(0, dtype=torch.float16, device=device), stats)
        assert stats.tolist() == before


def test_grad_stats_independent_of_thread_count():
    """The CPU kernel sums fixed 32768-element blocks, so the float result must not depend on how
    many threads split the range."""
    grad = randn(278011, 3, "cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.grad_stats(grad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ops.grad_stats(grad), one)


# ------------------------------------------------------------------------------------------------
# pack / unpack

# Values every conversion must get exactly right: infinities, NaN, -0.0, float32 and float16
# subnormals, values that overflow float16, the largest float32, and exact ties of bf16 rounding
# (1 + 2^-8, 1 + 3 * 2^-8) and fp16 rounding (1 + 2^-11, 1 + 3 * 2^-11), which go to even.
SPECIALS = [math.inf, -math.inf, math.nan, -0.0, 1e-40, -3e-6, 1e5, -7e4, 3.4e38,
            1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11]
# How a source tensor is laid out: the kernel copies contiguous ones itself and hands the rest to
# a strided copy; "offset" is contiguous but starts 3 elements into its storage.
SRC_LAYOUTS = ["contiguous", "transposed", "stepped", "expanded", "permuted", "offset", "zero-dim",
               "empty"]
DST_LAYOUTS = ["contiguous", "transposed", "stepped", "permuted", "offset", "zero-dim", "empty"]


def _special_randn(numel: int, rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(numel, generator=gen) * 10
    for _ in range(min(numel, 4)):
        x[rng.randrange(numel)] = rng.choice(SPECIALS)
    return x


def _random_shape(rng: random.Random, big: bool) -> tuple[int, int]:
    if big:  # spans several of the CPU's 32768-element pieces, so threads split it
        return (rng.choice([251, 256]), rng.choice([397, 401]))
    return (rng.randint(1, 9), rng.randint(1, 13))


def _source(layout: str, dtype: torch.dtype, device: str, rng: random.Random,
            gen: torch.Generator, big: bool = False) -> torch.Tensor:
    a, b = _random_shape(rng, big)

    def values(*shape):
        # Moved to the device before the layout is made: .to(device) would make a copy of a
        # stepped, expanded or offset view contiguous.
        return _special_randn(math.prod(shape), rng, gen).to(dtype).to(device).view(shape)

    if layout == "contiguous":
        return values(a, b)
    if layout == "transposed":
        return values(b, a).t()
    if layout == "stepped":
        return values(a, 2 * b + 1)[:, ::2]
    if layout == "expanded":
        return values(a, 1).expand(a, b)  # stride 0: one stored value per row
    if layout == "permuted":
        return values(b, 2, a).permute(2, 0, 1)
    if layout == "offset":
        return values(a * b + 3)[3:].view(a, b)
    if layout == "zero-dim":
        return values(1).view(())
    assert layout == "empty"
    return values(a, 0)


def _destination(layout: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, view): a writable view of the given layout into a NaN-filled base, so elements
    the view does not cover show whether unpack wrote outside it."""
    numel = math.prod(shape)
    if layout in ("contiguous", "zero-dim", "empty"):
        base = torch.full(shape, math.nan, dtype=dtype, device=device)
        return base, base
    if layout == "transposed" and len(shape) == 2:
        base = torch.full(shape[::-1], math.nan, dtype=dtype, device=device)
        return base, base.t()
    if layout == "permuted" and len(shape) == 2:
        base = torch.full((shape[1], shape[0], 2), math.nan, dtype=dtype, device=device)
        return base, base[:, :, 1].t()
    if layout == "offset":
        base = torch.full((numel + 3,), math.nan, dtype=dtype, device=device)
        return base, base[3:].view(shape)
    # "stepped" (and 1-D shapes for the 2-D-only layouts): every other element of a wider base
    base = torch.full((numel * 2 + 1,), math.nan, dtype=dtype, device=device)
    return base, base[1::2].view(shape) if numel else base[:0].view(shape)


def _random_ranges(numels: list[int], rng: random.Random) -> tuple[list[int], int]:
    """Offsets for tensors of the given sizes, in a shuffled order with random gaps (some zero),
    and the total length including a random gap at the end. Empty tensors get any offset up to
    and including the end, even inside another tensor's range: they cover nothing."""
    order = list(range(len(numels)))
    rng.shuffle(order)
    offsets = [0] * len(numels)
    cursor = rng.choice([0, 0, 1, 5])
    for i in order:
        if numels[i]:
            offsets[i] = cursor
            cursor += numels[i] + rng.choice([0, 0, 1, 2, 7])
    total = cursor + rng.choice([0, 3])
    for i in order:
        if not numels[i]:
            offsets[i] = rng.randint(0, total)
    return offsets, total


def _random_sources(seed: int, device: str,
                    dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Tensors of every layout and more at random, of random dtypes (or all of ``dtype``)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layouts = SRC_LAYOUTS + [rng.choice(SRC_LAYOUTS) for _ in range(rng.randint(0, 8))]
    tensors = [_source(layout, dtype or rng.choice(FLOAT_DTYPES), device, rng, gen)
               for layout in layouts]
    if seed % 2 == 0:  # every other case has one large tensor, which threads split
        layout = rng.choice(["contiguous", "transposed", "stepped", "offset"])
        tensors.append(_source(layout, dtype or rng.choice(FLOAT_DTYPES), device, rng, gen,
                               big=True))
    rng.shuffle(tensors)
    return tensors


@pytest.mark.parametrize("flat_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("seed", range(6))
def test_pack_matches_reference(device, seed, flat_dtype):
    tensors = _random_sources(seed, device)
    offsets, total = _random_ranges([t.numel() for t in tensors], random.Random(seed))
    # Garbage in flat beforehand: padding must come out as exactly +0.0.
    flat = torch.full((total,), math.nan, dtype=flat_dtype, device=device)
    expected = torch.empty_like(flat)
    assert ops.pack(tensors, offsets, flat) is flat
    reference.pack(tensors, offsets, expected)
    # Exact: a dtype conversion is one deterministic rounding (round to nearest even).
    _assert_identical(flat, expected)


@pytest.mark.parametrize("flat_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("seed", range(6))
def test_unpack_matches_reference(device, seed, flat_dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    count = len(DST_LAYOUTS) + rng.randint(0, 6)
    layouts = DST_LAYOUTS + [rng.choice(DST_LAYOUTS) for _ in range(count - len(DST_LAYOUTS))]
    rng.shuffle(layouts)
    shapes = []
    for i, layout in enumerate(layouts):
        a, b = _random_shape(rng, big=seed % 2 == 0 and i == 0)
        shapes.append({"zero-dim": (), "empty": (a, 0)}.get(layout, (a, b)))
    dtypes = [rng.choice(FLOAT_DTYPES) for _ in layouts]
    offsets, total = _random_ranges([math.prod(s) for s in shapes], rng)
    flat = _special_randn(total, rng, gen).to(flat_dtype).to(device)

    got = [_destination(lay, s, d, device) for lay, s, d in zip(layouts, shapes, dtypes)]
    want = [_destination(lay, s, d, device) for lay, s, d in zip(layouts, shapes, dtypes)]
    ops.unpack(flat, offsets, [view for _, view in got])
    reference.unpack(flat, offsets, [view for _, view in want])
    for (base, _), (want_base, _) in zip(got, want):
        _assert_identical(base, want_base)  # views' values, and the rest of each base untouched


@pytest.mark.parametrize("flat_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("seed", range(4))
def test_pack_unpack_round_trip(device, seed, flat_dtype):
    """Lossless whenever flat's dtype holds every tensor's values: fp32 for any mix, else only
    tensors of flat's own dtype."""
    rng = random.Random(seed)
    tensors = _random_sources(seed, device, None if flat_dtype == torch.float32 else flat_dtype)
    offsets, total = _random_ranges([t.numel() for t in tensors], rng)
    flat = ops.pack(tensors, offsets, torch.empty(total, dtype=flat_dtype, device=device))
    outs = [_destination(rng.choice(DST_LAYOUTS[:5]), t.shape, t.dtype, device)[1]
            for t in tensors]
    ops.unpack(flat, offsets, outs)
    for out, t in zip(outs, tensors):
        _assert_identical(out, t)


@pytest.mark.parametrize("flat_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_pack_unpack_large(device, flat_dtype):
    """Calls big enough for streaming stores, with a flat buffer and tensors that start off any
    32-byte boundary, same-dtype and converting copies, and padding of odd lengths."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)

    def big(numel, dtype, storage_offset):
        return _special_randn(numel + storage_offset, rng, gen).to(dtype).to(device)[
            storage_offset:]

    tensors = [big(4_000_003, torch.float32, 0), big(2_000_001, torch.float16, 1),
               big(1_200_007, torch.bfloat16, 3), big(999_999, flat_dtype, 5),
               _source("transposed", torch.float32, device, rng, gen),
               big(17, torch.float16, 0)]
    offsets, total = _random_ranges([t.numel() for t in tensors], rng)
    touched = total * flat_dtype.itemsize + sum(t.numel() * t.element_size() for t in tensors)
    assert touched > STREAMING_MIN_BYTES
    flat_buf = torch.full((total + 1,), math.nan, dtype=flat_dtype, device=device)
    _assert_pack_unpack_match_reference(tensors, offsets, flat_buf[1:])  # not 32-byte aligned


def _assert_pack_unpack_match_reference(tensors, offsets, flat) -> None:
    """pack into flat (NaN-filled: padding must become +0.0) equals reference.pack, and unpack
    from it into NaN-filled tensors equals reference.unpack, exactly."""
    expected = torch.empty_like(flat)
    ops.pack(tensors, offsets, flat)
    reference.pack(tensors, offsets, expected)
    _assert_identical(flat, expected)

    outs = [torch.full_like(t, math.nan) for t in tensors]
    want = [torch.full_like(t, math.nan) for t in tensors]
    ops.unpack(flat, offsets, outs)
    reference.unpack(flat, offsets, want)
    for out, w in zip(outs, want):
        _assert_identical(out, w)


def test_pack_same_tensor_twice_and_empty_list(device):
    t = randn((3, 5), 0, device).t()
    flat = ops.pack([t, t], [20, 0], torch.full((36,), math.nan, device=device))
    assert torch.equal(flat[:15], t.reshape(-1)) and torch.equal(flat[20:35], t.reshape(-1))
    assert (flat[15:20] == 0).all() and flat[35] == 0
    flat = ops.pack([], [], torch.full((7,), math.nan, dtype=torch.bfloat16, device=device))
    assert torch.equal(flat, torch.zeros_like(flat))
    ops.unpack(flat, [], [])
    ops.pack([], [], torch.empty(0, device=device))


# ------------------------------------------------------------------------------------------------
# CUDA grids. Each kernel's grid is at most what the device runs of it at once (its occupancy,
# csrc/cuda/cuda_common.cuh); past that, the grid-stride loops go round again. The tests above
# stay within one round on a large GPU (278011 elements against an H200's 132 x 2048 resident
# threads of 8 elements each), so these go several rounds, end in a partial one, and require the
# results bit for bit equal to the CPU kernels' (or the reference's, for the copies).


def _elements_per_round(per_thread: int) -> int:
    """Elements one round of a grid-stride loop covers at most: every thread the device keeps
    resident, each taking per_thread elements."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    return props.multi_processor_count * threads_per_sm * per_thread


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["aligned", "misaligned"])
def test_cuda_fused_adam_and_grad_stats_equal_cpu_past_one_grid(layout):
    """Three and a bit rounds of 8-element vectors (aligned), or many more of single elements
    (misaligned: the scalar path), two steps; the CUDA kernel's IEEE round-to-nearest operations
    in the CPU kernel's order give the CPU's bits exactly."""
    n = 3 * _elements_per_round(8) + 5
    off = OFFSETS[layout]
    results = {}
    for device in ("cpu", "cuda"):
        _, p = placed(randn(n, 1, device), off[0])
        _, m = placed(torch.zeros(n, device=device), off[2])
        _, v = placed(torch.zeros(n, device=device), off[3])
        _, copy = placed(torch.zeros(n, dtype=torch.bfloat16, device=device), off[4])
        for step in (1, 2):
            _, g = placed(randn(n, 10 + step, device).half(), off[1])
            ops.fused_adam(p, g, m, v, copy, **HYPER, weight_decay=0.1, step=step,
                           inv_grad_scale=0.5, adamw=True)
        # Squares of {±0.5, ±1, ±1.5, ±2} are multiples of 1/4: both kernels' partial sums are
        # exact (float32 below 2^22 within a CPU block, float64 elsewhere), so both round the
        # same exact total once.
        g = _exactly_summable(n, 3, torch.bfloat16, device)
        results[device] = [p, m, v, copy, ops.grad_stats(g)]
    for name, a, b in zip(["param", "exp_avg", "exp_avg_sq", "model copy", "grad_stats"],
                          results["cpu"], results["cuda"]):
        assert torch.equal(_bits(a), _bits(b)), f"{name}: CUDA differs from CPU"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
def test_cuda_pack_unpack_past_one_grid(flat_dtype):
    """The pack kernel's blocks take 8192-element chunks (32 per thread): three and a bit rounds
    of them, in a tensor aligned like flat (vector path), one that is not (scalar path) and
    padding between, converting or not."""
    device = "cuda"
    n = _elements_per_round(32) + 3
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    tensors = [_special_randn(2 * n, rng, gen).to(flat_dtype).to(device),
               _special_randn(n + 1, rng, gen).to(torch.bfloat16).to(device)[1:],
               _source("transposed", torch.float32, device, rng, gen)]
    offsets, total = _random_ranges([t.numel() for t in tensors], rng)
    flat = torch.full((total,), math.nan, dtype=flat_dtype, device=device)
    _assert_pack_unpack_match_reference(tensors, offsets, flat)


# ------------------------------------------------------------------------------------------------
# Argument errors: each names the offending argument.


def _adam_args(device, n=64, **changes):
    # grad of ones: a step that ran would move param, so "nothing written" is observable.
    args = dict(param=torch.zeros(n, device=device), grad=torch.ones(n, device=device),
                exp_avg=torch.zeros(n, device=device), exp_avg_sq=torch.zeros(n, device=device),
                model_copy=torch.zeros(n, dtype=torch.bfloat16, device=device), lr=1e-3,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, inv_grad_scale=1.0,
                adamw=True)
    args.update(changes)
    return args


def _call_fused_adam(a):
    ops.fused_adam(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["model_copy"],
                   lr=a["lr"], beta1=a["beta1"], beta2=a["beta2"], eps=a["eps"],
                   weight_decay=a["weight_decay"], step=a["step"],
                   inv_grad_scale=a["inv_grad_scale"], adamw=a["adamw"])


def _strided(n, dtype, device):
    return torch.zeros(2 * n, dtype=dtype, device=device)[::2]


FUSED_ADAM_ERRORS = {
    # name of the case: (argument the message must name, change to the valid arguments)
    "param-fp16": ("param", lambda d: dict(param=torch.zeros(64, dtype=torch.float16, device=d))),
    "param-strided": ("param", lambda d: dict(param=_strided(64, torch.float32, d))),
    "grad-int": ("grad", lambda d: dict(grad=torch.zeros(64, dtype=torch.int32, device=d))),
    "grad-fp64": ("grad", lambda d: dict(grad=torch.zeros(64, dtype=torch.float64, device=d))),
    "grad-numel": ("grad", lambda d: dict(grad=torch.zeros(63, device=d))),
    "grad-strided": ("grad", lambda d: dict(grad=_strided(64, torch.float16, d))),
    "exp_avg-bf16": ("exp_avg", lambda d: dict(exp_avg=torch.zeros(64, dtype=torch.bfloat16,
                                                                  device=d))),
    "exp_avg-numel": ("exp_avg", lambda d: dict(exp_avg=torch.zeros(65, device=d))),
    "exp_avg-strided": ("exp_avg", lambda d: dict(exp_avg=_strided(64, torch.float32, d))),
    "exp_avg_sq-fp16": ("exp_avg_sq", lambda d: dict(
        exp_avg_sq=torch.zeros(64, dtype=torch.float16, device=d))),
    "exp_avg_sq-numel": ("exp_avg_sq", lambda d: dict(exp_avg_sq=torch.zeros(1, device=d))),
    "exp_avg_sq-strided": ("exp_avg_sq", lambda d: dict(exp_avg_sq=_strided(64, torch.float32,
                                                                            d))),
    "model_copy-int": ("model_copy", lambda d: dict(
        model_copy=torch.zeros(64, dtype=torch.int16, device=d))),
    "model_copy-numel": ("model_copy", lambda d: dict(
        model_copy=torch.zeros(0, dtype=torch.float16, device=d))),
    "model_copy-strided": ("model_copy", lambda d: dict(
        model_copy=_strided(64, torch.bfloat16, d))),
    "step-0": ("step", lambda d: dict(step=0)),
    "lr-negative": ("lr", lambda d: dict(lr=-1e-3)),
    "beta1-1": ("beta1", lambda d: dict(beta1=1.0)),
    "beta1-negative": ("beta1", lambda d: dict(beta1=-0.1)),
    "beta2-1": ("beta2", lambda d: dict(beta2=1.0)),
    "eps-negative": ("eps", lambda d: dict(eps=-1e-8)),
    "weight_decay-negative": ("weight_decay", lambda d: dict(weight_decay=-0.1)),
    "inv_grad_scale-inf": ("inv_grad_scale", lambda d: dict(inv_grad_scale=math.inf)),
    "inv_grad_scale-nan": ("inv_grad_scale", lambda d: dict(inv_grad_scale=math.nan)),
}


@pytest.mark.parametrize("case", list(FUSED_ADAM_ERRORS))
def test_fused_adam_rejects(device, case):
    name, change = FUSED_ADAM_ERRORS[case]
    args = _adam_args(device, **change(device))
    before = args["param"].clone()
    # The message starts with the argument it is about (\b: "exp_avg" must not match
    # "exp_avg_sq").
    with pytest.raises(RuntimeError, match=rf"zerocore\.fused_adam: {name}\b"):
        _call_fused_adam(args)
    assert torch.equal(args["param"], before), "nothing may be written before the checks pass"


GRAD_STATS_ERRORS = {
    "grad-int": ("grad", lambda d: dict(grad=torch.zeros(8, dtype=torch.int32, device=d))),
    "grad-fp64": ("grad", lambda d: dict(grad=torch.zeros(8, dtype=torch.float64, device=d))),
    "grad-strided": ("grad", lambda d: dict(grad=_strided(8, torch.float32, d))),
    "stats-shape3": ("stats", lambda d: dict(stats=torch.zeros(3, device=d))),
    "stats-shape1x2": ("stats", lambda d: dict(stats=torch.zeros(1, 2, device=d))),
    "stats-fp64": ("stats", lambda d: dict(stats=torch.zeros(2, dtype=torch.float64, device=d))),
    "stats-strided": ("stats", lambda d: dict(stats=_strided(2, torch.float32, d))),
}


@pytest.mark.parametrize("case", list(GRAD_STATS_ERRORS))
def test_grad_stats_rejects(device, case):
    name, change = GRAD_STATS_ERRORS[case]
    args = dict(grad=torch.ones(8, device=device), stats=torch.zeros(2, device=device))
    args.update(change(device))
    with pytest.raises(RuntimeError, match=rf"zerocore\.grad_stats: {name}\b"):
        ops.grad_stats(args["grad"], args["stats"])


def _pack_case(device):
    """Valid pack/unpack arguments: flat of 20, tensors at [0, 6) and [10, 14)."""
    return ([torch.ones(2, 3, device=device), torch.ones(4, dtype=torch.float16, device=device)],
            [0, 10], torch.zeros(20, device=device))


PACK_ERRORS = {
    # case: (regex the message must match after "zerocore.<op>: ", change to (tensors, offsets,
    # flat))
    "offsets-count": (r"got 2 tensors but 3 offsets", lambda t, o, f: (t, o + [15], f)),
    "overlap": (r"tensors\[1\] at offset 5 overlaps", lambda t, o, f: (t, [0, 5], f)),
    "overlap-reversed": (r"tensors\[0\] at offset 12 overlaps",
                         lambda t, o, f: (t, [12, 9], f)),
    "past-end": (r"tensors\[1\] \(4 elements at offset 17\) does not fit",
                 lambda t, o, f: (t, [0, 17], f)),
    "negative-offset": (r"tensors\[0\] .*does not fit", lambda t, o, f: (t, [-1, 10], f)),
    "tensor-int": (r"tensors\[2\] must be float32, float16 or bfloat16",
                   lambda t, o, f: (t + [torch.ones(2, dtype=torch.int64, device=f.device)],
                                    o + [16], f)),
    "tensor-fp64": (r"tensors\[0\] must be float32",
                    lambda t, o, f: ([t[0].double(), t[1]], o, f)),
    "flat-int": (r"flat must be float32", lambda t, o, f: (t, o, f.int())),
    "flat-2d": (r"flat must be a contiguous 1-D tensor", lambda t, o, f: (t, o, f.view(4, 5))),
    "flat-strided": (r"flat must be a contiguous 1-D tensor",
                     lambda t, o, f: (t, o, _strided(20, torch.float32, f.device))),
}


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("case", list(PACK_ERRORS))
def test_pack_unpack_reject(device, case, op):
    pattern, change = PACK_ERRORS[case]
    tensors, offsets, flat = change(*_pack_case(device))
    with pytest.raises(RuntimeError, match=rf"zerocore\.{op}: {pattern}"):
        if op == "pack":
            ops.pack(tensors, offsets, flat)
        else:
            ops.unpack(flat, offsets, tensors)


def test_pack_accepts_empty_tensor_anywhere(device):
    """An empty tensor covers nothing: any offset up to flat's end is fine, even inside another
    tensor's range."""
    tensors, _, flat = _pack_case(device)
    tensors.append(torch.ones(0, 3, device=device))
    for where in (0, 3, 20):
        ops.pack(tensors, [0, 10, where], flat)
        ops.unpack(flat, [0, 10, where], tensors)
    with pytest.raises(RuntimeError, match=r"tensors\[2\] \(0 elements at offset 21\)"):
        ops.pack(tensors, [0, 10, 21], flat)


# Device mismatches. On a machine with a GPU these are real CPU/CUDA mixes; on any machine the
# CPU kernel is also called directly (redispatch) with one argument on the meta device, which
# reaches the same shared checks without needing a second real device.
def _on_other_device(device: str) -> tuple[str, torch._C.DispatchKeySet | None]:
    if device == "cuda":
        return "cpu", None
    return "meta", torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _call(op, keyset, *args):
    if keyset is None:
        op(*args)
    else:
        op.redispatch(keyset, *args)


@pytest.mark.parametrize("name", ["grad", "exp_avg", "exp_avg_sq", "model_copy"])
def test_fused_adam_rejects_other_device(device, name):
    other, keyset = _on_other_device(device)
    a = _adam_args(device)
    a[name] = a[name].to(other)
    with pytest.raises(RuntimeError, match=rf"zerocore\.fused_adam: {name} is on {other}"):
        _call(torch.ops.zerocore.fused_adam.default, keyset, a["param"], a["grad"], a["exp_avg"],
              a["exp_avg_sq"], a["model_copy"], a["lr"], a["beta1"], a["beta2"], a["eps"],
              a["weight_decay"], a["step"], a["inv_grad_scale"], a["adamw"])


def test_grad_stats_and_pack_reject_other_device(device):
    other, keyset = _on_other_device(device)
    with pytest.raises(RuntimeError, match=rf"zerocore\.grad_stats: stats is on {other}"):
        _call(torch.ops.zerocore.grad_stats.default, keyset, torch.ones(4, device=device),
              torch.zeros(2, device=other))
    tensors, offsets, flat = _pack_case(device)
    tensors[1] = tensors[1].to(other)
    with pytest.raises(RuntimeError, match=rf"zerocore\.pack: tensors\[1\] is on {other}"):
        _call(torch.ops.zerocore.pack.default, keyset, tensors, offsets, flat)
    with pytest.raises(RuntimeError, match=rf"zerocore\.unpack: tensors\[1\] is on {other}"):
        _call(torch.ops.zerocore.unpack.default, keyset, flat, offsets, tensors)


# ------------------------------------------------------------------------------------------------
# torch.library.opcheck and torch.compile


def _opcheck_cases(device):
    n = 1001
    p, m, v = randn(n, 1, device), randn(n, 2, device) * 0.1, randn(n, 3, device).square()
    g16 = randn(n, 4, device).half()
    copy = torch.empty(n, dtype=torch.bfloat16, device=device)
    adam = torch.ops.zerocore.fused_adam.default
    mixed = [randn((3, 4), 5, device).t(), randn(7, 6, device).half(),
             randn(5, 7, device).bfloat16(), torch.ones((), device=device)]
    outs = [torch.empty(4, 3, device=device).t(),
            torch.empty(7, dtype=torch.float16, device=device),
            torch.empty(5, dtype=torch.bfloat16, device=device), torch.empty((), device=device)]
    return {
        "fused_adam-adamw-copy": (adam, (p, g16, m, v, copy, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3,
                                         0.5, True)),
        "fused_adam-adam-nocopy": (adam, (p, g16.float(), m, v, None, 1e-3, 0.9, 0.999, 1e-8,
                                          0.01, 1, 1.0, False)),
        "grad_stats": (torch.ops.zerocore.grad_stats.default,
                       (randn(n, 6, device).bfloat16(), torch.zeros(2, device=device))),
        "pack": (torch.ops.zerocore.pack.default,
                 (mixed, [30, 0, 20, 13], torch.empty(45, device=device))),
        "unpack": (torch.ops.zerocore.unpack.default,
                   (randn(45, 8, device).half(), [30, 0, 20, 13], outs)),
    }


@pytest.mark.parametrize("case", ["fused_adam-adamw-copy", "fused_adam-adam-nocopy", "grad_stats",
                                  "pack", "unpack"])
def test_opcheck(device, case):
    op, args = _opcheck_cases(device)[case]
    # All default sub-tests (schema, autograd registration, fake tensor, aot_dispatch_dynamic).
    torch.library.opcheck(op, args)


def _compiled_step(p, g, m, v, copy, stats, tensors, offsets, flat, outs):
    ops.fused_adam(p, g, m, v, copy, lr=1e-3, weight_decay=0.01, step=3, inv_grad_scale=0.5)
    ops.grad_stats(g, stats)
    ops.pack(tensors, offsets, flat)
    ops.unpack(flat, offsets, outs)


# Raised by torch's own modules as inductor imports them (torch.utils.mkldnn), not by zerocore.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph(device):
    """The ops trace into one graph (fake implementations, mutation annotations) and the compiled
    function mutates its arguments exactly as eager does. No pointwise ops in the graph, so
    inductor has no C++ to compile and the test stays fast."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001  (any failure to find a compiler)
        pytest.skip(f"inductor has no C++ compiler here: {e}")
    n = 3001

    def make_args():
        return ([randn(n, 1, device), randn(n, 2, device).half(), randn(n, 3, device) * 0.1,
                 randn(n, 4, device).square(), torch.empty(n, dtype=torch.bfloat16,
                                                            device=device),
                 torch.zeros(2, device=device),
                 [randn((5, 3), 5, device).t(), randn(7, 6, device).bfloat16()],
                 [9, 0], torch.full((30,), math.nan, device=device),
                 [torch.empty(3, 5, device=device), torch.empty(7, dtype=torch.float16,
                                                                 device=device)]])

    eager, compiled = make_args(), make_args()
    torch._dynamo.reset()
    _compiled_step(*eager)
    torch.compile(_compiled_step, fullgraph=True)(*compiled)
    for a, b in zip(eager, compiled):
        if isinstance(a, list):
            for x, y in zip(a, b):
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x, y)
        else:
            assert torch.equal(a, b)


def _step_between_reads(p, g, m, v, copy, stats):
    g2 = g * 2.0  # made inside the graph, then consumed by the op
    ops.fused_adam(p, g2, m, v, copy, lr=1e-3, weight_decay=0.01, step=2, inv_grad_scale=0.25)
    ops.grad_stats(g2, stats)
    # Reads after the op must see its writes: with a wrong mutation annotation in the schema
    # the traced graph would read p and copy from before the step.
    return p.sum(), copy.float().sum(), stats * 1.0


def test_torch_compile_orders_reads_after_writes(device):
    """Through dynamo and AOT autograd (functionalization of the in-place ops) with pointwise
    ops before and after; the aot_eager backend runs the graph without inductor's C++ build."""
    def make_args():
        return [randn(2049, 1, device), randn(2049, 2, device).bfloat16(),
                torch.zeros(2049, device=device), torch.zeros(2049, device=device),
                torch.zeros(2049, dtype=torch.float16, device=device),
                torch.zeros(2, device=device)]

    eager, compiled = make_args(), make_args()
    torch._dynamo.reset()
    want = _step_between_reads(*eager)
    got = torch.compile(_step_between_reads, backend="aot_eager", fullgraph=True)(*compiled)
    for a, b in zip(list(want) + eager, list(got) + compiled):
        assert torch.equal(a, b)
