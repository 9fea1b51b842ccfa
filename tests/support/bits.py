"""Bit-for-bit comparison of tensors, for kernels that must give their references' exact bits."""

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
