"""Directories for NVMe offload's scratch (``zerocore.Offload(optimizer="nvme", path=...)``) in
tests, and what a rank process holds of it.

``private_disk``: a tmpfs of its own where the test may mount one (root in a container that
allows it), so that its free space is this test's alone and says exactly whether the scratch's
blocks were given back; elsewhere a plain temporary directory (``exact`` False). ``no_direct_io``:
a ramfs, whose files refuse ``O_DIRECT``, where one may be mounted (the buffered path); None
elsewhere (the buffered path is then driven through ``ScratchFile(direct=False)``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def _mounted(where: Path, kind: str, options: str | None) -> Iterator[bool]:
    where.mkdir(parents=True, exist_ok=True)
    args = ["mount", "-t", kind] + (["-o", options] if options else []) + [kind, str(where)]
    try:
        ok = subprocess.run(args, capture_output=True).returncode == 0
    except OSError:  # no mount command
        ok = False
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


class PrivateDisk:
    def __init__(self, path: Path, exact: bool):
        self.path = path
        self.exact = exact   # a file system of its own: its free space is this test's

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize


@contextlib.contextmanager
def private_disk(where: Path, size: str = "256m") -> Iterator[PrivateDisk]:
    with _mounted(where, "tmpfs", f"size={size}") as ok:
        yield PrivateDisk(where, exact=ok)


@contextlib.contextmanager
def read_only_dir(where: Path) -> Iterator[Path]:
    """A directory this process may not write to: a read-only tmpfs where one may be mounted
    (root writes anywhere else), else one without write permission."""
    with _mounted(where, "tmpfs", "ro,size=1m") as ok:
        if not ok:
            where.chmod(0o500)
        try:
            yield where
        finally:
            if not ok:
                where.chmod(0o700)


@contextlib.contextmanager
def no_direct_io(where: Path) -> Iterator[Path | None]:
    with _mounted(where, "ramfs", None) as ok:
        yield where if ok else None


def scratch_fds(pid: int, directory: Path) -> list[str]:
    """What process ``pid``'s descriptors open in ``directory`` (``readlink`` of each: an
    unnamed file reads ``<directory>/#<inode> (deleted)``)."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory) + "/"):
            found.append(target)
    return found
