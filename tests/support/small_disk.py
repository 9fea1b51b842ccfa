"""A file system that is full, for the write-error tests of every writer.

Where we may mount (root in a container that allows it) it is a real 64 KiB tmpfs: writes fail
with ENOSPC exactly as on a full disk. Elsewhere the same writes are made to fail by a soft
``RLIMIT_FSIZE`` of 64 KiB on this process (EFBIG, "File too large"; SIGXFSZ ignored so the
write returns the error instead of killing the process), raised only around the write under
test and restored after, so the inputs can be prepared freely. Either way the writer meets a
real OS error from a real ``write(2)``, through its own library (safetensors, torch, json).
"""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

SIZE = 64 * 1024


class SmallDisk:
    def __init__(self, root: Path, mounted: bool):
        self.root = root
        self.mounted = mounted
        # The reason every writer's one line must give.
        self.reason = ("[Errno 28] No space left on device" if mounted
                       else "[Errno 27] File too large")

    @contextlib.contextmanager
    def full(self) -> Iterator[None]:
        """While the block runs, writes of more than 64 KiB under ``root`` fail."""
        if self.mounted:
            yield
            return
        with file_size_limit(SIZE):
            yield


@contextlib.contextmanager
def file_size_limit(limit: int | None) -> Iterator[None]:
    """While the block runs, this process's writes past ``limit`` bytes of any file fail with
    EFBIG (SIGXFSZ ignored, so the write returns the error instead of killing the process);
    None: no limit (what the ranks that keep their room run)."""
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[SmallDisk]:
    where = tmp_path / "small-disk"
    where.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs",
                                  str(where)], capture_output=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    try:
        yield SmallDisk(where, mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
