"""Packed gradients every rank can make, and their mean summed in rank order as
``transport.mean_factors`` says (divided by ``pre``, ((g0 + g1) + g2) + ..., divided by
``post``): what every gloo reduction must give bitwise (tests/engine/test_overlap.py,
test_carried_identity.py)."""

from __future__ import annotations

from typing import Callable

import torch

from zerocore.comm.transport import mean_factors


def packed_gradients(q: int, numel: int, dtype: torch.dtype, top: int = 3) -> torch.Tensor:
    """Rank ``q``'s packed gradients: values over decades 10**-3 .. 10**(top - 1), so that the
    order of summation shows in the last bits."""
    g = torch.Generator().manual_seed(1000 + q)
    return (torch.randn(numel, generator=g)
            * 10.0 ** torch.randint(-3, top, (numel,), generator=g)).to(dtype)


def mean_in_rank_order(packed: Callable[[int], torch.Tensor], lo: int, hi: int,
                       world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice [lo, hi) of the mean of ``packed(q)`` over the ranks, in rank order."""
    factors = mean_factors(dtype, world_size)
    expected = packed(0).div_(factors.pre)[lo:hi]
    for q in range(1, world_size):
        expected = expected + packed(q).div_(factors.pre)[lo:hi]
    return expected.div_(factors.post)
