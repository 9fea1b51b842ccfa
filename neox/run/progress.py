"""A minimal progress bar for rank 0: redrawn in place on a terminal, one line per update
otherwise (logs, CI), so long runs show where they are either way."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

# What rank 0 prints with (``say``), and the other ranks (nothing).
Log = Callable[..., None]


def say(*args: object, **kwargs: object) -> None:
    """``print``, flushed: a run's lines reach a pipe (``| tee run.log``) or a log file as they
    are printed, not when a buffer fills, and in order with the other processes' lines."""
    print(*args, **kwargs, flush=True)


class Progress:
    def __init__(self, total: int, *, enabled: bool, stream: TextIO = sys.stdout, width: int = 24):
        self.total, self.enabled, self.stream, self.width = total, enabled, stream, width
        self.start = time.perf_counter()
        self.tty = enabled and stream.isatty()

    def update(self, done: int, text: str) -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / max(self.total, 1))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                f"{text} | {elapsed:.0f}s elapsed, ~{eta:.0f}s left")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
