"""Where a run's text and tokenizer come from, and how the text is cut into windows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from neox import data as nd
from neox.run.recipe.declaring import (DATA, MUST_BE_PATH, STEP, at_least,
                                       check_fields, path_or_none)
from neox.setting import Flag, absolute_path, finite_float, is_finite, setting

__all__ = ["DataConfig"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text and the tokenizer come from, and how the text is cut."""

    data: str | None = setting(
        None, check=path_or_none, problem=MUST_BE_PATH,
        flag=Flag(DATA, "a local UTF-8 text file to train on (default: tiny_shakespeare)",
                  parse=Path, store=absolute_path))
    data_dir: str | None = setting(
        None, check=path_or_none, problem=MUST_BE_PATH,
        flag=Flag(DATA, "local copies of the default corpus and tokenizer (default: "
                        "shared/data beside the repository)", parse=Path, store=absolute_path,
                  env="NEOX_DATA_DIR", resumable=True), per_node=True)
    tokenizer: str | None = setting(
        None, check=path_or_none, problem=MUST_BE_PATH,
        flag=Flag(DATA, "tokenizer.json (default: the checkpoint's, else a byte-level BPE "
                        "trained on the corpus and cached)", parse=Path, store=absolute_path))
    cache_dir: str | None = setting(
        None, check=path_or_none, problem=MUST_BE_PATH,
        flag=Flag(DATA, "downloaded corpus, trained tokenizers and tokenised data are kept here",
                  parse=Path, store=absolute_path, default=nd.default_cache_dir,
                  has_default=True, resumable=True), per_node=True)
    seq_len: int = setting(
        128, check=at_least(1), problem="{name} must be >= 1, got {value!r}",
        flag=Flag(STEP, "tokens per sequence", parse=int))
    val_fraction: float = setting(
        0.1, check=lambda x: is_finite(x) and 0 <= x < 1,
        problem="{name} must be in [0, 1), got {value!r}",
        flag=Flag(DATA, "fraction of the windows (the corpus's end) held out for validation",
                  parse=finite_float))

    def __post_init__(self) -> None:
        check_fields(self, "recipe.data")
