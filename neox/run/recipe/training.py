"""The training loop: batches, steps, evaluation, the data order, and when a diverged run
stops."""

from __future__ import annotations

import dataclasses

from neox.run.recipe.declaring import (AT_LEAST_0, AT_LEAST_1, FROM_SCRATCH, LOOP, STEP, at_least,
                                       check_fields)
from neox.setting import Flag, is_int, setting

__all__ = ["TrainingConfig"]


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """Batches, steps, evaluation and the data order."""

    batch_size: int = setting(
        16, check=at_least(1), problem=AT_LEAST_1,
        flag=Flag(STEP, "sequences per rank per micro-batch", parse=int, resumable=True))
    grad_accum: int = setting(
        1, check=at_least(1), problem=AT_LEAST_1,
        flag=Flag(STEP, "micro-batches per optimizer step", parse=int, resumable=True))
    epochs: int = setting(
        1, check=at_least(1), problem=AT_LEAST_1,
        flag=Flag(LOOP, f"passes over the training windows, each seen once per epoch (default: "
                        f"1; {FROM_SCRATCH['epochs']} when training from scratch)", parse=int,
                  resumable=True))
    max_steps: int | None = setting(
        None, check=lambda x: x is None or at_least(1)(x),
        problem="{name} must be >= 1 or null, got {value!r}",
        flag=Flag(LOOP, "stop after this many steps (default: the epochs' steps)", parse=int,
                  resumable=True))
    eval_every: int = setting(
        0, check=at_least(0), problem=AT_LEAST_0,
        flag=Flag(LOOP, "validate every N steps (0: at the end only)", parse=int,
                  resumable=True))
    seed: int = setting(0, check=is_int, problem="{name} must be an integer, got {value!r}",
                        follows="seed")   # the data order
    # steps in a row with NaN/inf loss or gradients: stop
    max_nonfinite_steps: int = setting(
        3, check=at_least(1), problem=AT_LEAST_1,
        flag=Flag(LOOP, "stop the run when the loss or the gradients have been NaN or infinite "
                        "this many steps in a row (nothing non-finite is ever saved)", parse=int,
                  resumable=True))

    def __post_init__(self) -> None:
        check_fields(self, "recipe.training")
