"""The filesystem operations of a save, each durable (flushed and fsynced) and each failing with
one ``CheckpointWriteError`` line that names the path and the errno:

    cannot write .../step-00000005.tmp-1a2b3c4d/manifest.json: [Errno 28] No space left on device

``torch.save`` reports a failed write of its file object as a ``RuntimeError`` from its zip
writer ("unexpected pos ..."), without the path or the errno; ``write_file`` hands it a file
object that keeps the ``OSError`` behind it, and hashes what is written on the way (so the rank
files are not read back to be hashed).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

from zerocore.checkpoint_errors import CheckpointWriteError


def write_error(verb: str, path: Path, e: OSError) -> CheckpointWriteError:
    """``cannot <verb> <path>: [Errno N] <strerror>``, as an exception."""
    reason = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None else str(e)
    return CheckpointWriteError(f"cannot {verb} {path}: {reason}", errno=e.errno,
                                filename=str(path))


class _HashingWriter:
    """The write side of a file for ``torch.save``: hashes what passes, keeps the OS error."""

    def __init__(self, f: Any):
        self._f = f
        self._hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = e
            raise
        self._hash.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def write_file(path: Path, write: Callable[[Any], Any]) -> dict[str, Any]:
    """Creates ``path`` (it must not exist), lets ``write(f)`` fill it, flushes and fsyncs it;
    returns ``{"sha256": ..., "bytes": ...}`` of what was written. ``write`` must only append
    (as ``torch.save`` and ``f.write`` do)."""
    try:
        with open(path, "xb") as f:
            out = _HashingWriter(f)
            try:
                write(out)
            except Exception:
                if out.error is not None:  # the OS error behind torch.save's RuntimeError
                    raise out.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
            assert f.tell() == out.size, f"{path}: the writer moved the file position"
    except OSError as e:
        raise write_error("write", path, e) from None
    return {"sha256": out.hexdigest(), "bytes": out.size}


def fsync_dir(path: Path) -> None:
    """Makes the entries of directory ``path`` (new files, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_error("flush directory", path, e) from None


def make_dir(path: Path, *, parents: bool = False) -> None:
    try:
        path.mkdir(parents=parents, exist_ok=parents)
    except OSError as e:
        raise write_error("create directory", path, e) from None


def rename(src: Path, dst: Path) -> None:
    """An atomic rename within one directory (``dst`` must not be a non-empty directory)."""
    try:
        os.rename(src, dst)
    except OSError as e:
        raise write_error(f"rename {src} to", dst, e) from None
