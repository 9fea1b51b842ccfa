"""Which model a run trains: the weights it starts from, the kept blocks, the fine-tuning mode,
the compute dtype and the seed of its random initialisation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from neox.config import PRESETS
from neox.dtypes import DTYPES
from neox.finetune_modes import FinetuneMode
from neox.run.recipe.declaring import (MODEL, MUST_BE_PATH, blocks, check_fields,
                                       is_bool, path_or_none)
from neox.setting import Flag, absolute_path, is_int, setting

__all__ = ["ModelRecipe"]


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """Which model is trained, and how: the weights it starts from, the kept blocks, the
    fine-tuning mode and the compute dtype."""

    checkpoint: str | None = setting(
        None, check=path_or_none, problem=MUST_BE_PATH,
        flag=Flag(MODEL, "pretrained weights: a Hugging Face GPT-NeoX directory (e.g. a run's "
                         "OUTPUT_DIR/hf) or EleutherAI 20B slim-weights directory; without it "
                         "--model picks a randomly initialised preset",
                  parse=Path, store=absolute_path))
    preset: str = setting(
        "tiny", check=lambda x: isinstance(x, str), problem="{name} must be a name, got {value!r}",
        flag=Flag(MODEL, "preset when no --checkpoint (random initialisation, for machines "
                         "without weights)", name="--model", choices=tuple(sorted(PRESETS))))
    filter_layers: tuple[int, ...] | None = setting(
        None, check=lambda x: x is None or blocks(x),
        problem="{name} must be block indices or null, got {value!r}",
        flag=Flag(MODEL, "keep only these transformer blocks, 0-based as in the checkpoint, e.g. "
                         "'0,1' or '0-3'; embedding, final norm and readout are always kept "
                         "(default: all)", late=True))
    allow_outside_weights: bool = setting(
        False, check=is_bool, problem="{name} must be a bool",
        flag=Flag(MODEL, "follow weight-index entries and 'latest' pointers that lead out of the "
                         "--checkpoint directory (refused by default)"))
    dtype: str | None = setting(
        None, check=lambda x: x is None or x in DTYPES,
        problem="{name} must be fp32, bf16, fp16 or null, got {value!r}",
        flag=Flag(MODEL, "compute dtype (default: fp32 on the CPU, bf16 on a GPU)",
                  choices=tuple(DTYPES)))
    seed: int = setting(
        0, check=is_int, problem="{name} must be an integer, got {value!r}",
        flag=Flag(MODEL, "seeds a preset's random weights, the LoRA adapters and the data order",
                  parse=int))
    finetune: FinetuneMode = setting(
        FinetuneMode(), check=lambda x: isinstance(x, FinetuneMode),
        problem="{name} must be a FinetuneMode")

    def __post_init__(self) -> None:
        check_fields(self, "recipe.model")
