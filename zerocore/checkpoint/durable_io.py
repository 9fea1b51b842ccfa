"""The filesystem operations of every writer (checkpoints, consolidation, exports, a run's
files), each durable (flushed and fsynced) and each failing with one ``CheckpointWriteError``
line that names the path and the reason:

    cannot write .../step-00000005.tmp-1a2b3c4d/manifest.json: [Errno 28] No space left on device

The writers' libraries do not all fail with an ``OSError``: ``torch.save`` reports a failed
write of its file object as a ``RuntimeError`` from its zip writer ("unexpected pos ..."),
without the path or the errno, and safetensors raises its own ``SafetensorError`` ("Error while
serializing: I/O error: No space left on device (os error 28)"). ``write_error`` turns any of
them into the one line (the errno recovered from the text where the library kept only that);
``writing(path)`` does so for a block of writes, ``write_atomically`` for one file written
beside its final name and renamed. ``write_file`` hands ``torch.save`` a file object that keeps
the ``OSError`` behind it, and hashes what is written on the way (so the rank files are not
read back to be hashed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from zerocore.checkpoint.errors import CheckpointWriteError


# safetensors (Rust) and other libraries keep only the text of the OS error: "... (os error 28)".
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


def failure_reason(e: BaseException) -> tuple[int | None, str]:
    """(errno or None, ``[Errno N] <strerror>``) for a failed write of any library: the errno
    of an ``OSError``, or the one a library's message names; else the message's first line."""
    if isinstance(e, CheckpointWriteError):
        return e.errno, str(e)
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno, f"[Errno {e.errno}] {e.strerror or os.strerror(e.errno)}"
    found = _OS_ERROR_TEXT.search(str(e))
    if found:
        code = int(found.group(1))
        return code, f"[Errno {code}] {os.strerror(code)}"
    lines = str(e).strip().splitlines()
    return None, f"{type(e).__name__}: {lines[0] if lines else 'failed'}"


def write_error(verb: str, path: Path | str, e: BaseException) -> CheckpointWriteError:
    """``cannot <verb> <path>: [Errno N] <strerror>``, as an exception, from any exception a
    write raised (an ``OSError``, safetensors' ``SafetensorError``, torch's ``RuntimeError``).
    A ``CheckpointWriteError`` (already one line naming its path) is returned as it is."""
    if isinstance(e, CheckpointWriteError):
        return e
    code, reason = failure_reason(e)
    return CheckpointWriteError(f"cannot {verb} {path}: {reason}", errno=code,
                                filename=str(path))


@contextlib.contextmanager
def writing(path: Path | str, verb: str = "write") -> Iterator[None]:
    """Any exception of the writes in the block becomes one ``CheckpointWriteError`` naming
    ``path``: wrap only writes (not checks of their input, whose errors are the user's)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  (whatever the library raises: one line)
        raise write_error(verb, path, e) from None


def write_atomically(path: Path | str, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` creates a temporary file beside ``path`` (safetensors' ``save_file``,
    ``Path.write_text``, ...); it is then fsynced and renamed to ``path``. Any failure is one
    ``CheckpointWriteError`` naming ``path``; the temporary file is removed and whatever was at
    ``path`` before is unchanged. Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with writing(path):
            write(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


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
    except (OSError, RuntimeError) as e:  # torch's error without an OS error behind it too
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
