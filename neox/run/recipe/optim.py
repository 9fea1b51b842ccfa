"""AdamW, its learning-rate schedule and gradient clipping."""

from __future__ import annotations

import dataclasses

from neox.run.recipe.declaring import FROM_SCRATCH, OPTIM, at_least, check_fields
from neox.setting import Flag, finite_float, is_finite, setting

__all__ = ["OptimConfig"]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = setting(
        3e-4, check=lambda x: is_finite(x) and x > 0,
        problem="{name} must be a finite number > 0, got {value!r}",
        flag=Flag(OPTIM, f"peak learning rate (default: {3e-4:g}; {FROM_SCRATCH['lr']:g} when "
                         f"training from scratch)", parse=finite_float, resumable=True))
    warmup: int = setting(
        0, check=at_least(0), problem="{name} must be >= 0, got {value!r}",
        flag=Flag(OPTIM, f"linear warm-up steps (default: 0; {FROM_SCRATCH['warmup']} when "
                         f"training from scratch)", parse=int, resumable=True))
    weight_decay: float = setting(
        0.0, check=lambda x: is_finite(x) and x >= 0,
        problem="{name} must be a finite number >= 0, got {value!r}",
        flag=Flag(OPTIM, "AdamW decoupled weight decay", parse=finite_float, resumable=True))
    # global gradient-norm clip; 0: off
    clip: float = setting(
        1.0, check=lambda x: is_finite(x) and x >= 0,
        problem="{name} must be a finite number >= 0 (0: off), got {value!r}",
        flag=Flag(OPTIM, "global gradient-norm clip (0: off)", parse=finite_float,
                  resumable=True))
    betas: tuple[float, float] = setting(
        (0.9, 0.999), check=lambda x: isinstance(x, tuple) and len(x) == 2 and all(
            is_finite(b) and 0 <= b < 1 for b in x),
        problem="{name} must be two numbers in [0, 1), got {value!r}",
        flag=Flag(OPTIM, "Adam's moment decay rates", parse=finite_float, nargs=2,
                  metavar=("BETA1", "BETA2"), resumable=True))
    eps: float = setting(
        1e-8, check=lambda x: is_finite(x) and x > 0,
        problem="{name} must be a finite number > 0, got {value!r}",
        flag=Flag(OPTIM, "Adam's epsilon", parse=finite_float, resumable=True))

    def __post_init__(self) -> None:
        check_fields(self, "recipe.optim")
