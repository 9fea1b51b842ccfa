"""Evaluating a model on token windows, in one process: the windows of a text, or of the
validation split of the run whose checkpoint was loaded; mean token loss, perplexity and
accuracy, every predicted token counted once (``python -m neox.evaluate``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from neox import data as nd
from neox.run.inference import Loaded
from neox.run.progress import Progress

__all__ = ["read_text", "run_corpus", "run_validation_windows", "token_windows",
           "evaluate_windows"]


def read_text(path: Path | None, data_dir: Path | None) -> nd.Corpus:
    """The text to evaluate on: ``path``, or tiny_shakespeare from the cache or the data
    directory (no download: offline, the standard library's help texts stand in, as in a run;
    the corpus says which it is)."""
    return nd.load_corpus(path, cache_dir=nd.default_cache_dir(),
                          data_dir=data_dir or nd.default_data_dir(), url=None,
                          log=lambda *a, **k: None)


def run_corpus(loaded: Loaded) -> nd.Corpus:
    """The text the run whose checkpoint was loaded trained on, found where its recipe says
    and checked against the SHA-256 its checkpoint records: tiny_shakespeare of the run's cache
    or data directory, or, when the run fell back to it offline, the standard library's help
    texts. ValueError when the text found is another (the run's validation windows cannot be
    rebuilt from it); a checkpoint that recorded no digest gets the text found, unchecked."""
    data = loaded.recipe.data
    corpus = nd.load_corpus(data.data, cache_dir=Path(data.cache_dir or nd.default_cache_dir()),
                            data_dir=Path(data.data_dir) if data.data_dir else
                            nd.default_data_dir(), url=None, log=lambda *a, **k: None)
    recorded = loaded.data_sha256
    if recorded is None or corpus.sha256 == recorded:
        return corpus
    if data.data is None and nd.offline_corpus().sha256 == recorded:
        return nd.offline_corpus()  # the run had no tiny_shakespeare; this machine has one now
    raise ValueError(
        f"the run of {loaded.source} trained on a text with sha256 {recorded[:12]}..., and "
        f"{corpus.source} (sha256 {corpus.sha256[:12]}...) is another: the run's validation "
        f"windows cannot be rebuilt from it; restore the run's text (--data-dir, or its "
        f"--data file), or give a TEXT to evaluate on")


def run_validation_windows(loaded: Loaded, corpus: nd.Corpus
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation windows of the run whose checkpoint was loaded, cut from ``corpus``
    (``run_corpus``) with its tokenizer, sequence length and split, so the loss is comparable
    with the run's own validation line."""
    data = loaded.recipe.data
    dataset = nd.TokenDataset.from_corpus(
        corpus, loaded.tokenizer, seq_len=data.seq_len,
        cache_dir=Path(data.cache_dir or nd.default_cache_dir()),
        val_fraction=data.val_fraction, log=lambda *a, **k: None)
    windows = dataset.val.windows.long()
    return windows[:, :-1], windows[:, 1:]


def token_windows(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token stream cut into (inputs, targets) windows of ``seq_len``."""
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"the text has {tokens.numel()} tokens; --seq-len {seq_len} needs at "
                         f"least {seq_len + 1}")
    # Window i predicts tokens[i*T+1 .. (i+1)*T] from tokens[i*T .. (i+1)*T - 1].
    inputs = tokens[: n * seq_len].view(n, seq_len)
    targets = tokens[1: n * seq_len + 1].view(n, seq_len)
    return inputs, targets


@torch.no_grad()
def evaluate_windows(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                     batch_size: int, device: torch.device, progress: bool = False
                     ) -> dict[str, float]:
    """Loss, perplexity and accuracy of predicting ``targets`` (N, T) from ``inputs`` (N, T),
    every token counted once."""
    n, seq_len = inputs.shape
    loss_sum = correct = 0.0
    bar = Progress(-(-n // batch_size), enabled=progress, stream=sys.stderr)
    for b, start in enumerate(range(0, n, batch_size)):
        x = inputs[start:start + batch_size].to(device)
        y = targets[start:start + batch_size].to(device)
        logits = model(x).float()
        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        bar.update(b + 1, f"loss {loss_sum / ((start + len(x)) * seq_len):.4f}")
    bar.close()
    count = n * seq_len
    loss = loss_sum / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)), "accuracy": correct / count,
            "tokens": count, "windows": n}
