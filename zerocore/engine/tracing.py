"""Labels for a ``torch.profiler`` trace: each layer's gather (issue and wait), gradient reduction
(issue and wait) and optimizer step appear as ``zerocore::<what> layer <index>``, so that a trace
shows the engine's work beside torch's own operations. Outside a profiled region a label costs
one check of whether the profiler runs (``record_function`` itself costs tens of microseconds per
call, a layer's whole host budget)."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

_profiling = torch.autograd._profiler_enabled   # torch's own check (C++), a call
_NOTHING = contextlib.nullcontext()                # stateless: shared by every unlabelled region


def traced(what: str, index: int) -> ContextManager:
    """``with traced("gather", 3): ...`` labels the region ``zerocore::gather layer 3`` while the
    profiler runs (``zerocore::<what>`` for an index below 0: no layer)."""
    if not _profiling():
        return _NOTHING
    return torch.profiler.record_function(
        f"zerocore::{what} layer {index}" if index >= 0 else f"zerocore::{what}")
