"""The tokenizer of a run: a ``tokenizer.json`` file, or a byte-level BPE trained on the corpus
and cached by corpus hash and vocabulary size; and encoding text with it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from neox.data.corpus import Corpus
from neox.data.files import DataError, Log, write_cache

# The trained BPE gets GPT-NeoX's end-of-text token so that generated text can stop on it.
BPE_SPECIAL_TOKENS = ("<|endoftext|>",)
_MIN_BPE_VOCAB = 256 + len(BPE_SPECIAL_TOKENS)  # every byte, plus the special tokens


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
    write_cache(cached, tokenizer.to_str().encode("utf-8"), log)
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

