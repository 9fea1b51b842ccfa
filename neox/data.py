"""Training data for GPT-NeoX fine-tuning: the corpus, the tokenizer, token windows, the sampler.

The pieces, in the order a run uses them:

- ``load_corpus``: a local text file (``--data``), or by default tiny_shakespeare, found in a
  cache, in a data directory or downloaded, always checked against its SHA-256. With no network
  and nothing on disk it falls back to a corpus every Python installation ships (the standard
  library's ``pydoc_data.topics`` help texts), so the default run works offline.
- ``load_tokenizer``: a ``tokenizer.json`` (or a checkpoint directory holding one); without one,
  a byte-level BPE trained on the corpus and cached by corpus hash and vocabulary size.
- ``TokenDataset``: the corpus tokenised once (cached), cut into non-overlapping windows of
  ``seq_len + 1`` tokens, with the last windows held out for validation.
- ``WindowSampler``: the distributed sampler. Every rank draws its batches from the same
  per-epoch permutation, so ranks never share a sample, and its position is part of the training
  state so a resumed run continues with exactly the next batch.

Everything takes its paths as arguments; nothing here reads environment variables or keeps
module-level state. User errors raise ``DataError`` (a ``ValueError``) with a message that names
the file or setting and says what to do.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import math
import os
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "BPE_SPECIAL_TOKENS", "Corpus", "DataError", "TINY_SHAKESPEARE_SHA256", "TINY_SHAKESPEARE_URL",
    "TokenDataset", "WindowSampler", "WindowSplit", "batch", "check_vocab", "default_cache_dir",
    "default_data_dir", "encode_text", "eval_batches", "load_corpus", "load_tokenizer",
    "tokenizer_rows", "train_bpe",
]

Log = Callable[[str], None]

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

# The trained BPE gets GPT-NeoX's end-of-text token so that generated text can stop on it.
BPE_SPECIAL_TOKENS = ("<|endoftext|>",)
_MIN_BPE_VOCAB = 256 + len(BPE_SPECIAL_TOKENS)  # every byte, plus the special tokens


class DataError(ValueError):
    """A user-facing problem with the data, tokenizer or sampler settings."""


def default_data_dir() -> Path:
    """The built-in default of the data-dir setting: ``<repository root>/../shared/data``.

    The repository root is the parent of the ``neox`` package directory. The directory may not
    exist (a plain install); ``load_corpus`` then looks in the cache and downloads.
    """
    repo_root = Path(__file__).resolve().parent.parent
    return repo_root.parent / "shared" / "data"


def default_cache_dir() -> Path:
    """A default cache directory for the CLI: ``~/.cache/zerocore/neox``."""
    return Path.home() / ".cache" / "zerocore" / "neox"


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

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
                _write_cache(cached, content, log)
                log(f"corpus: tiny_shakespeare from {local}")
                return _shakespeare(content, str(local))
            log(f"corpus: ignoring {local}: wrong checksum (sha256 {digest[:12]}...)")

    if url is not None:
        problem = _download(url, cached, timeout=timeout)
        if problem is None:
            log(f"corpus: tiny_shakespeare downloaded from {url} to {cached}")
            return _shakespeare(cached.read_bytes(), url)
        log(f"corpus: could not download tiny_shakespeare from {url}: {problem}")

    corpus = _stdlib_corpus()
    log(f"corpus: tiny_shakespeare is not available (no network and no copy in the cache or the "
        f"data directory); FALLING BACK to {corpus.source}, {len(corpus.text):,} characters. "
        f"Pass a text file to train on something else.")
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


def _stdlib_corpus() -> Corpus:
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
        _atomic_write(dest, content)
    except OSError as e:
        return f"cannot write {dest}: {e}"
    return None


def _atomic_write(path: Path, content: bytes) -> None:
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


def _write_cache(path: Path, content: bytes, log: Log) -> None:
    try:
        _atomic_write(path, content)
    except OSError as e:
        log(f"cache: cannot write {path} ({e}); continuing without caching it")


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def load_tokenizer(path: Path | str | None, *, corpus: Corpus, cache_dir: Path,
                   vocab_size: int = 8192, log: Log = print) -> Tokenizer:
    """The tokenizer for a run.

    ``path``: a ``tokenizer.json`` file, or a directory holding one (a checkpoint directory).
    None: a byte-level BPE of ``vocab_size`` tokens trained on ``corpus``, cached in ``cache_dir``
    as ``bpe-<vocab_size>-<corpus hash>.json`` so later runs on the same text reuse it.
    Truncation and padding stored in a tokenizer file are switched off: the corpus is encoded
    in one piece and generation works token by token.
    """
    if path is not None:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if path.is_dir() and not file.is_file():
            raise DataError(f"tokenizer: directory {path} has no tokenizer.json; pass the "
                            f"tokenizer file itself or omit it to train one on the corpus")
        if not file.exists():
            raise DataError(f"tokenizer file {file} does not exist")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception for unreadable/invalid JSON
            raise DataError(f"tokenizer file {file} could not be loaded: {e}") from None
        tokenizer.no_truncation()
        tokenizer.no_padding()
        log(f"tokenizer: {file} ({tokenizer_rows(tokenizer):,} token ids)")
        return tokenizer

    if vocab_size < _MIN_BPE_VOCAB:
        raise DataError(f"BPE vocabulary size {vocab_size} is too small: a byte-level BPE needs "
                        f"at least {_MIN_BPE_VOCAB} tokens (256 bytes + special tokens)")
    cached = Path(cache_dir) / f"bpe-{vocab_size}-{corpus.sha256[:16]}.json"
    if cached.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(cached))
        except Exception as e:
            log(f"tokenizer: cached {cached} is unreadable ({e}); training a new one")
        else:
            log(f"tokenizer: reusing cached byte-level BPE {cached} "
                f"({tokenizer.get_vocab_size():,} tokens)")
            return tokenizer
    log(f"tokenizer: training a byte-level BPE with {vocab_size:,} tokens on {corpus.name} "
        f"({len(corpus.text):,} characters)")
    tokenizer = train_bpe(corpus.text, vocab_size=vocab_size)
    _write_cache(cached, tokenizer.to_str().encode("utf-8"), log)
    log(f"tokenizer: trained {tokenizer.get_vocab_size():,} tokens, cached as {cached}")
    return tokenizer


def train_bpe(text: str, *, vocab_size: int) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE on ``text``.

    Every byte is in the initial alphabet, so any text encodes without unknown tokens and decodes
    back exactly. Training is deterministic for a given text and size (checked across processes
    with tokenizers 0.23), which matters when several ranks train it at the same time.
    The result may hold fewer than ``vocab_size`` tokens when the text has too few distinct pairs.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a pair seen once is noise, not a token worth a row of the embedding
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = text.splitlines(keepends=True)
    # Chunks of lines rather than one huge string: the trainer counts words per chunk in parallel.
    chunks = ("".join(lines[i:i + 1000]) for i in range(0, len(lines), 1000))
    tokenizer.train_from_iterator(chunks, trainer, length=math.ceil(len(lines) / 1000))
    return tokenizer


def tokenizer_rows(tokenizer: Tokenizer) -> int:
    """How many embedding rows the tokenizer's ids need: its largest id + 1 (added tokens too)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise ``DataError`` when the tokenizer produces ids the model's embedding has no row for."""
    rows = tokenizer_rows(tokenizer)
    if rows > model_vocab_size:
        raise DataError(f"tokenizer larger than the vocabulary: the tokenizer has ids up to "
                        f"{rows - 1} ({rows:,} rows needed) but the model's embedding has "
                        f"{model_vocab_size:,} rows; use the model's own tokenizer, or a smaller "
                        f"trained tokenizer (BPE vocabulary size <= {model_vocab_size})")


def encode_text(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` as a 1-D int32 array, without special tokens added around it.

    The text is encoded in one call: splitting it would change how whitespace at the cut is
    tokenised. Note that added tokens written literally in the text are still matched.
    """
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowSplit:
    """One split of a ``TokenDataset``: ``windows`` is ``[num_windows, seq_len + 1]`` int32, a
    view of the dataset's tokens."""

    name: str
    windows: torch.Tensor

    def __len__(self) -> int:
        return self.windows.shape[0]


