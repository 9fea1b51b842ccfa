"""Recomputation (``zerocore.Recompute``), one mechanism for both front doors: a chosen layer's
(unit's) forward runs under torch's non-reentrant activation checkpointing, inside the hooks that
gather it, so its forward keeps only its inputs and backward runs it again once the runtime has
gathered the layer anew for its backward.

Why torch's checkpoint and not a mechanism of our own. The non-reentrant checkpoint takes any
arguments and outputs, restores the random-number state of the first run (so dropout draws the
same masks) and its autocast settings, and checks that the second run saves the same tensors as
the first; gradients are then bitwise those without recomputation. The weights a recomputed
forward reads are the module's attributes, which the runtime's views still hold (views of the
gathered storage, filled again by backward's gather), so the recomputation needs nothing of the
engine but that gather.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


def recomputing(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` keeping only its inputs when it builds a graph, run again in backward; as it
    is when no graph is built (``torch.no_grad``: nothing would be kept anyway)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run
