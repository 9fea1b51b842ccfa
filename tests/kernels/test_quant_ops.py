"""Tests of the blockwise int8 quantization ops, ``zerocore.ops.quantize_blockwise`` and
``dequantize_blockwise_``.

Both kernels are compared bit for bit with their plain-PyTorch definitions in
``zerocore.reference`` on fresh random inputs: odd numbers of blocks, block sizes from 1 to 256,
values spread over several orders of magnitude, all-zero blocks, every input and output dtype, and
outputs that are misaligned slices of larger buffers. Then: the round trip's error stays within the
bound that follows from each block's absmax, ties round half to even, non-finite inputs and
malformed arguments raise errors that say what was wrong, ``torch.library.opcheck`` passes and the
ops work under ``torch.compile``. Every device-taking test runs on the CPU and, when a GPU is
present, on CUDA (see conftest.py); one more CUDA test goes past one grid and requires the CPU's
bits.

Inputs come from seeded generators, so every failure reproduces.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import zerocore  # noqa: F401  (registers torch.ops.zerocore)
from tests.support.bits import assert_bits_equal, assert_within, bits, half_ulp
from zerocore.kernels import ops, reference

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# 64, 128, 256: the sizes an engine would use; 1, 3 and 127: no vector step at all, or a scalar
# tail after each (the CPU kernels step 16 elements at a time, the CUDA ones 8), and block
# boundaries that fall anywhere inside a vector step.
BLOCKS = [1, 3, 64, 127, 128, 256]
# Odd numbers of blocks; the last gives 100k-300k elements, several 32768-element pieces for the
# CPU threads, ending inside one.
BLOCK_COUNTS = {"1": lambda block: 1, "7": lambda block: 7,
                "many": lambda block: (200_001 // block) | 1}

# Elements of NaN left after every output view: more than one vector step, so a kernel that
# writes a whole step past the end is caught.
SLACK = 19

F32_UNIT_ROUNDOFF = 2.0 ** -24  # relative error of one correctly rounded float32 operation


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _values(n_blocks: int, block: int, seed: int, dtype: torch.dtype,
            device: str) -> torch.Tensor:
    """n_blocks * block values like the weights of a real model, in dtype: each block at its own
    level, log-uniform from 1e-5 to 1e3 (1e1 for fp16, whose largest value is 65504), each element
    within 1e-3 to 1 of its block's level, with random signs; every fifth block (the third, eighth,
    ...) is all zeros."""
    g = torch.Generator().manual_seed(seed)
    top = 1.0 if dtype == torch.float16 else 3.0
    level = 10.0 ** (torch.rand(n_blocks, generator=g, dtype=torch.float64) * (top + 5) - 5)
    within = 10.0 ** (torch.rand(n_blocks, block, generator=g, dtype=torch.float64) * 3 - 3)
    sign = torch.where(torch.rand(n_blocks, block, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * within * level[:, None]
    x[2::5] = 0.0
    return x.reshape(-1).to(dtype).to(device)


def _placed(n: int, dtype: torch.dtype, offset: int, device: str, fill=math.nan):
    """(buffer, view): a view of n elements at buffer[offset:], everything else `fill`. offset > 0
    gives a view that is not 16-byte aligned."""
    buf = torch.full((offset + n + SLACK,), fill, dtype=dtype, device=device)
    return buf, buf[offset:offset + n]


# assert_bits_equal has no tolerance: the kernels and the references perform the same correctly
# rounded IEEE operations (divisions, products, conversions to nearest even), so any difference
# is a bug.


def _cases():
    for block in BLOCKS:
        for count_id, count in BLOCK_COUNTS.items():
            yield pytest.param(block, count(block), id=f"block{block}-x{count_id}")


# ------------------------------------------------------------------------------------------------
# Against the references


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block,n_blocks", list(_cases()))
def test_quantize_matches_reference(device, block, n_blocks, dtype):
    x = _values(n_blocks, block, _seed("quantize", block, n_blocks, dtype), dtype, device)
    q, scales = ops.quantize_blockwise(x, block)
    want_q, want_scales = reference.quantize_blockwise(x, block)
    assert q.device == x.device and scales.device == x.device
    assert_bits_equal(scales, want_scales, "scales")
    assert_bits_equal(q, want_q, "q")
    if n_blocks > 2:  # block 2 is all zeros (see _values)
        assert scales[2].item() == 0.0 and not q[2 * block:3 * block].any()


# (offset of out in its buffer, offset of q in its buffer), in elements: aligned; out at 1, 3, 5
# (misaligned for every vector width) with q aligned or misaligned differently; both at 3 (the
# CUDA kernel's 8-byte loads of q come back once both line up).
LAYOUTS = {"aligned": (0, 0), "out1": (1, 0), "out3-q3": (3, 3), "out5-q1": (5, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block,n_blocks", list(_cases()))
def test_dequantize_matches_reference(device, block, n_blocks, out_dtype, layout):
    out_offset, q_offset = LAYOUTS[layout]
    x = _values(n_blocks, block, _seed("dequantize", block, n_blocks), torch.float32, device)
    q_values, scales = reference.quantize_blockwise(x, block)
    n = q_values.numel()
    q_buf = torch.full((q_offset + n + SLACK,), 99, dtype=torch.int8, device=device)
    q = q_buf[q_offset:q_offset + n]
    q.copy_(q_values)
    buf, out = _placed(n, out_dtype, out_offset, device)
    assert ops.dequantize_blockwise_(out, q, scales, block) is out
    assert_bits_equal(out, reference.dequantize_blockwise(q, scales, block, out_dtype),
                       "dequantized")
    assert torch.isnan(buf[:out_offset]).all() and torch.isnan(buf[out_offset + n:]).all(), \
        "the kernel wrote outside out"
    functional = ops.dequantize_blockwise(q, scales, block, out_dtype)
    assert_bits_equal(functional, out, "functional form")


# The CPU kernels use streaming stores with a scalar head up to the first 32-byte boundary once
# a call touches more than 32 MiB (kStreamingMinBytes in csrc/cpu/vec_io.h); this goes past it.
@pytest.mark.parametrize("out_offset", [0, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_dequantize_large(device, out_dtype, out_offset):
    block = 128
    n = 128 * 110_001  # 14.1M elements: > 32 MiB touched with either output dtype
    g = torch.Generator().manual_seed(_seed("large", out_dtype, out_offset))
    q = torch.randint(-127, 128, (n,), generator=g, dtype=torch.int8).to(device)
    scales = (torch.rand(n // block, generator=g) * 1e-2).to(device)
    buf, out = _placed(n, out_dtype, out_offset, device)
    ops.dequantize_blockwise_(out, q, scales, block)
    assert_bits_equal(out, reference.dequantize_blockwise(q, scales, block, out_dtype),
                       "dequantized")
    assert torch.isnan(buf[:out_offset]).all() and torch.isnan(buf[out_offset + n:]).all()


# ------------------------------------------------------------------------------------------------
# What the numbers mean


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block", [3, 64, 128, 256])
def test_round_trip_error_bound(device, block, in_dtype, out_dtype):
    """|x - dequantize(quantize(x))| within the bound that follows from each block's scale s =
    absmax / 127, element by element:

    - s / 2: rounding x / s to an integer (no clamping happens: |x| <= absmax, so x / s is at most
      127 by more than a rounding error);
    - 128 * 2^-24 * s: x / s is rounded to float32 before it is rounded to an integer, which moves
      it by at most 2^-24 of its size, at most ~127.5;
    - 127 * 2^-24 * s: the product q * s is rounded to float32 (|q| <= 127);
    - half an ulp of the result in out_dtype: the product's single rounding to out_dtype (0 for
      float32 outputs, whose rounding is the previous term).

    _values keeps every nonzero scale a normal float32, where the relative roundings above hold.
    """
    n_blocks = 2 * (50_001 // block) + 1
    x = _values(n_blocks, block, _seed("bound", block, in_dtype, out_dtype), in_dtype, device)
    q, scales = ops.quantize_blockwise(x, block)
    out = ops.dequantize_blockwise(q, scales, block, out_dtype)
    s = scales.double().repeat_interleave(block)
    bound = s * (0.5 + (128 + 127) * F32_UNIT_ROUNDOFF)
    if out_dtype != torch.float32:
        bound = bound + half_ulp(out, out_dtype)
    assert_within(x, out, bound)
    # Zero blocks (bound 0) stay exactly zero.
    assert not out.view(-1, block)[2::5].any()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_ties_round_half_to_even(device, dtype):
    """x / scale exactly halfway between two integers rounds to the even one, in the vector steps
    and in the tail (19 = 16 + 3 elements per block), at scale 1 and 2, for negative values too,
    and a block's largest value is its own sign times 127."""
    halves = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 4.5, 5.5, -3.5, 7.5,
              0.25, -0.75, 2.5, -2.5, 1.5]
    block = len(halves)
    values = torch.tensor(halves + [2 * v for v in halves] + [-v for v in halves],
                          dtype=torch.float64)
    x = values.to(dtype).to(device)
    assert torch.equal(x.double().cpu(), values), "the test values must be exact in every dtype"
    q, scales = ops.quantize_blockwise(x, block)
    assert scales.tolist() == [1.0, 2.0, 1.0]
    # Python's round() rounds half to even.
    want = [round(v) for v in halves] * 2 + [-round(v) for v in halves]
    assert q.tolist() == want