class TokenDataset:
    """A token stream cut into non-overlapping windows of ``seq_len + 1`` tokens.

    Window ``i`` covers tokens ``[i*(seq_len+1), (i+1)*(seq_len+1))``; its input is
    ``window[:-1]`` and its target ``window[1:]``. The tail that does not fill a window is unused.
    The last ``val_fraction`` of the windows (at least one, at most all but one) form ``val``;
    the rest form ``train``. Holding out the end rather than random windows keeps validation
    text away from training text, which neighbouring windows would otherwise share.
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, *, seq_len: int,
                 val_fraction: float = 0.1) -> None:
        if seq_len < 1:
            raise DataError(f"sequence length must be at least 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise DataError(f"tokens must be a 1-D integer array, got {tuple(tokens.shape)} "
                            f"{tokens.dtype}")
        window = seq_len + 1
        num_windows = tokens.numel() // window
        if num_windows < 2:
            raise DataError(f"the corpus is too short: it has {tokens.numel():,} tokens, but "
                            f"seq_len={seq_len} needs at least {2 * window:,} (one training and "
                            f"one validation window of seq_len + 1 tokens); use a shorter "
                            f"sequence length or a longer text")
        self.tokens = tokens.to(torch.int32).contiguous()  # 1D, int32: compact, ids < 2**31
        self.seq_len = seq_len
        windows = self.tokens[: num_windows * window].view(num_windows, window)
        num_val = min(num_windows - 1, max(1, round(val_fraction * num_windows)))
        self.train = WindowSplit("train", windows[: num_windows - num_val])
        self.val = WindowSplit("val", windows[num_windows - num_val:])

    @property
    def num_windows(self) -> int:
        return len(self.train) + len(self.val)

    @classmethod
    def from_corpus(cls, corpus: Corpus, tokenizer: Tokenizer, *, seq_len: int, cache_dir: Path,
                    val_fraction: float = 0.1, log: Log = print) -> TokenDataset:
        """Tokenise ``corpus`` (once: the ids are cached in ``cache_dir`` as
        ``tokens-<corpus hash>-<tokenizer hash>.npy``) and cut it into windows."""
        tokenizer_hash = hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()
        cached = Path(cache_dir) / f"tokens-{corpus.sha256[:16]}-{tokenizer_hash[:16]}.npy"
        ids = _load_token_cache(cached, tokenizer_rows(tokenizer), log)
        if ids is None:
            ids = encode_text(tokenizer, corpus.text)
            _write_cache(cached, _npy_bytes(ids), log)
            log(f"data: tokenised {corpus.name}: {ids.size:,} tokens, cached as {cached}")
        else:
            log(f"data: {ids.size:,} tokens of {corpus.name} from cache {cached}")
        dataset = cls(torch.from_numpy(ids), seq_len=seq_len, val_fraction=val_fraction)
        log(f"data: {dataset.num_windows:,} windows of {seq_len + 1} tokens: "
            f"{len(dataset.train):,} train, {len(dataset.val):,} validation")
        return dataset


def _npy_bytes(ids: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    return buffer.getvalue()


def _load_token_cache(path: Path, rows: int, log: Log) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        log(f"data: cached tokens {path} are unreadable ({e}); tokenising again")
        return None
    if ids.ndim != 1 or ids.dtype != np.int32 or ids.size == 0 or int(ids.max()) >= rows \
            or int(ids.min()) < 0:
        log(f"data: cached tokens {path} do not match the tokenizer; tokenising again")
        return None
    return ids


def batch(split: WindowSplit, indices: torch.Tensor | list[int], *,
          device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows at ``indices`` as ``(inputs, targets)``, both ``[B, seq_len]`` int64;
    ``targets[b, t]`` is the token after ``inputs[b, t]``."""
    index = torch.as_tensor(indices, dtype=torch.int64)
    windows = split.windows[index].to(torch.int64)  # (B, T+1)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    if device is not None:
        inputs, targets = inputs.to(device), targets.to(device)
    return inputs.contiguous(), targets.contiguous()


