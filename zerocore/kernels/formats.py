"""The two low-bit blockwise formats of frozen weights beside int8, and their quantizers.

Both quantize a flat tensor of any length ``n`` by blocks of ``block`` consecutive elements (the
last block may be short), with one fp32 scale per block, and are dequantized by the compiled
kernels (``zerocore.ops.dequantize_nf4_`` / ``dequantize_fp8_``). Quantizing is a one-off step at
load, so it is plain, vectorised PyTorch here. Neither format accepts an inf or a NaN: a
non-finite weight is a broken checkpoint, and quantizing it would hide that (a ``ValueError``
names the first such block), as int8's ``quantize_blockwise`` does.

**NF4** (4-bit NormalFloat, QLoRA: Dettmers et al. 2023, section 3). The 16 values of
``NF4_CODE`` are quantiles of the standard normal distribution scaled to [-1, 1], with an exact
zero: 8 positive quantiles ``ndtri(p)`` for ``p`` the first 8 of 9 evenly spaced points from
``NF4_OFFSET`` down to 0.5, 7 negative ones ``-ndtri(p)`` for ``p`` the first 7 of 8 such points,
and zero, all divided by the largest. ``NF4_OFFSET`` = 0.9677083 is
the mean of 1 - 1/(2*15) and 1 - 1/(2*16), QLoRA's choice for the outermost quantile. The table
holds the float32 values QLoRA's implementation publishes, so weights quantized here read the
same as theirs; ``nf4_code_derived()`` recomputes them from the definition, and the tests hold
the two within 2 float32 ulps (the quantile function's own rounding differs between libraries).
- scale = the block's absmax (fp32), one per block; a block of zeros has scale 0.
- code = the index of the nearest table value to ``x / scale`` (divided in float64, rounded to
  float32, as the int8 quantizer divides), nearest as judged against the midpoints of
  neighbouring values rounded to float32; a value exactly on a midpoint takes the lower index.
  Every element of a zero block takes code 7 (the value 0).
- two codes per byte: element ``2i`` in the low nibble of byte ``i``, element ``2i + 1`` in its
  high nibble; an odd ``n`` leaves the last high nibble 0. ``ceil(n / 2)`` bytes.
- dequantized: ``NF4_CODE[code] * scale``, one fp32 product rounded once to the output dtype.
- Round trip: an element is off by at most half the widest gap of the table (between -1 and
  -0.696: 0.152) times its block's scale, plus the float32 roundings of the division and the
  product (2^-24 of the value each) and the final rounding to the output dtype.
- No double quantization of the scales (QLoRA's 8-bit scales of scales): scales stay fp32, 4
  bytes per block of 64 (0.5 bits per element on top of 4).

**fp8** (OCP 8-bit floating point, E4M3 in its "fn" variant, ``torch.float8_e4m3fn``): 1 sign,
4 exponent (bias 7) and 3 mantissa bits; no infinities, S.1111.111 is NaN, so the largest value
is 448; subnormals down to 2^-9.
- scale = the block's absmax / 448 (an IEEE float32 division), one per block.
- code = ``x / scale`` (float64 division rounded to float32), clamped to [-448, 448] (the
  quotient of the absmax may round a hair above 448), rounded to the nearest e4m3fn value,
  ties to even (torch's conversion, which the tests check against the table of all 256 codes).
  A zero block has scale 0 and codes 0. One byte per element (``torch.uint8`` bits).
- dequantized: the code's exact value (every e4m3 value is a float32) times scale, one fp32
  product rounded once to the output dtype. The NaN codes (0x7f, 0xff) are never produced; the
  kernels dequantize them to NaN, as the format says.
- Round trip: an element of magnitude |x| is off by at most half the e4m3 spacing at
  |x| / scale (2^(e - 3) for 2^e <= |x| / scale < 2^(e + 1), e >= -6; the subnormal spacing
  2^-9 below 2^-6) times the scale, that is at most 2^-4 of |x| for a normal code, plus the
  float32 roundings and the final rounding to the output dtype.
"""

from __future__ import annotations

import torch

NF4_BLOCK = 64     # QLoRA's block size
FP8_BLOCK = 128    # a scale per 128 elements: 1/32 byte per element on top of 1
FP8_MAX = 448.0    # the largest finite e4m3fn value, 1.75 * 2^8

NF4_OFFSET = 0.9677083
# The float32 values of QLoRA's NF4 table, index = code (also in csrc/cpu/lowbit_isa.h and
# csrc/cuda/lowbit_cuda.cu, whose kernels the tests hold to these bits).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float32)
NF4_ZERO_CODE = 7


def nf4_code_derived() -> torch.Tensor:
    """The NF4 table from its definition (module docstring), in float64."""
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return values / values.max()


def n_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def _check(x: torch.Tensor, block: int, what: str) -> None:
    if x.dim() != 1:
        raise ValueError(f"{what}: x must be 1-D, got shape {tuple(x.shape)}; flatten it "
                         f"(.reshape(-1)) first")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: x must be float32, float16 or bfloat16, got {x.dtype}")
    if type(block) is not int or block < 32 or block % 32:
        raise ValueError(f"{what}: block must be a positive multiple of 32 (the kernels' vector "
                         f"step), got {block!r}")
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        i = int((~finite).nonzero()[0])
        raise ValueError(f"{what}: x has an inf or nan in block {i // block} (element {i}); a "
                         f"non-finite weight cannot be quantized, so fix or replace it first")


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, absmax): x as float32 rows of ``block``, the last padded with zeros (which change
    no absmax), and each row's absmax."""
    n = x.numel()
    rows = torch.zeros(n_blocks(n, block) * block, dtype=torch.float32, device=x.device)
    rows[:n] = x
    rows = rows.view(-1, block)
    return rows, rows.abs().amax(dim=1)


def _ratio(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows / scale per row, each division correctly rounded to float32 (in float64, then
    rounded: 53 >= 2 * 24 + 2 bits), 0 where the scale is 0."""
    safe = torch.where(scales == 0, 1.0, scales).double()
    return torch.where(scales[:, None] == 0, 0.0, (rows.double() / safe[:, None]).float())


def quantize_nf4(x: torch.Tensor, block: int = NF4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 quantization of the 1-D tensor x (module docstring). Returns ``(packed, scales)``:
    uint8 of ``ceil(n / 2)`` bytes, float32 of ``ceil(n / block)`` scales, on x's device."""
    _check(x, block, "quantize_nf4")
    n = x.numel()
    rows, scales = _blocks(x, block)
    ratio = _ratio(rows, scales).reshape(-1)[:n]
    code = NF4_CODE.to(x.device)
    # Midpoints between neighbouring table values, rounded to float32; a value's code is how
    # many midpoints lie strictly below it (a tie goes to the lower code).
    midpoints = (code[:-1] + code[1:]) / 2
    codes = torch.searchsorted(midpoints, ratio, right=False).to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])  # the last high nibble: 0
    pairs = codes.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return packed.contiguous(), scales


def quantize_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3fn quantization of the 1-D tensor x (module docstring). Returns ``(codes,
    scales)``: uint8 bits of n elements, float32 of ``ceil(n / block)`` scales, on x's device."""
    _check(x, block, "quantize_fp8")
    n = x.numel()
    rows, absmax = _blocks(x, block)
    scales = (absmax.double() / FP8_MAX).float()
    ratio = _ratio(rows, scales).clamp(-FP8_MAX, FP8_MAX).reshape(-1)[:n]
    return ratio.to(torch.float8_e4m3fn).view(torch.uint8).contiguous(), scales

