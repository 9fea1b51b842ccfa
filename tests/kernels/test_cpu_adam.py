"""The CPU fused Adam's instruction-set paths (csrc/cpu/fused_adam_{scalar,avx2,avx512}.cpp).

zerocore.fused_adam on the CPU runs one of several compiled kernels, chosen at run time: the widest
this CPU supports, or the one forced with ``ZEROCORE_CPU_ISA`` or the test hook
``zerocore.ops._cpu_adam_isa``. Every path must compute the same bits: as the exact float32 replay
of the kernel's arithmetic (tests/support/exact_adam.py ``exact_adam``, the CUDA kernel's
arithmetic too), with the model copy exactly ``param.to(copy dtype)``, whatever the size, the
alignment of each argument and the number of threads. Here each path the host can run is forced in
turn; paths the host cannot run (AVX-512 on an AVX2-only CPU) are skipped with the reason. No
tolerance anywhere: every comparison is bitwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import zlib

import pytest
import torch

import zerocore  # noqa: F401  (registers torch.ops.zerocore)
from zerocore.kernels import ops
from zerocore.kernels._extension import _cpu_flags
from tests.support.exact_adam import HYPER, assert_slack_untouched, exact_adam, placed, randn

ALL_ISAS = ["scalar", "avx2", "avx512"]
RUNNABLE = ops._cpu_adam_isas()
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", None: "none"}

# 1, 15, 17: no whole block, just under and over one AVX2 block (16), 31 and 33 the same for
# AVX-512 (32); 278011: many thread pieces, each with a head and a tail off the block grid.
SIZES = [1, 15, 17, 31, 33, 278011]
THREADS = [1, 2, 3]


def _isa_param(isa: str):
    return pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        isa not in RUNNABLE, reason=f"this CPU/build cannot run the {isa} kernels "
                                    f"(runnable: {RUNNABLE})"))


ISAS = [_isa_param(i) for i in ALL_ISAS]


@contextlib.contextmanager
def _using(isa: str, threads: int | None = None):
    """Forces the CPU Adam kernels of ``isa`` (and a torch thread count), restoring both after."""
    old_isa, old_threads = ops._cpu_adam_isa(), torch.get_num_threads()
    try:
        ops._cpu_adam_isa(isa)
        if threads is not None:
            torch.set_num_threads(threads)
        yield
    finally:
        ops._cpu_adam_isa(old_isa)
        torch.set_num_threads(old_threads)


def test_hook_reports_and_switches():
    assert RUNNABLE[0] == "scalar" and set(RUNNABLE) <= set(ALL_ISAS)
    assert ops._cpu_adam_isa() in RUNNABLE
    for isa in RUNNABLE:
        with _using(isa):
            assert ops._cpu_adam_isa() == isa
    with pytest.raises(RuntimeError, match="not one this CPU"):
        ops._cpu_adam_isa("sse9")


def test_default_is_the_widest_runnable_and_env_overrides():
    """A fresh process picks the widest ISA, or the one ZEROCORE_CPU_ISA names."""
    code = "from zerocore import ops; print(ops._cpu_adam_isa())"
    env = dict(os.environ)
    env.pop("ZEROCORE_CPU_ISA", None)
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                                   text=True, timeout=300)
    out = run(env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == RUNNABLE[-1]
    out = run(dict(env, ZEROCORE_CPU_ISA="scalar"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"


@pytest.mark.skipif(not _cpu_flags(), reason="needs Linux's /proc/cpuinfo")
def test_runnable_isas_agree_with_the_kernel():
    """The kernels offered are exactly those this CPU and OS can run. Linux lists a vector
    extension in /proc/cpuinfo only when the CPU has it and the kernel saves its register state
    (it clears the AVX-512 flags when XSAVE does not cover the zmm state), which is what the
    dispatch checks itself with cpuid and XGETBV."""
    flags = _cpu_flags()
    x86 = "sse2" in flags
    avx2 = x86 and {"avx2", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    expected = ["scalar"] + (["avx2"] if avx2 else []) + (["avx512"] if avx512 else [])
    assert RUNNABLE == expected


def test_env_naming_an_isa_this_cpu_cannot_run_is_refused():
    """ZEROCORE_CPU_ISA naming an unknown ISA (or one this CPU lacks) fails the first step with
    the list of those it can run, instead of running something else or crashing."""
    code = ("import torch; from zerocore import ops; "
            "ops.fused_adam(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), "
            "lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1)")
    env = dict(os.environ, ZEROCORE_CPU_ISA="avx1024")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "ZEROCORE_CPU_ISA=avx1024 is not one this CPU" in out.stderr
    assert ", ".join(RUNNABLE) in out.stderr


def _step_all(isa, threads, n, grad_dtype, copy_dtype, offsets, seed):
    """Three steps (Adam with L2 decay and a loss scale, then AdamW twice, the last with a
    clipping coefficient folded into the unscaling, so every constant of the update is exercised)
    through ``isa`` at ``threads`` threads, each compared bit for bit with the exact replay."""
    p_buf, p = placed(randn(n, seed, "cpu"), offsets[0])
    m_buf, m = placed(randn(n, seed + 1, "cpu", scale=0.1), offsets[2])
    v_buf, v = placed(randn(n, seed + 2, "cpu", scale=0.1).square(), offsets[3])
    c_buf = copy = None
    if copy_dtype is not None:
        c_buf, copy = placed(torch.zeros(n, dtype=copy_dtype), offsets[4])
    ex = [t.clone() for t in (p, m, v)]
    # (adamw, weight decay, loss scale, clip coefficient): inv_grad_scale = clip / loss_scale,
    # as zerocore.optim passes it; 0.37 is not a power of two, so the product really rounds.
    for step, (adamw, wd, loss_scale, clip) in enumerate(
            [(False, 0.1, 1024.0, 1.0), (True, 0.1, 1.0, 1.0), (True, 0.0, 8.0, 0.37)], start=1):
        g_buf, g = placed((randn(n, seed + 10 + step, "cpu") * loss_scale).to(grad_dtype),
                           offsets[1])
        kw = dict(HYPER, weight_decay=wd, step=step, inv_grad_scale=clip / loss_scale,
                  adamw=adamw)
        with _using(isa, threads):
            ops.fused_adam(p, g, m, v, copy, **kw)
        exact_adam(*ex[:1], g, *ex[1:], **kw)
        assert torch.equal(p, ex[0]), f"param differs from the exact replay at step {step}"
        assert torch.equal(m, ex[1]), f"exp_avg differs from the exact replay at step {step}"
        assert torch.equal(v, ex[2]), f"exp_avg_sq differs from the exact replay at step {step}"
        if copy is not None:
            assert torch.equal(copy, p.to(copy_dtype)), f"model copy at step {step}"
        assert_slack_untouched(g_buf, offsets[1], n)
    for buf, o in [(p_buf, offsets[0]), (m_buf, offsets[2]), (v_buf, offsets[3])]:
        assert_slack_untouched(buf, o, n)
    if c_buf is not None:
        assert_slack_untouched(c_buf, offsets[4], n)


@pytest.mark.parametrize("copy_dtype", [None] + FLOAT_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("isa", ISAS)
def test_isa_matches_exact_replay(isa, grad_dtype, copy_dtype):
    """Every size x thread count, with every argument at its own odd element offset (so no two
    share an alignment and none is 16-byte aligned) and, at the largest size, aligned too."""
    for n in SIZES:
        for threads in THREADS:
            layouts = [(1, 3, 5, 7, 9)] + ([(0, 0, 0, 0, 0)] if n == max(SIZES) else [])
            for offsets in layouts:
                seed = zlib.crc32(repr((isa, n, threads, grad_dtype, copy_dtype,
                                        offsets)).encode())
                _step_all(isa, threads, n, grad_dtype, copy_dtype, offsets, seed)


@pytest.mark.parametrize("copy_dtype", FLOAT_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("isa", ISAS)
def test_isa_streaming_model_copy(isa, copy_dtype):
    """A shard past the streaming-store threshold (32 MiB touched, kStreamingMinBytes in
    csrc/cpu/vec_io.h), the copy starting off its 64-byte grid, at 1 and 3 threads."""
    n = 1_300_007
    assert n * (24 + 2 + copy_dtype.itemsize) > 32 << 20
    for threads, offsets in [(1, (0, 0, 0, 0, 3)), (3, (1, 3, 5, 7, 1))]:
        seed = zlib.crc32(repr((isa, threads, copy_dtype)).encode())
        _step_all(isa, threads, n, torch.float16, copy_dtype, offsets, seed)


def _all_floats(n: int, seed: int) -> torch.Tensor:
    """n finite float32 values with random bit patterns: every exponent from subnormal to the
    largest, both signs, and, inserted, the rounding boundaries of fp16 (the largest finite value
    and the midpoint above it, ties between subnormals) and bf16 (a tie to even, both ways). No
    inf or NaN: the step turns an infinite param into NaN (0 * inf in the L2 term)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64)
    # An all-ones exponent (inf, NaN) -> the largest finite exponent.
    bits = torch.where((bits & 0x7f800000) == 0x7f800000, bits - 0x00800000, bits)
    x = bits.to(torch.int32).view(torch.float32).clone()
    special = torch.tensor([65504.0, 65519.996, 65520.0, 2.0**-24 * 1.5, 2.0**-24 * 2.5,
                            2.0**-24 * 0.5, 2.0**-25, 2.0**-14, 2.0**-14 * (1 - 2.0**-11),
                            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -0.0, 0.0, 1e-40, -1e-45])
    x[:special.numel()] = special
    return x


