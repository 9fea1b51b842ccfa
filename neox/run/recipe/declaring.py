"""What the recipe's parts share to declare their fields (``neox.setting``): the checks and
messages several use, the --help sections their flags are listed in, and ``RecipeError``."""

from __future__ import annotations

import dataclasses
from typing import Any

from neox.finetune_modes import auto_mode
from neox.setting import is_int, problem

__all__ = ["RecipeError", "check_fields", "is_bool", "path_or_none", "blocks", "at_least",
           "MUST_BE_PATH", "AT_LEAST_0", "AT_LEAST_1", "MODEL", "STEP", "DATA", "OPTIM", "LOOP",
           "OUTPUT", "FROM_SCRATCH"]


class RecipeError(ValueError):
    """A stored recipe that cannot be read (unknown version, missing or mistyped field)."""


def check_fields(obj: Any, where: str) -> None:
    """``RecipeError`` naming ``where`` and the first field of ``obj`` its check refuses."""
    for field in dataclasses.fields(obj):
        message = problem(field, getattr(obj, field.name))
        if message is not None:
            raise RecipeError(f"{where}: {message}")


def is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def path_or_none(x: Any) -> bool:
    return x is None or (isinstance(x, str) and x.strip() != "")


def blocks(x: Any) -> bool:
    return isinstance(x, tuple) and all(is_int(i) and i >= 0 for i in x)


def at_least(n: int):
    return lambda x: is_int(x) and x >= n


MUST_BE_PATH = "{name} must be a path or null, got {value!r}"
AT_LEAST_1 = "{name} must be >= 1, got {value!r}"
AT_LEAST_0 = "{name} must be >= 0, got {value!r}"

# The --help sections, in the order the commands list them.
MODEL, STEP, DATA = "model", "the training step (what memory holds)", "data"
OPTIM = "optimisation (on --resume, given flags override the checkpoint's)"
LOOP, OUTPUT = "training loop", "output and checkpoints"

# The defaults of a fine-tuning run, and what replaces them when there are no pretrained
# weights (``--finetune auto`` without --checkpoint): a randomly initialised model learns
# nothing useful through its biases alone, so the built-in run trains the whole preset, at a
# learning rate and for a number of epochs at which the tiny preset visibly learns in a couple
# of minutes on 2 CPU cores. (dests of the flags -> values)
FROM_SCRATCH = {"finetune": auto_mode(has_weights=False), "lr": 2e-3, "warmup": 5, "epochs": 3}
