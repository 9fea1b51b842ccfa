"""The text a run trains on, prepared once for all ranks, and checked against the checkpoint a
resumed run continues: a changed text is refused unless ``--data-changed``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


import zerocore
from neox import data as nd
from neox.run.recipe import DataConfig, ModelRecipe, Recipe
from neox.run.run_dir import DATA_SHA256, TOKENIZER, TOKENIZER_SHA256
from neox.run.progress import Log
from neox.run.trained import find_tokenizer


@dataclasses.dataclass
class RunData:
    tokenizer: Any
    dataset: nd.TokenDataset
    corpus: nd.Corpus
    changed: bool = False      # a resumed run's text changed, as --data-changed accepts


@dataclasses.dataclass(frozen=True)
class ResumedData:
    """What the checkpoint a run resumes from says about the text it trained on."""

    checkpoint: Path
    sha256: str | None            # Corpus.sha256; None: saved before neox recorded it
    tokenizer_copy: Path | None   # the run's tokenizer.json (its checksum matches), if found
    accept_change: bool           # --data-changed


def resumed_data(checkpoint: Path, recipe: Recipe, *, allow_unverified: bool,
                 accept_change: bool) -> ResumedData:
    """``ResumedData`` of a checkpoint that neox.finetune verified before the launch."""
    extra = zerocore.read_manifest(checkpoint, allow_unverified=allow_unverified)["extra"]
    sha, tok_sha = extra.get(DATA_SHA256), extra.get(TOKENIZER_SHA256)
    copy = (find_tokenizer(checkpoint, recipe, tok_sha)[0] if isinstance(tok_sha, str)
            else None)
    return ResumedData(checkpoint, sha if isinstance(sha, str) else None, copy, accept_change)


def check_data(corpus: nd.Corpus, resumed: ResumedData | None, log: Log) -> bool:
    """Whether a resumed run's text is the one its checkpoint trained on: refused when it
    changed (the sampler's position would point into other text, and samples be trained twice
    or never), unless ``--data-changed``; then True."""
    if resumed is None:
        return False
    if resumed.sha256 is None:
        log(f"note: {resumed.checkpoint} records no digest of its training data (saved before "
            f"neox recorded one): {corpus.source} is used unchecked")
        return False
    old, new = resumed.sha256[:12], corpus.sha256[:12]
    if corpus.sha256 == resumed.sha256:
        if resumed.accept_change:
            log(f"data: --data-changed, but {corpus.source} is the text the run trained on "
                f"(sha256 {new}...): the run continues at its sampler's position")
        return False
    if not resumed.accept_change:
        raise nd.DataError(
            f"--resume: the training data changed: {corpus.source} (sha256 {new}...) is not the "
            f"text the run of {resumed.checkpoint} trained on (sha256 {old}...); restore it, or "
            f"pass --data-changed to continue the run on the new text")
    log(f"data: --data-changed: {corpus.source} differs from the text the run trained on "
        f"(sha256 {old}... -> {new}...): the weights, optimizer state and schedule continue from "
        f"the checkpoint; the data order restarts at the beginning of the current epoch, over "
        f"the new text's windows")
    return True


def prepare_data(data: DataConfig, model: ModelRecipe, *, rank: int, log: Log,
                 resumed: ResumedData | None = None) -> RunData:
    """Rank 0 prepares (downloads, trains the tokenizer, tokenises) into the cache first; the
    others then read the cache instead of repeating the work. A resumed run's text is checked
    against its checkpoint's (``check_data``) before anything is derived from it."""
    cache_dir = Path(data.cache_dir) if data.cache_dir else nd.default_cache_dir()

    def load() -> RunData:
        data_dir = Path(data.data_dir) if data.data_dir else nd.default_data_dir()
        corpus = nd.load_corpus(data.data, cache_dir=cache_dir, data_dir=data_dir, log=log)
        changed = check_data(corpus, resumed, log)
        tok_path = Path(data.tokenizer) if data.tokenizer else None
        if tok_path is None and model.checkpoint is not None and (
                Path(model.checkpoint) / TOKENIZER).is_file():
            tok_path = Path(model.checkpoint) / TOKENIZER
        if tok_path is None and changed:
            # The run's tokenizer was trained on the earlier text: a new one would not match
            # the embeddings. The run keeps a copy of it.
            if resumed.tokenizer_copy is None:
                raise nd.DataError(
                    f"--data-changed: the run of {resumed.checkpoint} trained its tokenizer on "
                    f"the earlier text, and its copy (tokenizer.json beside the checkpoints, "
                    f"matching the checkpoint's checksum) was not found; restore it")
            tok_path = resumed.tokenizer_copy
        tokenizer = nd.load_tokenizer(tok_path, corpus=corpus, cache_dir=cache_dir, log=log)
        dataset = nd.TokenDataset.from_corpus(corpus, tokenizer, seq_len=data.seq_len,
                                              cache_dir=cache_dir,
                                              val_fraction=data.val_fraction, log=log)
        return RunData(tokenizer, dataset, corpus, changed)

    first = zerocore.run_agreed(load if rank == 0 else (lambda: None))
    return zerocore.run_agreed(lambda: first if first is not None else load())