@pytest.mark.parametrize("copy_dtype", FLOAT_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("isa", ISAS)
def test_isa_model_copy_rounds_every_float_like_torch(isa, copy_dtype):
    """lr = 0 leaves param as it was, so the model copy is the conversion of arbitrary floats
    (random bit patterns, subnormals, infinities, the rounding boundaries): exactly torch's."""
    n = 100_003
    x = _all_floats(n, 7)
    p = x.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.zeros(n)
    copy = torch.empty(n, dtype=copy_dtype)
    with _using(isa):
        ops.fused_adam(p, g, m, v, copy, lr=0.0, beta1=0.9, beta2=0.999, eps=1.0,
                       weight_decay=0.0, step=1)
    # p * 1 + (-0 * (0 / 1)): param is unchanged, -0 included (-0 + -0 is -0).
    assert torch.equal(p.view(torch.int32), x.view(torch.int32))
    assert torch.equal(copy, p.to(copy_dtype)), "model copy differs from torch's conversion"


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("isa", ISAS)
def test_isa_widens_every_16bit_gradient_exactly(isa, grad_dtype):
    """Every one of the 65536 bit patterns of a 16-bit gradient (NaNs excluded) is widened
    exactly: with beta1 = 0 and inv_grad_scale = 1, exp_avg becomes 0 + 1 * (g - 0) = g."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    g = bits.view(grad_dtype)
    g = g[~torch.isnan(g)].contiguous()
    n = g.numel()
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    with _using(isa):
        ops.fused_adam(p, g, m, v, lr=1e-3, beta1=0.0, beta2=0.5, eps=1e-8, weight_decay=0.0,
                       step=1)
    expected = g.float()
    # -0 - 0 is -0 and 0 + -0 is +0: the one value that is not returned as it came.
    assert torch.equal(m[expected != 0], expected[expected != 0]) and (m[expected == 0] == 0).all()


@pytest.mark.parametrize("isa", [i for i in ISAS if i.values[0] != "scalar"])
def test_isa_nonfinite_inputs_match_scalar(isa):
    """Infinite and NaN gradients and parameters give NaN or inf in the same places as the scalar
    path (NaN payloads aside: which operand's payload propagates is the hardware's choice)."""
    n = 1000
    results = {}
    for which in ["scalar", isa]:
        g = randn(n, 3, "cpu").to(torch.float16)
        p = randn(n, 4, "cpu")
        g[::7] = float("inf")
        g[3::11] = float("nan")
        p[5::13] = float("-inf")
        m, v = torch.zeros(n), torch.zeros(n)
        copy = torch.empty(n, dtype=torch.bfloat16)
        with _using(which):
            ops.fused_adam(p, g, m, v, copy, **HYPER, weight_decay=0.1, step=1)
        results[which] = (p, m, v, copy)
    for a, b in zip(results["scalar"], results[isa]):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])