# ----------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------

class WindowSampler:
    """Deterministic distributed sampler over ``num_samples`` windows, with a resumable position.

    Epoch ``e`` uses the permutation ``torch.randperm(num_samples)`` drawn from
    ``torch.Generator().manual_seed(seed + e)``; every rank computes the same one. A step consumes
    the next ``world_size * batch_size`` positions of it, and rank ``r`` takes positions
    ``r, r + W, r + 2W, ...`` of that block, so over an epoch rank ``r`` sees positions
    ``r, r + W, ...``: ranks are disjoint and each sample is seen at most once per epoch.

    The epoch is truncated to a multiple of ``world_size * batch_size`` (``steps_per_epoch``
    steps), like ``DistributedSampler(drop_last=True)``: every rank takes the same number of
    equal batches. The dropped remainder is different samples each epoch, since the permutation
    differs, so no sample is left out for good.

    The position is ``(epoch, samples_done)``: how many permutation positions the whole group has
    consumed in this epoch. It is advanced as each batch is handed out and rolls over to the next
    epoch as soon as an epoch is exhausted, so ``state_dict()`` taken after training on a batch
    resumes with exactly the next one. Because it counts samples of the whole group, a state
    saved by one world size or batch size also loads into another (resharding): the new layout
    continues from the same permutation position; only that epoch's dropped remainder differs.
    """

    def __init__(self, num_samples: int, *, rank: int, world_size: int, batch_size: int,
                 seed: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"sampler: rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        if num_samples < world_size * batch_size:
            raise DataError(f"the training split has {num_samples:,} windows, fewer than one step "
                            f"needs (world_size {world_size} x batch size {batch_size} = "
                            f"{world_size * batch_size:,}); use a smaller batch size, fewer "
                            f"ranks, a shorter sequence length or a longer text")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._samples_done = 0  # positions of this epoch's permutation consumed by all ranks
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) memo

    @property
    def samples_per_step(self) -> int:
        """Samples consumed by the whole group per step: ``world_size * batch_size``."""
        return self.world_size * self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps (batches per rank) in a full epoch."""
        return self.num_samples // self.samples_per_step

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_done(self) -> int:
        """Batches of this sampler's size already drawn in the current epoch. After resuming from
        a state saved with another world size or batch size, the samples that run consumed are
        counted in batches of the current size, rounded down."""
        return self._samples_done // self.samples_per_step

    @property
    def samples_done(self) -> int:
        """Permutation positions of the current epoch consumed by the whole group."""
        return self._samples_done

    def steps_left_in_epoch(self) -> int:
        """Steps until the current epoch is exhausted."""
        return (self.num_samples - self._samples_done) // self.samples_per_step

    def steps_until(self, epochs: int) -> int:
        """Steps still to take until ``epochs`` epochs (counted from epoch 0) are complete."""
        if self._epoch >= epochs:
            return 0
        return self.steps_left_in_epoch() + (epochs - self._epoch - 1) * self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of all samples (the same on every rank), ``[num_samples]``."""
        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._perm[1]

    def next_batch(self) -> torch.Tensor:
        """This rank's next batch of sample indices, ``[batch_size]`` int64, and advance."""
        step = self.samples_per_step
        block = self.permutation(self._epoch)[self._samples_done: self._samples_done + step]
        indices = block.view(self.batch_size, self.world_size)[:, self.rank].clone()
        self._samples_done += step
        self._roll_over()
        return indices

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Batches without end, from the current position, across epochs; stop the loop by step
        count (``steps_until``) or by ``epoch``."""
        while True:
            yield self.next_batch()

    def _roll_over(self) -> None:
        if self.num_samples - self._samples_done < self.samples_per_step:
            self._epoch += 1
            self._samples_done = 0

    def state_dict(self) -> dict[str, int]:
        """The position, to save with a checkpoint. ``epoch``, ``batches_done`` and ``seed`` say
        where the run is; ``samples_done``, ``num_samples``, ``world_size`` and ``batch_size``
        let ``load_state_dict`` check the data and resume under another layout."""
        return {
            "epoch": self._epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "samples_done": self._samples_done,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Needs ``epoch``, ``seed`` and either ``samples_done``
        or ``batches_done`` (the latter counted in this sampler's step size). A different seed or
        number of samples is a ``DataError``: the run would not continue the same data order."""
        missing = [key for key in ("epoch", "seed") if key not in state]
        if missing or ("samples_done" not in state and "batches_done" not in state):
            raise DataError(f"sampler state lacks {missing or ['samples_done/batches_done']}: "
                            f"got keys {sorted(state)}")
        if int(state["seed"]) != self.seed:
            raise DataError(f"sampler state was saved with seed {state['seed']} but this run uses "
                            f"seed {self.seed}; resume with the same seed")
        if "num_samples" in state and int(state["num_samples"]) != self.num_samples:
            raise DataError(f"sampler state was saved for {state['num_samples']:,} training "
                            f"windows but this run has {self.num_samples:,}; the corpus, "
                            f"tokenizer, sequence length or validation split changed")
        if "samples_done" in state:
            samples_done = int(state["samples_done"])
        else:
            samples_done = int(state["batches_done"]) * self.samples_per_step
        epoch = int(state["epoch"])
        if epoch < 0 or not 0 <= samples_done <= self.num_samples:
            raise DataError(f"sampler state is out of range: epoch {epoch}, {samples_done:,} "
                            f"samples done of {self.num_samples:,}")
        self._epoch = epoch
        self._samples_done = samples_done
        self._roll_over()


def eval_batches(num_samples: int, *, rank: int, world_size: int,
                 batch_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s share of an evaluation pass over ``num_samples`` windows, in order.

    Rank ``r`` takes samples ``r, r + W, ...``, in batches of ``batch_size`` (the last may be
    shorter); nothing is dropped, so ranks may hold one sample more than others, and a rank can
    have no batch at all when ``num_samples < world_size``. Average losses over ranks weighted
    by sample count.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"eval: rank {rank} is not in [0, world_size={world_size})")
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1, got {batch_size}")
    mine = torch.arange(rank, num_samples, world_size, dtype=torch.int64)
    return list(torch.split(mine, batch_size))
