"""Bit-for-bit comparison of tensors, for kernels that must give their references' exact bits,
and the bounds of rounding for those that may differ from them by a stated amount."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (on the CPU), so that equality also means the same sign of zero and the same
    NaNs."""
    return t.cpu().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bits; else a message naming how many elements differ and the first.
    No tolerance: callers compare operations that are correctly rounded on both sides."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    diff = (bits(actual) != bits(expected)).nonzero()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} elements differ, the first at "
                               f"{diff[0].item()}: {actual.flatten()[diff[0]].item()} instead of "
                               f"{expected.flatten()[diff[0]].item()}")


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of dtype's numbers at each of ``values`` (which are in dtype), in
    float64: the most that rounding a real number to nearest can move it when the result is that
    value. (When the result is a power of two the spacing below is half the one above; taking
    the one above only makes the bound looser.) Zeros and subnormals get the subnormal spacing."""
    info = torch.finfo(dtype)
    v = values.double()
    _, exponent = torch.frexp(v)  # v = m * 2^exponent, 0.5 <= |m| < 1
    spacing = torch.ldexp(torch.full_like(v, info.eps), exponent - 1)
    return torch.maximum(spacing, torch.full_like(v, info.smallest_normal * info.eps)) / 2


def assert_within(x: torch.Tensor, out: torch.Tensor, bound: torch.Tensor) -> None:
    """|x - out| <= bound elementwise (in float64); else how many exceed it and the first."""
    err = (x.double() - out.double()).abs()
    over = (err > bound).nonzero()
    assert over.numel() == 0, (f"{over.numel()} elements exceed the bound, the first at "
                               f"{over[0].item()}: error {err[over[0]].item():.3e}, bound "
                               f"{bound[over[0]].item():.3e}")
