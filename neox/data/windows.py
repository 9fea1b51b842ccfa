"""Token windows: the corpus tokenised once (cached), cut into non-overlapping windows of
``seq_len + 1`` tokens, the last of them held out for validation; and batches of windows."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from neox.data.corpus import Corpus
from neox.data.files import DataError, Log, write_cache
from neox.data.tokenizer import encode_text, tokenizer_rows


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
            write_cache(cached, _npy_bytes(ids), log)
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
    inputs, targets = inputs.contiguous(), targets.contiguous()
    if device is not None and torch.device(device).type == "cuda":
        # Pinned, so the copies are asynchronous and overlap what the GPU is still doing.
        inputs = inputs.pin_memory().to(device, non_blocking=True)
        targets = targets.pin_memory().to(device, non_blocking=True)
    elif device is not None:
        inputs, targets = inputs.to(device), targets.to(device)
    return inputs, targets
