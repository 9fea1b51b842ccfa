"""``PeakMemory``: the most bytes of tensors allocated at once during a region of a program, on
the CPU or a GPU: what ``zerocore.plan`` predicts, measured.

On a GPU this is the caching allocator's own count (``torch.cuda.max_memory_allocated``). The
CPU allocator keeps no such count, so on the CPU the region runs under torch's profiler with
``profile_memory``, which records every allocation and free of torch's CPU allocator with its
size and time; the peak is the largest running sum. That sees every tensor (those made inside
kernels and by autograd's engine too), and nothing else: not Python objects, not the
allocator's own rounding, not what gloo allocates outside torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


@dataclasses.dataclass
class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: the most bytes allocated
    at once during the region beyond those allocated when it began (tensors allocated before
    and freed inside count negatively from then on). ``m.net_bytes``: allocated at the end
    beyond the start."""

    device: torch.device
    peak_bytes: int = 0
    net_bytes: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self._profiler: profile | None = None
        self._start = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.net_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        assert self._profiler is not None
        self._profiler.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in
                        self._profiler.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type().name == "CPU")
        live = peak = 0
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        self.peak_bytes, self.net_bytes = peak, live
        self._profiler = None


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
