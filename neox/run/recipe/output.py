"""What a run writes, and where."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from neox.run.recipe.declaring import (AT_LEAST_0, AT_LEAST_1, OUTPUT, at_least,
                                       check_fields, is_bool)
from neox.setting import Flag, finite_float, is_finite, setting

__all__ = ["OutputConfig"]


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """What the run writes, and where."""

    output_dir: str = setting(
        str(Path("runs") / "neox-finetune"), check=lambda x: isinstance(x, str) and x != "",
        problem="{name} must be a path, got {value!r}",
        flag=Flag(OUTPUT, "metrics.jsonl, checkpoints/, trainable.safetensors, hf/ go here; one "
                          "run per directory", parse=Path, store=str, resumable=True))
    save_every: int = setting(
        0, check=at_least(0), problem=AT_LEAST_0,
        flag=Flag(OUTPUT, "save a sharded checkpoint every N steps (0: only at the end)",
                  parse=int, resumable=True))
    keep_last: int = setting(
        3, check=at_least(1), problem=AT_LEAST_1,
        flag=Flag(OUTPUT, "checkpoints of this run to keep", parse=int, resumable=True))
    export_hf: bool = setting(
        False, check=is_bool, problem="{name} must be a bool",
        flag=Flag(OUTPUT, "also write the fine-tuned model as a Hugging Face directory (LoRA "
                          "merged) to OUTPUT_DIR/hf", resumable=True))
    sample_tokens: int = setting(
        48, check=at_least(0), problem=AT_LEAST_0,
        flag=Flag(OUTPUT, "print a sample of this many tokens at the end, continuing the start "
                          "of the validation text (0: none)", parse=int, resumable=True))
    # The end-of-run sample's temperature; 0: greedy, the same text for the same weights.
    sample_temperature: float = setting(
        0.8, check=lambda x: is_finite(x) and x >= 0, since=3,
        problem="{name} must be a finite number >= 0 (0: greedy), got {value!r}",
        flag=Flag(OUTPUT, "temperature of that sample (0: greedy, so that two runs' samples "
                          "differ only where their weights do)", parse=finite_float,
                  resumable=True))
    measure_memory: bool = setting(
        False, check=is_bool, problem="{name} must be a bool",
        flag=Flag(OUTPUT, "measure each rank's peak memory over the training steps after the "
                          "first (torch's profiler on the CPU, the allocator's peak on a GPU) and "
                          "print it beside python -m neox.plan's prediction, with each rank's "
                          "peak resident set", resumable=True))

    def __post_init__(self) -> None:
        check_fields(self, "recipe.output")