def test_all_zero_and_tiny_blocks(device):
    """A block of zeros (signed or not) has scale 0 and q 0 and dequantizes to +0.0. A block
    whose absmax / 127 underflows to 0 in float32 (absmax below 2^-143) is quantized the same
    way; one whose scale is a subnormal float32 matches the reference bit for bit."""
    tiny = torch.finfo(torch.float32).smallest_normal  # 2^-126
    blocks = [
        [0.0] * 16,
        [-0.0] * 16,
        [2.0 ** -149, -2.0 ** -148] + [0.0] * 14,   # absmax / 127 underflows to 0
        [tiny * 0.5, -tiny * 0.3] + [tiny * 0.01 * k for k in range(14)],  # subnormal scale
        [tiny, -tiny * 0.7] + [tiny * 0.1] * 14,  # subnormal scale, normal values
    ]
    x = torch.tensor(sum(blocks, []), dtype=torch.float32, device=device)
    q, scales = ops.quantize_blockwise(x, 16)
    want_q, want_scales = reference.quantize_blockwise(x, 16)
    assert_bits_equal(scales, want_scales, "scales")
    assert_bits_equal(q, want_q, "q")
    assert scales[:3].tolist() == [0.0, 0.0, 0.0] and not q[:48].any()
    assert 0 < scales[3].item() < tiny and 0 < scales[4].item() < tiny
    for dtype in FLOAT_DTYPES:
        out = ops.dequantize_blockwise(q, scales, 16, dtype)
        assert_bits_equal(out, reference.dequantize_blockwise(q, scales, 16, dtype),
                           f"dequantized to {DTYPE_IDS[dtype]}")
        assert not torch.signbit(out[:48]).any(), "zero blocks dequantize to +0.0"


