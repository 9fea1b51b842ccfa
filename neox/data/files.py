"""What the data modules share: their error type, atomic cache writes, and the default
directories of the command-line tools.

Nothing here reads environment variables or keeps state; paths are arguments everywhere.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

Log = Callable[[str], None]


class DataError(ValueError):
    """A user-facing problem with the data, tokenizer or sampler settings."""


def default_data_dir() -> Path:
    """The built-in default of the data-dir setting: ``<repository root>/../shared/data``.

    The repository root is the parent of the ``neox`` package directory. The directory may not
    exist (a plain install, a fresh clone); ``load_corpus`` then looks in the cache and
    downloads.
    """
    repo_root = Path(__file__).resolve().parent.parent.parent
    return repo_root.parent / "shared" / "data"


def default_cache_dir() -> Path:
    """Where the command-line tools keep the downloaded corpus, trained tokenizers and tokenised
    data: ``~/.cache/zerocore``."""
    return Path.home() / ".cache" / "zerocore"


def atomic_write(path: Path, content: bytes) -> None:
    """Write to a unique temporary file beside ``path``, then rename over it: readers (other
    ranks, a later run) see either the old file or the whole new one, never a partial write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_cache(path: Path, content: bytes, log: Log) -> None:
    try:
        atomic_write(path, content)
    except OSError as e:
        log(f"cache: cannot write {path} ({e}); continuing without caching it")

