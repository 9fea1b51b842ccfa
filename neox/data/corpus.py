"""The training text: a local file, or tiny_shakespeare from the cache, a data directory or
the network, or an offline fallback every Python installation ships.

``load_corpus`` always checks tiny_shakespeare against its SHA-256. With no network and nothing
on disk it falls back to the standard library's ``pydoc_data.topics`` help texts, so the default
run works offline.
"""

from __future__ import annotations

import hashlib
import http.client
import urllib.request
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from neox.data.files import DataError, Log, atomic_write, write_cache

# karpathy/char-rnn's tinyshakespeare input.txt, 1,115,394 bytes. The checksum is of that file as
# published; a download or cached copy with any other content is rejected.
TINY_SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/"
                        "data/tinyshakespeare/input.txt")
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_FILE = "tiny_shakespeare.txt"
# Short, so that a machine without network falls back within seconds instead of hanging.
DOWNLOAD_TIMEOUT_S = 10.0
# The real file is about 1 MB; a wrong URL must not fill the disk before the checksum rejects it.
_MAX_DOWNLOAD_BYTES = 16 * 1024 * 1024

@dataclass(frozen=True)
class Corpus:
    """A text corpus and where it came from.

    ``name`` is short (``tiny_shakespeare``, a file name, ``pydoc_topics``); ``source`` says where
    the text was read from, for logs and the run's metadata.
    """

    text: str
    name: str
    source: str

    @cached_property
    def sha256(self) -> str:
        """SHA-256 of the UTF-8 text; the key of every cache derived from this corpus."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load_corpus(data: Path | str | None, *, cache_dir: Path, data_dir: Path | None,
                url: str | None = TINY_SHAKESPEARE_URL, timeout: float = DOWNLOAD_TIMEOUT_S,
                log: Log = print) -> Corpus:
    """Load the training text.

    ``data`` given: read that local UTF-8 text file; a missing, unreadable, non-UTF-8 or empty file
    is a ``DataError`` naming it. ``data`` None: tiny_shakespeare, from the first of
      1. ``cache_dir/tiny_shakespeare.txt`` if its SHA-256 matches;
      2. ``data_dir/tiny_shakespeare.txt`` if present and matching (copied into the cache);
      3. ``url`` (skipped when None), downloaded with ``timeout`` to a temporary file, checked,
         then renamed into the cache, so a partial or wrong download never becomes the cache;
      4. the standard library's ``pydoc_data.topics`` help texts, logged as a fallback.
    A cache file with the wrong checksum is reported and replaced by the next good source.
    Failing to write the cache is logged and otherwise ignored: the text is already in memory.
    """
    if data is not None:
        path = Path(data)
        return Corpus(text=_read_text_file(path), name=path.name, source=str(path))

    cache_dir = Path(cache_dir)
    cached = cache_dir / TINY_SHAKESPEARE_FILE
    if cached.is_file():
        content = cached.read_bytes()
        digest = hashlib.sha256(content).hexdigest()
        if digest == TINY_SHAKESPEARE_SHA256:
            log(f"corpus: tiny_shakespeare from cache {cached}")
            return _shakespeare(content, str(cached))
        log(f"corpus: cached {cached} has the wrong checksum (sha256 {digest[:12]}..., expected "
            f"{TINY_SHAKESPEARE_SHA256[:12]}...); fetching it again")

    if data_dir is not None:
        local = Path(data_dir) / TINY_SHAKESPEARE_FILE
        if local.is_file():
            content = local.read_bytes()
            digest = hashlib.sha256(content).hexdigest()
            if digest == TINY_SHAKESPEARE_SHA256:
                write_cache(cached, content, log)
                log(f"corpus: tiny_shakespeare from {local}")
                return _shakespeare(content, str(local))
            log(f"corpus: ignoring {local}: wrong checksum (sha256 {digest[:12]}...)")

    if url is not None:
        problem = _download(url, cached, timeout=timeout)
        if problem is None:
            log(f"corpus: tiny_shakespeare downloaded from {url} to {cached}")
            return _shakespeare(cached.read_bytes(), url)
        log(f"corpus: could not download tiny_shakespeare from {url}: {problem}")

    corpus = offline_corpus()
    looked = [str(cached)] + ([str(Path(data_dir) / TINY_SHAKESPEARE_FILE)] if data_dir else [])
    log(f"corpus: tiny_shakespeare is not available (not in {' or '.join(looked)}"
        f"{', and no download' if url else ''}); FALLING BACK to {corpus.source}, "
        f"{len(corpus.text):,} characters. Pass a text file (--data) to train on something "
        f"else, or put tiny_shakespeare.txt in the data directory (--data-dir).")
    return corpus


def _shakespeare(content: bytes, source: str) -> Corpus:
    return Corpus(text=content.decode("utf-8"), name="tiny_shakespeare", source=source)


def _read_text_file(path: Path) -> str:
    """The UTF-8 text of a user-given data file, or a DataError that says what is wrong with it."""
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if path.is_dir():
        raise DataError(f"data file {path} is a directory; pass a text file")
    try:
        content = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    try:
        text = content.decode("utf-8-sig")  # -sig: a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (invalid byte at offset {e.start}: "
                        f"{e.reason}); convert it to UTF-8") from None
    if not text.strip():
        raise DataError(f"data file {path} is empty")
    return text


def offline_corpus() -> Corpus:
    """The offline fallback: Python's help topics (``help('FOR')`` and friends), ~0.5 MB of prose
    and code that every CPython installation carries."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - only stripped-down Python builds lack it
        raise DataError("no corpus available: tiny_shakespeare could not be found or downloaded "
                        "and this Python has no pydoc_data; pass a local text file") from None
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return Corpus(text=text, name="pydoc_topics",
                  source="the Python standard library's pydoc_data.topics (offline fallback)")


def _download(url: str, dest: Path, *, timeout: float) -> str | None:
    """Fetch tiny_shakespeare from ``url`` into ``dest``; None on success, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            content = response.read(_MAX_DOWNLOAD_BYTES + 1)
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, timeouts, bad URL
        return str(e) or type(e).__name__
    if len(content) > _MAX_DOWNLOAD_BYTES:
        return f"more than {_MAX_DOWNLOAD_BYTES} bytes, not the expected file"
    digest = hashlib.sha256(content).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        return (f"checksum mismatch (sha256 {digest[:12]}..., expected "
                f"{TINY_SHAKESPEARE_SHA256[:12]}...)")
    try:
        atomic_write(dest, content)
    except OSError as e:
        return f"cannot write {dest}: {e}"
    return None

