"""The recipe of a resumed run: the checkpoint's, with the flags given on the command line
applied. A flag its declaration marks ``resumable`` overrides the checkpoint's value (said in a
log line); any other must agree with the checkpoint, since it says which model or data is
trained. Or, continuing a DeepSpeed ZeRO-3 run, the flags' recipe with the DeepSpeed run's
optimizer settings for the optimizer flags not given.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Mapping

from neox.config import NeoXConfig
from neox.run import from_deepspeed as nds
from neox.run.progress import Log
from neox.run.recipe import Recipe, RecipeError, recipe_fields, recipe_from_checkpoint
from neox.setting import UsageError, absolute_path, flag_dest, flag_name, setting_of
from zerocore.checkpoint import CheckpointError, open_checkpoint, unverified_reason

__all__ = ["resume_recipe", "deepspeed_recipe", "DEEPSPEED_OPTIM_FLAGS"]

# The optimizer flags a run resumed from DeepSpeed takes from the DeepSpeed run when not given.
DEEPSPEED_OPTIM_FLAGS = ("lr", "betas", "eps", "weight_decay")


def _at(recipe: Recipe, path: tuple[str, ...]) -> Any:
    return functools.reduce(getattr, path, recipe)


def _replaced(obj: Any, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()
              ) -> Any:
    """``obj`` (a recipe, or a part of one at ``path``) with the fields at ``values``' paths
    replaced."""
    changes = {}
    for field in dataclasses.fields(obj):
        here = path + (field.name,)
        if here in values:
            changes[field.name] = values[here]
        elif any(p[:len(here)] == here for p in values):
            changes[field.name] = _replaced(getattr(obj, field.name), values, here)
    return dataclasses.replace(obj, **changes)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return "(none)" if value is None else str(value)


def resume_recipe(flags: Recipe, explicit: set[str], checkpoint: Path, *,
                  allow_unverified: bool, log: Log) -> Recipe:
    """The recipe of a run resumed from ``checkpoint``: its own, with the flags in ``explicit``
    (the dests given on the command line) taken from ``flags``. The whole checkpoint is
    verified first (every rank file's checksum, identity and contents): nothing its recipe
    names (data, cache, output directory, weights) is opened before."""
    try:
        manifest = open_checkpoint(checkpoint, allow_unverified=allow_unverified).manifest
        stored, _ = recipe_from_checkpoint(manifest["extra"], str(checkpoint))
    except (RecipeError, CheckpointError) as e:
        raise UsageError(f"--resume: {e}") from None
    if unverified_reason(manifest):
        log(f"note: {checkpoint} cannot be verified ({unverified_reason(manifest)}); resuming "
            f"from it as --allow-unverified asks")
    given = [(path, field, setting_of(field).flag) for path, field in recipe_fields()
             if setting_of(field).flag is not None and flag_dest(field) in explicit]
    for path, field, flag in given:
        if flag.resumable:
            continue
        ours, saved = _at(flags, path), _at(stored, path)
        if flag.store is absolute_path and ours is not None and saved is not None:
            ours, saved = absolute_path(ours), absolute_path(saved)
        if ours != saved:
            show = flag.text or _show
            raise UsageError(
                f"{flag_name(field)} {show(ours)} differs from the checkpoint's {show(saved)}; a "
                f"resumed run continues the same model and data: drop the flag, or start a new "
                f"run (without --resume)")
    changed = {}
    for path, field, flag in given:
        ours, saved = _at(flags, path), _at(stored, path)
        if flag.resumable and ours != saved:
            changed[path] = ours
            show = flag.text or _show   # as the flag writes it ("--offload-pool auto")
            log(f"resume: {flag_name(field)} {show(ours)} overrides the checkpoint's "
                f"{show(saved)}")
    return _replaced(stored, changed)


def deepspeed_recipe(flags: Recipe, explicit: set[str], checkpoint: Path, config: NeoXConfig,
                     log: Log) -> Recipe:
    """The recipe of a run continuing the DeepSpeed checkpoint ``checkpoint`` of a model of
    ``config``: the flags', with the DeepSpeed run's optimizer settings for the optimizer flags
    not given. The checkpoint is opened and checked whole (its pickles read safely), and what
    the flags train is checked against what it trained, before any process starts."""
    try:
        ckpt = nds.DeepSpeedCheckpoint(checkpoint)
        nds.check_resume(ckpt, config, flags.model)
    except (CheckpointError, ValueError) as e:  # DeepSpeedCheckpointError is both
        raise UsageError(f"--resume: {e}") from None
    ours = nds.optimizer_settings(ckpt)
    parts = flags.to_dict()
    for dest in DEEPSPEED_OPTIM_FLAGS:
        if dest in ours and dest not in explicit:
            value = list(ours[dest]) if dest == "betas" else ours[dest]
            if parts["optim"][dest] != value:
                log(f"resume: --{dest.replace('_', '-')} {_show(value)}: the DeepSpeed run's "
                    f"(give the flag to change it)")
            parts["optim"][dest] = value
    log(f"resume: continuing the DeepSpeed run of {nds.describe(ckpt)} as a new run of these "
        f"flags")
    return Recipe.from_dict(parts)
