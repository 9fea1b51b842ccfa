"""``PeakMemory``: the most bytes of tensors allocated at once during a region of a program, on
the CPU or a GPU: what ``zerocore.plan`` predicts, measured.

On a GPU this is the caching allocator's own count (``torch.cuda.max_memory_allocated``). The
CPU allocator keeps no such count, so on the CPU the region runs under torch's profiler with
``profile_memory``, which records every allocation and free of torch's CPU allocator with its
size and time; the peak is the largest running sum. That sees every tensor (those made inside
kernels and by autograd's engine too), and nothing else: not Python objects, not the
allocator's own rounding, not what gloo allocates outside torch.

One way the CPU's count errs, always upwards: the profiler follows the threads it was started
on, so a tensor freed on another thread stays counted. gloo's worker threads are such: a
finished collective's worker may still hold its tensors for a moment after ``wait()`` returns,
and when the caller has let go first the worker frees them (seen at 3 ranks, one run in four).
Two runs' smaller peak is the program's own.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


@dataclasses.dataclass
class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: the most bytes of tensors
    allocated inside the region and alive at once (tensors allocated before it and freed inside
    count negatively from then on). ``m.mark()`` inside the region starts the window the peak
    is taken over (what came before still counts if it is alive), e.g. after a build and a first
    step; without it the window is the whole region. ``m.net_bytes``: allocated at the end."""

    device: torch.device
    peak_bytes: int = 0
    net_bytes: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self._profiler: profile | None = None
        self._start = 0
        self._marked = False

    def __enter__(self) -> "PeakMemory":
        # Garbage of earlier work (a dropped model is freed by the cycle collector: autograd
        # and its hooks make cycles) goes now, not at some collection inside the window,
        # where its frees would read as this work's and lower the peak it measures.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def mark(self) -> None:
        """Starts the window over which the peak is taken."""
        self._marked = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # An event in the profiler's own clock: allocations after it are in the window.
            with torch.profiler.record_function(_MARK):
                pass

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.net_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        assert self._profiler is not None
        self._profiler.__exit__(*exc)
        events = list(self._profiler.profiler.kineto_results.events())
        self._profiler = None
        marks = [e.start_ns() for e in events if e.name() == _MARK]
        since = marks[-1] if self._marked and marks else None
        allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                             if e.name() == "[memory]" and e.device_type().name == "CPU")
        live = 0
        peak = None
        for t, nbytes in allocations:
            if since is not None and t >= since and peak is None:
                peak = live  # what is alive when the window opens
            live += nbytes
            if since is None or t >= since:
                peak = max(peak if peak is not None else 0, live)
        self.peak_bytes, self.net_bytes = (peak if peak is not None else live), live


_MARK = "zerocore.PeakMemory.mark"


_STATUS = Path("/proc/self/status")


def peak_rss() -> int | None:
    """The process's peak resident set (VmHWM) in bytes since it started or since the last
    ``reset_peak_rss``; None where /proc does not say (not Linux)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Starts the peak resident set afresh from the current one (Linux: /proc/self/clear_refs);
    False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