def test_empty(device):
    q, scales = ops.quantize_blockwise(torch.empty(0, device=device), 128)
    assert q.shape == (0,) and q.dtype == torch.int8 and scales.shape == (0,)
    out = torch.empty(0, dtype=torch.bfloat16, device=device)
    ops.dequantize_blockwise_(out, q, scales, 128)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("position", [0, 17, 34], ids=["first", "vector", "tail"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_quantize_rejects_nonfinite(device, dtype, position, value):
    """An inf or nan anywhere in a block (its first element, inside a vector step after larger
    finite values, in the scalar tail: 35 = 2 * 16 + 3) is reported with the block it is in;
    the max that finds the absmax must not drop a NaN."""
    block = 35
    x = _values(5, block, _seed("nonfinite", dtype), dtype, device)
    x[3 * block + position] = value
    with pytest.raises(RuntimeError, match=r"zerocore\.quantize_blockwise: x has an inf or nan in "
                                           r"block 3 \(elements 105 to 139\)"):
        ops.quantize_blockwise(x, block)
    with pytest.raises(ValueError, match="inf or nan"):
        reference.quantize_blockwise(x, block)


# ------------------------------------------------------------------------------------------------
# Argument errors: each names the offending argument.

QUANTIZE_ERRORS = {
    # case: (regex the message must match after "zerocore.quantize_blockwise: ", (x, block))
    "x-int": (r"x must be float32, float16 or bfloat16, got Int",
              lambda d: (torch.zeros(256, dtype=torch.int32, device=d), 128)),
    "x-fp64": (r"x must be float32, float16 or bfloat16, got Double",
               lambda d: (torch.zeros(256, dtype=torch.float64, device=d), 128)),
    "x-int8": (r"x must be float32",
               lambda d: (torch.zeros(256, dtype=torch.int8, device=d), 128)),
    "x-2d": (r"x must be a contiguous 1-D tensor, got shape \[2, 128\]",
             lambda d: (torch.zeros(2, 128, device=d), 128)),
    "x-strided": (r"x must be a contiguous 1-D tensor",
                  lambda d: (torch.zeros(512, device=d)[::2], 128)),
    "block-0": (r"block must be >= 1, got 0", lambda d: (torch.zeros(256, device=d), 0)),
    "block-negative": (r"block must be >= 1, got -128",
                       lambda d: (torch.zeros(256, device=d), -128)),
    "not-a-multiple": (r"x has 300 elements, not a multiple of block = 128",
                       lambda d: (torch.zeros(300, device=d), 128)),
}


@pytest.mark.parametrize("case", list(QUANTIZE_ERRORS))
def test_quantize_rejects(device, case):
    pattern, make = QUANTIZE_ERRORS[case]
    x, block = make(device)
    with pytest.raises(RuntimeError, match=rf"zerocore\.quantize_blockwise: {pattern}"):
        ops.quantize_blockwise(x, block)


def _dequantize_args(device):
    """Valid arguments: 3 blocks of 64."""
    return dict(out=torch.zeros(192, dtype=torch.bfloat16, device=device),
                q=torch.ones(192, dtype=torch.int8, device=device),
                scales=torch.ones(3, device=device), block=64)


DEQUANTIZE_ERRORS = {
    # case: (regex the message must match after "zerocore.dequantize_blockwise_: ", changes)
    "out-int": (r"out must be float32, float16 or bfloat16, got Int",
                lambda d: dict(out=torch.zeros(192, dtype=torch.int32, device=d))),
    "out-fp64": (r"out must be float32, float16 or bfloat16, got Double",
                 lambda d: dict(out=torch.zeros(192, dtype=torch.float64, device=d))),
    "out-strided": (r"out must be contiguous",
                    lambda d: dict(out=torch.zeros(384, device=d)[::2])),
    "out-numel": (r"out has 191 elements but q has 192",
                  lambda d: dict(out=torch.zeros(191, device=d))),
    "q-fp32": (r"q must be int8, got Float", lambda d: dict(q=torch.ones(192, device=d))),
    "q-uint8": (r"q must be int8, got Byte",
                lambda d: dict(q=torch.ones(192, dtype=torch.uint8, device=d))),
    "q-2d": (r"q must be a contiguous 1-D tensor, got shape \[3, 64\]",
             lambda d: dict(q=torch.ones(3, 64, dtype=torch.int8, device=d))),
    "q-strided": (r"q must be a contiguous 1-D tensor",
                  lambda d: dict(q=torch.ones(384, dtype=torch.int8, device=d)[::2])),
    "q-not-a-multiple": (r"q has 200 elements, not a multiple of block = 64",
                         lambda d: dict(q=torch.ones(200, dtype=torch.int8, device=d),
                                        out=torch.zeros(200, device=d))),
    "scales-bf16": (r"scales must be float32, got BFloat16",
                    lambda d: dict(scales=torch.ones(3, dtype=torch.bfloat16, device=d))),
    "scales-2d": (r"scales must be a contiguous 1-D tensor, got shape \[3, 1\]",
                  lambda d: dict(scales=torch.ones(3, 1, device=d))),
    "scales-strided": (r"scales must be a contiguous 1-D tensor",
                       lambda d: dict(scales=torch.ones(6, device=d)[::2])),
    "scales-count": (r"scales has 4 elements but q has 3 blocks of 64; pass one scale per block",
                     lambda d: dict(scales=torch.ones(4, device=d))),
    "block-0": (r"block must be >= 1, got 0", lambda d: dict(block=0)),
}


@pytest.mark.parametrize("case", list(DEQUANTIZE_ERRORS))
def test_dequantize_rejects(device, case):
    pattern, change = DEQUANTIZE_ERRORS[case]
    args = _dequantize_args(device)
    args.update(change(device))
    before = args["out"].clone()
    with pytest.raises(RuntimeError, match=rf"zerocore\.dequantize_blockwise_: {pattern}"):
        ops.dequantize_blockwise_(args["out"], args["q"], args["scales"], args["block"])
    assert torch.equal(args["out"], before), "nothing may be written before the checks pass"


def test_dequantize_accepts_any_contiguous_shape(device):
    """out only needs q's number of elements: a parameter's 2-D view of a flat buffer will do."""
    a = _dequantize_args(device)
    out = torch.empty(3, 64, device=device)
    ops.dequantize_blockwise_(out, a["q"], a["scales"], a["block"])
    assert torch.equal(out, torch.ones(3, 64, device=device))


# Device mismatches, as in test_ops.py: on a machine with a GPU, a real CPU/CUDA mix; on any
# machine, the CPU kernel called directly (redispatch) with one argument on the meta device, which
# reaches the same shared checks.
@pytest.mark.parametrize("name", ["q", "scales"])
def test_dequantize_rejects_other_device(device, name):
    other, keyset = ("cpu", None) if device == "cuda" else (
        "meta", torch._C.DispatchKeySet(torch._C.DispatchKey.CPU))
    a = _dequantize_args(device)
    a[name] = a[name].to(other)
    op = torch.ops.zerocore.dequantize_blockwise_.default
    args = (a["out"], a["q"], a["scales"], a["block"])
    with pytest.raises(RuntimeError,
                       match=rf"zerocore\.dequantize_blockwise_: {name} is on {other}"):
        if keyset is None:
            op(*args)
        else:
            op.redispatch(keyset, *args)


# ------------------------------------------------------------------------------------------------
# torch.library.opcheck and torch.compile


def _opcheck_cases(device):
    x = _values(5, 128, 1, torch.bfloat16, device)
    q, scales = reference.quantize_blockwise(x, 128)
    _, out = _placed(q.numel(), torch.float16, 3, device)
    return {
        "quantize-bf16-128": (torch.ops.zerocore.quantize_blockwise.default, (x, 128)),
        "quantize-fp32-3": (torch.ops.zerocore.quantize_blockwise.default,
                            (_values(7, 3, 2, torch.float32, device), 3)),
        "dequantize-fp16-misaligned": (torch.ops.zerocore.dequantize_blockwise_.default,
                                       (out, q, scales, 128)),
        "dequantize-fp32": (torch.ops.zerocore.dequantize_blockwise_.default,
                            (torch.empty(q.numel(), device=device), q, scales, 128)),
    }


@pytest.mark.parametrize("case", ["quantize-bf16-128", "quantize-fp32-3",
                                  "dequantize-fp16-misaligned", "dequantize-fp32"])
def test_opcheck(device, case):
    op, args = _opcheck_cases(device)[case]
    # All default sub-tests (schema, autograd registration, fake tensor, aot_dispatch_dynamic).
    torch.library.opcheck(op, args)


def _gather_and_widen(x, flat, offset: int, block: int):
    """What the engine will do after a gather: quantized weights widened into their slice of
    the flat buffer."""
    q, scales = ops.quantize_blockwise(x, block)
    ops.dequantize_blockwise_(flat[offset:offset + x.numel()], q, scales, block)
    return q, scales


# Raised by torch's own modules as inductor imports them (torch.utils.mkldnn), not by zerocore.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph(device):
    """Both ops trace into one graph (fake implementations, the mutation annotation on out) and
    the compiled function gives eager's results and writes eager's slice of the buffer. No
    pointwise ops in the graph, so inductor has no C++ to compile and the test stays fast."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001  (any failure to find a compiler)
        pytest.skip(f"inductor has no C++ compiler here: {e}")
    x = _values(9, 64, 3, torch.bfloat16, device)
    flats = [torch.full((x.numel() + 10,), math.nan, dtype=torch.bfloat16, device=device)
             for _ in range(2)]
    torch._dynamo.reset()
    want = _gather_and_widen(x, flats[0], 5, 64)
    got = torch.compile(_gather_and_widen, fullgraph=True)(x, flats[1], 5, 64)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert torch.equal(bits(flats[0]), bits(flats[1]))


def _widen_then_read(x, flat):
    q, scales = ops.quantize_blockwise(x * 2.0, 128)  # input made inside the graph
    ops.dequantize_blockwise_(flat[1:1 + x.numel()], q, scales, 128)
    # Reads after the op must see its write: with a wrong mutation annotation the traced graph
    # would read flat from before it.
    return flat.float().nansum(), scales * 1.0


def test_torch_compile_orders_reads_after_writes(device):
    """Through dynamo and AOT autograd (functionalization of the in-place op) with pointwise ops
    before and after; the aot_eager backend runs the graph without inductor's C++ build."""
    x = _values(3, 128, 4, torch.float32, device)
    flats = [torch.full((x.numel() + 2,), math.nan, dtype=torch.float16, device=device)
             for _ in range(2)]
    torch._dynamo.reset()
    want = _widen_then_read(x, flats[0])
    got = torch.compile(_widen_then_read, backend="aot_eager", fullgraph=True)(x, flats[1])
    for a, b in zip(list(want) + flats[:1], list(got) + flats[1:]):
        assert torch.equal(bits(a), bits(b))


# ------------------------------------------------------------------------------------------------
# CUDA past one grid. Each kernel's grid is at most what the device runs of it at once
# (csrc/cuda/cuda_common.cuh); past that, the grid-stride loops go round again. These go several
# rounds, end in a partial one, and require the CPU kernels' bits.


def _elements_per_round(per_thread: int) -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    return props.multi_processor_count * threads_per_sm * per_thread


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block", [3, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_equals_cpu_past_one_grid(block, layout):
    """Quantization takes one warp per block (so at least 3 rounds of blocks of 128), the
    vector dequantization 8 elements per thread, the scalar one (block 3) one."""
    n_blocks = 3 * _elements_per_round(8) // 32 + 5
    out_offset, q_offset = LAYOUTS[layout]
    x = _values(n_blocks, block, _seed("grid", block), torch.bfloat16, "cpu")
    results = {}
    for device in ("cpu", "cuda"):
        q, scales = ops.quantize_blockwise(x.to(device), block)
        n = q.numel()
        q_buf = torch.zeros(q_offset + n, dtype=torch.int8, device=device)
        q_buf[q_offset:].copy_(q)
        buf, out = _placed(n, torch.bfloat16, out_offset, device)
        ops.dequantize_blockwise_(out, q_buf[q_offset:], scales, block)
        results[device] = (q, scales, buf)
    for name, a, b in zip(["q", "scales", "dequantized buffer"], results["cpu"], results["cuda"]):
        assert_bits_equal(b.cpu(), a, f"{name}: CUDA against CPU")
