"""Tests of the low-bit frozen-weight formats (``zerocore.kernels.formats``: NF4 and fp8 e4m3fn
by blocks) and their dequantization kernels, ``zerocore.ops.dequantize_nf4_`` and
``dequantize_fp8_``.

The quantizers are checked against the formats' definitions by brute force (the nearest code,
ties as the format says); the kernels bit for bit against ``zerocore.reference`` on fresh random
inputs of odd sizes (a few elements, one block, counts that end inside a block, 278011), every
output dtype, outputs and codes at misaligned offsets, and every CPU instruction set this machine
runs (forced through ``ops._cpu_lowbit_isa``); the round trip within the error the formats allow.
Every device-taking test runs on the CPU and, when a GPU is present, on CUDA (conftest.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import zlib

import pytest
import torch

import zerocore  # noqa: F401  (registers torch.ops.zerocore)
from tests.support.bits import assert_bits_equal, assert_within, half_ulp
from zerocore.kernels import formats, ops, reference

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FORMATS = ["nf4", "fp8"]
RUNNABLE_ISAS = ops._cpu_lowbit_isas()

# Elements of NaN after every output view: more than any vector step, so a kernel that writes a
# whole step past the end is caught.
SLACK = 37

F32_UNIT_ROUNDOFF = 2.0 ** -24  # relative error of one correctly rounded float32 operation


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


# assert_bits_equal has no tolerance: the kernels and the references compute an exact code
# value, one correctly rounded float32 product and one conversion to nearest even, so any
# difference is a bug.


@contextlib.contextmanager
def _using(isa: str):
    """Forces the CPU low-bit kernels of ``isa``, restoring the previous choice after."""
    old = ops._cpu_lowbit_isa()
    try:
        ops._cpu_lowbit_isa(isa)
        yield
    finally:
        ops._cpu_lowbit_isa(old)


def _isas(device: str) -> list[str | None]:
    """Every CPU instruction set this machine runs; on CUDA the one kernel (None)."""
    return RUNNABLE_ISAS if device == "cpu" else [None]


def _values(n: int, block: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """n values like a model's weights, in dtype: each block at its own level, log-uniform from
    1e-5 to 1e3 (1e1 for fp16), normal-distributed within it, every fifth block all zeros."""
    g = torch.Generator().manual_seed(seed)
    blocks = formats.n_blocks(n, block)
    top = 1.0 if dtype == torch.float16 else 3.0
    level = 10.0 ** (torch.rand(blocks, generator=g, dtype=torch.float64) * (top + 5) - 5)
    x = torch.randn(blocks, block, generator=g, dtype=torch.float64) * level[:, None] / 4
    x[2::5] = 0.0
    return x.reshape(-1)[:n].to(dtype).to(device)


def _quantize(fmt: str, x: torch.Tensor, block: int):
    return (formats.quantize_nf4 if fmt == "nf4" else formats.quantize_fp8)(x, block)


def _dequantize_(fmt: str, out, q, scales, block: int):
    return (ops.dequantize_nf4_ if fmt == "nf4" else ops.dequantize_fp8_)(out, q, scales, block)


def _reference(fmt: str, q, scales, n: int, block: int, dtype):
    if fmt == "nf4":
        return reference.dequantize_nf4(q, scales, n, block, dtype)
    return reference.dequantize_fp8(q, scales, block, dtype)


# ------------------------------------------------------------------------------------------------
# The formats


def test_nf4_table_follows_its_definition():
    """The published float32 table is QLoRA's construction (formats' docstring) to within 2^-23,
    two float32 ulps of its largest entries (in [0.5, 1)): the quantile function's rounding
    differs between libraries (scipy there, torch.special.ndtri here) in the last bits, and
    2^-23 is the largest difference this torch gives. Its shape is exact: -1 and 1 at the ends,
    0 at code 7, strictly increasing."""
    derived = formats.nf4_code_derived()
    assert (derived - formats.NF4_CODE.double()).abs().max().item() <= 2.0 ** -23
    code = formats.NF4_CODE
    assert code[0].item() == -1.0 and code[-1].item() == 1.0
    assert code[formats.NF4_ZERO_CODE].item() == 0.0
    assert bool((code[1:] > code[:-1]).all())


def _e4m3_table() -> torch.Tensor:
    """The value of every e4m3fn code from the format's definition (not torch's conversion):
    1 sign, 4 exponent bits of bias 7, 3 mantissa bits, subnormals at exponent 0, NaN at
    S.1111.111."""
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 15 and m == 7:
            values.append(math.nan)
        elif e == 0:
            values.append(sign * m * 2.0 ** -9)
        else:
            values.append(sign * (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(values, dtype=torch.float64)


def test_fp8_table_is_e4m3fn():
    table = _e4m3_table()
    assert table[0x7E].item() == 448.0 and table[0x01].item() == 2.0 ** -9
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    finite = ~torch.isnan(table)
    assert torch.equal(torch_values[finite], table[finite])
    assert bool(torch.isnan(torch_values[~finite]).all())


def test_fp8_quantizer_rounds_to_nearest_even():
    """With a block whose absmax is 448 the scale is exactly 1, so the quantizer rounds x itself:
    every e4m3 value, every midpoint between neighbours (ties: to the even mantissa), values a
    hair either side of each midpoint, values below half the smallest subnormal (to 0), and
    random values, compared with the nearest code found by brute force over the 256-entry
    table."""
    table = _e4m3_table()
    finite = table[~torch.isnan(table)].unique()  # sorted, one zero
    mids = (finite[1:] + finite[:-1]) / 2
    hair = mids.abs() * 2.0 ** -20
    g = torch.Generator().manual_seed(_seed("fp8 rne"))
    probes = torch.cat([finite, mids, mids + hair, mids - hair,
                        torch.tensor([2.0 ** -11, -2.0 ** -11, 2.0 ** -10, 3 * 2.0 ** -11]),
                        (torch.rand(5000, generator=g, dtype=torch.float64) * 2 - 1) * 448])
    probes = probes.float()  # every probe is exact in float32
    x = torch.cat([torch.tensor([448.0]), probes])
    codes, scales = formats.quantize_fp8(x, block=x.numel() + 32 - x.numel() % 32)
    assert scales.tolist() == [1.0]
    got = table[codes.long()][1:]
    p = probes.double()
    dist = (finite[None, :] - p[:, None]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    # Of two equally near codes, the one with an even mantissa (an even code, as the bit
    # patterns of neighbouring magnitudes are consecutive integers).
    finite_codes = torch.tensor([int((table == v).nonzero()[0]) for v in finite.tolist()])
    even = (finite_codes % 2 == 0)[None, :]
    pick = torch.where(candidates.sum(dim=1, keepdim=True) > 1, candidates & even, candidates)
    want = finite[pick.float().argmax(dim=1)]
    wrong = (got != want).nonzero()
    assert wrong.numel() == 0, (f"{wrong.numel()} probes rounded wrongly, the first "
                                f"{p[wrong[0]].item()!r} -> {got[wrong[0]].item()!r}, want "
                                f"{want[wrong[0]].item()!r}")


def test_nf4_quantizer_picks_the_nearest_value():
    """With a block whose absmax is 1 the scale is 1: every table value, every float32 midpoint
    (to the lower code), values a hair either side, and random values, against brute force."""
    code = formats.NF4_CODE
    mids = (code[1:] + code[:-1]) / 2  # float32, as the format defines them
    hair = 2.0 ** -20
    g = torch.Generator().manual_seed(_seed("nf4 nearest"))
    probes = torch.cat([code, mids, mids + hair, mids - hair,
                        torch.rand(5000, generator=g) * 2 - 1])
    x = torch.cat([torch.tensor([1.0]), probes])
    packed, scales = formats.quantize_nf4(x, block=x.numel() + 64 - x.numel() % 64)
    assert scales.tolist() == [1.0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:x.numel()].long()[1:]
    want = (code[None, :].double() - probes[:, None].double()).abs().argmin(dim=1)
    # Exactly on a float32 midpoint (which may sit a float32 rounding off the true one, so the
    # distances above cannot judge it): the lower code.
    at_mid = probes[:, None] == mids[None, :]
    assert at_mid.any(dim=1).sum().item() >= 15, "the midpoints must be among the probes"
    want = torch.where(at_mid.any(dim=1), at_mid.float().argmax(dim=1), want)
    wrong = (codes != want).nonzero()
    assert wrong.numel() == 0, (f"{wrong.numel()} probes got the wrong code, the first "
                                f"{probes[wrong[0]].item()!r} -> {codes[wrong[0]].item()}, want "
                                f"{want[wrong[0]].item()}")


def test_nf4_packs_low_nibble_first():
    x = torch.tensor([-1.0, 1.0, 0.0])  # codes 0, 15, 7; odd count: the last high nibble 0
    packed, scales = formats.quantize_nf4(x, block=64)
    assert packed.tolist() == [0xF0, 0x07] and scales.tolist() == [1.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizers_refuse_nonfinite(fmt):
    for bad in (math.inf, -math.inf, math.nan):
        x = torch.zeros(300)
        x[200] = bad
        with pytest.raises(ValueError, match=r"inf or nan in block 1 \(element 200\)"):
            _quantize(fmt, x, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizers_refuse_bad_arguments(fmt):
    with pytest.raises(ValueError, match="must be 1-D"):
        _quantize(fmt, torch.zeros(4, 64), 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        _quantize(fmt, torch.zeros(64), 48)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        _quantize(fmt, torch.zeros(64, dtype=torch.float64), 64)


# ------------------------------------------------------------------------------------------------
# The kernels against the references


def test_the_environment_chooses_the_isa_as_for_adam():
    """ZEROCORE_CPU_ISA, read at the first call, chooses these kernels as it does Adam's; by
    default the widest this CPU runs."""
    code = ("import torch; from zerocore.kernels import ops; "
            "ops.dequantize_fp8(torch.zeros(32, dtype=torch.uint8), torch.ones(1), torch.float32, "
            "block=32); print(ops._cpu_lowbit_isa())")
    for env, want in ((None, RUNNABLE_ISAS[-1]), ("scalar", "scalar"), (RUNNABLE_ISAS[-1],
                                                                          RUNNABLE_ISAS[-1])):
        environ = {k: v for k, v in os.environ.items() if k != "ZEROCORE_CPU_ISA"}
        if env is not None:
            environ["ZEROCORE_CPU_ISA"] = env
        done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == want, (env, done.stdout)


def test_isa_hook_reports_and_switches():
    assert RUNNABLE_ISAS[0] == "scalar" and ops._cpu_lowbit_isa() in RUNNABLE_ISAS
    for isa in RUNNABLE_ISAS:
        with _using(isa):
            assert ops._cpu_lowbit_isa() == isa
    with pytest.raises(RuntimeError, match="'sse9' is not one this CPU and build can run"):
        ops._cpu_lowbit_isa("sse9")


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_every_code_dequantizes_to_its_value(device, out_dtype):
    """Each of the 16 NF4 codes and 256 fp8 codes at scale 1, then at a scale that makes the
    products round (and the fp8 subnormals and fp16 outputs subnormal), in every ISA: the
    kernels' tables and decoders are the formats'. NaN codes give NaN (its bits are the
    platform's, so compared as NaN)."""
    nf4_codes = torch.arange(16, dtype=torch.uint8).repeat(4)  # 64 elements, one block
    packed = (nf4_codes[0::2] | (nf4_codes[1::2] << 4)).to(device)
    fp8_codes = torch.arange(256, dtype=torch.uint8).to(device)
    for scale in (1.0, 0.1, 2.0 ** -17):
        for isa in _isas(device):
            with _using(isa) if isa else contextlib.nullcontext():
                s = torch.full((1,), scale, device=device)
                out = ops.dequantize_nf4(packed, s, 64, out_dtype, block=64)
                assert_bits_equal(out, reference.dequantize_nf4(packed, s, 64, 64, out_dtype),
                                   f"nf4 codes, scale {scale}, {isa}")
                if scale == 1.0:
                    assert out.float().cpu().tolist() == formats.NF4_CODE.repeat(4).to(
                        out_dtype).float().tolist()
                s = torch.full((1,), scale, device=device)
                out = ops.dequantize_fp8(fp8_codes, s, out_dtype, block=256)
                want = reference.dequantize_fp8(fp8_codes, s, 256, out_dtype)
                nan = torch.isnan(want)
                assert torch.equal(torch.isnan(out), nan) and nan.sum().item() == 2
                assert_bits_equal(out[~nan], want[~nan], f"fp8 codes, scale {scale}, {isa}")


# n and block: a few elements (less than one vector step), one whole block, a count ending
# inside a block (and an odd one: NF4's last byte half used), many blocks, 278011 (odd, several
# thread pieces on the CPU, ending inside a block).
SIZES = {"tiny-5": (5, 64), "31": (31, 32), "one-block": (128, 128),
         "odd-in-block": (1000 + 37, 64), "blocks-32": (32 * 41, 32), "big-odd": (278_011, 256)}
# (offset of out in its buffer, offset of the codes in theirs), in elements / bytes: aligned,
# out misaligned for every vector width, the codes misaligned for the CUDA vector loads.
LAYOUTS = {"aligned": (0, 0), "out3": (3, 0), "out1-q1": (1, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_reference(device, fmt, out_dtype, size, layout):
    n, block = SIZES[size]
    out_offset, q_offset = LAYOUTS[layout]
    x = _values(n, block, _seed(fmt, size), torch.float32, device)
    q_values, scales = _quantize(fmt, x, block)
    q_buf = torch.full((q_offset + q_values.numel() + SLACK,), 0x55, dtype=torch.uint8,
                       device=device)
    q = q_buf[q_offset:q_offset + q_values.numel()]
    q.copy_(q_values)
    want = _reference(fmt, q, scales, n, block, out_dtype)
    for isa in _isas(device):
        with _using(isa) if isa else contextlib.nullcontext():
            buf = torch.full((out_offset + n + SLACK,), math.nan, dtype=out_dtype, device=device)
            out = buf[out_offset:out_offset + n]
            assert _dequantize_(fmt, out, q, scales, block) is out
            assert_bits_equal(out, want, f"{fmt} -> {DTYPE_IDS[out_dtype]}, isa {isa}")
            outside = torch.cat([buf[:out_offset], buf[out_offset + n:]])
            assert torch.isnan(outside).all(), f"the {isa} kernel wrote outside out"


# The CPU kernels write fp32 outputs with streaming stores once a call touches more than 32 MiB
# (kStreamingMinBytes in csrc/cpu/vec_io.h) and out is 64-byte aligned: these go past it, with
# out aligned (streaming, ending in a scalar tail) and at an odd offset (normal stores), and
# bf16 outputs as large (never streamed).
@pytest.mark.parametrize("out_offset", [0, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_large(device, fmt, out_dtype, out_offset):
    n = 14_000_037  # 28 MB of bf16 output plus 7 MB (NF4) or 14 MB (fp8) of codes
    block = 64
    g = torch.Generator().manual_seed(_seed("large", fmt, out_dtype, out_offset))
    q = torch.randint(0, 256, ((n + 1) // 2 if fmt == "nf4" else n,), generator=g,
                      dtype=torch.uint8)
    if fmt == "fp8":
        q[(q & 0x7F) == 0x7F] = 0  # no NaN codes: compared bit for bit below
    scales = torch.rand(formats.n_blocks(n, block), generator=g) * 1e-2
    q, scales = q.to(device), scales.to(device)
    want = _reference(fmt, q, scales, n, block, out_dtype)
    for isa in _isas(device):
        with _using(isa) if isa else contextlib.nullcontext():
            # 64-byte aligned from offset 0: a fresh allocation is (torch aligns to 64).
            buf = torch.full((out_offset + n + SLACK,), math.nan, dtype=out_dtype, device=device)
            out = buf[out_offset:out_offset + n]
            _dequantize_(fmt, out, q, scales, block)
            assert_bits_equal(out, want, f"{fmt} -> {DTYPE_IDS[out_dtype]}, isa {isa}")
            assert torch.isnan(buf[out_offset + n:]).all() and torch.isnan(buf[:out_offset]).all()


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_bound(device, fmt, in_dtype, out_dtype):
    """|x - dequantize(quantize(x))| element by element within what the format allows (formats'
    docstring), with s the block's scale:

    - NF4: half the widest gap between neighbouring table values, times s (the table's spacing
      is the format's resolution);
    - fp8: half the e4m3 spacing at |x| / s (2^(e - 3) for 2^e <= |x| / s < 2^(e + 1), e >= -6;
      2^-9 below), times s;
    - both: 3 * 2^-24 of |x| + s for the float32 roundings (of x / s, of the product; s itself,
      being an absmax or absmax / 448 rounded once, moves every value by 2^-24 relative, absorbed
      here), and half an ulp of the output in out_dtype for its last rounding (0 for float32).

    The values (_values) keep every nonzero scale a normal float32, where those relative
    roundings hold; zero blocks must come back exactly zero.
    """
    block = 64 if fmt == "nf4" else 128
    n = 100_003
    x = _values(n, block, _seed("bound", fmt, in_dtype, out_dtype), in_dtype, device)
    q, scales = _quantize(fmt, x, block)
    out = torch.empty(n, dtype=out_dtype, device=device)
    _dequantize_(fmt, out, q, scales, block)
    s = scales.double().repeat_interleave(block)[:n]
    ax = x.double().abs()
    if fmt == "nf4":
        gaps = formats.NF4_CODE[1:].double() - formats.NF4_CODE[:-1].double()
        bound = gaps.max() / 2 * s
    else:
        ratio = torch.where(s > 0, ax / torch.where(s > 0, s, 1.0), 0.0)
        e = torch.floor(torch.log2(ratio.clamp(min=2.0 ** -6))).clamp(min=-6)
        bound = torch.exp2(e - 3) / 2 * s
    bound = bound + 3 * F32_UNIT_ROUNDOFF * (ax + s)
    if out_dtype != torch.float32:
        bound = bound + half_ulp(out, out_dtype)
    assert_within(x, out, bound)
    zero_blocks = out[:n - n % block].view(-1, block)[2::5]
    assert not zero_blocks.any() and not torch.signbit(zero_blocks).any()
    # NF4 gives a block's absmax back exactly: the code for +-1 times the absmax itself.
    i = int(ax[:block].argmax())
    if fmt == "nf4" and out_dtype == in_dtype:
        assert out[i].item() == x[i].item()


def test_fp8_subnormal_codes_and_max_magnitude(device):
    """A block of absmax 448 (scale exactly 1) holding +-448, every subnormal code and 2^-10
    (halfway between 0 and the smallest subnormal: to even, 0), and the same block times 1e-30
    (a tiny but normal scale): the codes are the values themselves, and both blocks dequantize
    as the reference for every output dtype (fp16 and bf16 outputs of the second block are
    subnormal or zero) and every ISA."""
    sub = [m * 2.0 ** -9 for m in range(1, 8)]
    block = [448.0, -448.0, 416.0, -2.0 ** -9] + sub + [-v for v in sub] + [2.0 ** -10] * 14
    x = torch.tensor(block + [v * 1e-30 for v in block], device=device)
    codes, scales = formats.quantize_fp8(x, 32)
    assert scales[0].item() == 1.0
    assert codes[:32].cpu().view(torch.float8_e4m3fn).float().tolist() == block[:18] + [0.0] * 14
    for out_dtype in FLOAT_DTYPES:
        for isa in _isas(device):
            with _using(isa) if isa else contextlib.nullcontext():
                out = ops.dequantize_fp8(codes, scales, out_dtype, block=32)
                assert_bits_equal(out, reference.dequantize_fp8(codes, scales, 32, out_dtype),
                                   f"fp8 specials -> {DTYPE_IDS[out_dtype]}, {isa}")


def test_empty(device):
    for fmt in FORMATS:
        q, scales = _quantize(fmt, torch.empty(0, device=device), 64)
        assert q.shape == (0,) and q.dtype == torch.uint8 and scales.shape == (0,)
        _dequantize_(fmt, torch.empty(0, device=device), q, scales, 64)


def _bad_cases(device):
    q8 = torch.zeros(100, dtype=torch.uint8, device=device)
    q4 = torch.zeros(50, dtype=torch.uint8, device=device)
    s = torch.ones(2, device=device)
    out = torch.empty(100, device=device)
    return {
        "codes-int8": ("fp8", (out, q8.to(torch.int8), s, 64), "must be uint8"),
        "codes-count": ("nf4", (out, q8, s, 64), "take 50 bytes of 4-bit codes"),
        "scales-count": ("fp8", (out, q8, torch.ones(3, device=device), 64),
                         "one scale per block"),
        "scales-dtype": ("nf4", (out, q4, s.double(), 64), "scales must be float32"),
        "block": ("fp8", (out, q8, s, 48), "block must be a positive multiple of 32"),
        "out-dtype": ("nf4", (out.double(), q4, s, 64), "out must be float32, float16"),
        "out-strided": ("fp8", (torch.empty(200, device=device)[::2], q8, s, 64),
                        "out must be contiguous"),
    }


@pytest.mark.parametrize("case", list(_bad_cases("cpu")))
def test_dequantize_rejects(device, case):
    fmt, args, message = _bad_cases(device)[case]
    with pytest.raises(RuntimeError, match=message):
        _dequantize_(fmt, *args)


def test_dequantize_rejects_cuda_out_with_cpu_codes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device beside the CPU")
    out = torch.empty(64, device="cuda")
    with pytest.raises(RuntimeError, match="move all arguments to one device"):
        ops.dequantize_fp8_(out, torch.zeros(64, dtype=torch.uint8), torch.ones(1, device="cuda"),
                            64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(device, fmt):
    x = _values(300, 64, _seed("opcheck", fmt), torch.float32, device)
    q, scales = _quantize(fmt, x, 64)
    op = (torch.ops.zerocore.dequantize_nf4_ if fmt == "nf4"
          else torch.ops.zerocore.dequantize_fp8_).default
    out = torch.empty(300, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(op, (out, q, scales, 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_equals_cpu_past_one_grid(fmt, layout):
    """The CUDA kernel (8 elements per thread, a grid-stride loop) against the CPU's default
    kernel, bit for bit, on more groups than three full grids of the device hold, ending inside
    a block; the quantizer too (the same PyTorch on either device)."""
    props = torch.cuda.get_device_properties(0)
    threads = props.multi_processor_count * getattr(props, "max_threads_per_multi_processor", 2048)
    n = 3 * threads * 8 + 45
    block = 64
    out_offset, q_offset = LAYOUTS[layout]
    x = _values(n, block, _seed("grid", fmt), torch.bfloat16, "cpu")
    results = {}
    for device in ("cpu", "cuda"):
        q, scales = _quantize(fmt, x.to(device), block)
        q_buf = torch.zeros(q_offset + q.numel(), dtype=torch.uint8, device=device)
        q_buf[q_offset:].copy_(q)
        buf = torch.full((out_offset + n,), math.nan, dtype=torch.bfloat16, device=device)
        _dequantize_(fmt, buf[out_offset:], q_buf[q_offset:], scales, block)
        results[device] = (q, scales, buf)
    for name, a, b in zip(["codes", "scales", "dequantized buffer"], results["cpu"],
                          results["cuda"]):
        assert_bits_equal(b.cpu(), a, f"{fmt} {name}: CUDA against CPU")
