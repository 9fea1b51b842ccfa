"""Training data for GPT-NeoX fine-tuning, one concept per module, in the order a run uses them:

- ``corpus``: the text (``load_corpus``): a local file, or tiny_shakespeare found in a cache, a
  data directory or downloaded (always checked against its SHA-256), or an offline fallback.
- ``tokenizer``: a ``tokenizer.json``, or a byte-level BPE trained on the corpus and cached.
- ``windows``: the corpus tokenised once (cached) and cut into windows of ``seq_len + 1`` tokens
  (``TokenDataset``), the last ones held out for validation; ``batch`` of windows.
- ``sampler``: ``WindowSampler``, the resumable distributed sampler, and ``eval_batches``.
- ``files``: ``DataError``, atomic cache writes, default directories.

User errors raise ``DataError`` (a ``ValueError``) with a message that names the file or setting
and says what to do.
"""

from neox.data.files import DataError, default_cache_dir, default_data_dir
from neox.data.corpus import (TINY_SHAKESPEARE_FILE, TINY_SHAKESPEARE_SHA256,
                              TINY_SHAKESPEARE_URL, Corpus, load_corpus, offline_corpus)
from neox.data.tokenizer import (BPE_SPECIAL_TOKENS, check_vocab, encode_text, load_tokenizer,
                                 tokenizer_rows, train_bpe)
from neox.data.windows import TokenDataset, WindowSplit, batch
from neox.data.sampler import WindowSampler, eval_batches

__all__ = [
    "BPE_SPECIAL_TOKENS", "Corpus", "DataError", "TINY_SHAKESPEARE_FILE",
    "TINY_SHAKESPEARE_SHA256", "TINY_SHAKESPEARE_URL", "TokenDataset", "WindowSampler",
    "WindowSplit", "batch",
    "check_vocab", "default_cache_dir", "default_data_dir", "encode_text", "eval_batches",
    "load_corpus", "load_tokenizer", "offline_corpus", "tokenizer_rows", "train_bpe",
]
