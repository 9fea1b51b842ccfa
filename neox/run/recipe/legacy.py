"""Reading a checkpoint's recipe, whatever neox wrote it: the current stored form (every
version, ``Recipe.from_dict``), or the form before recipes existed: the command line's
``vars(args)``, stored under ``extra["args"]`` (neox.finetune's flags at commit fb213e3), read
here, in this one place."""

from __future__ import annotations

from typing import Any, Mapping

from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode
from neox.run.recipe.data import DataConfig
from neox.run.recipe.declaring import RecipeError
from neox.run.recipe.model import ModelRecipe
from neox.run.recipe.offload import OffloadConfig
from neox.run.recipe.optim import OptimConfig
from neox.run.recipe.output import OutputConfig
from neox.run.recipe.recipe import Recipe
from neox.run.recipe.training import TrainingConfig

__all__ = ["recipe_from_checkpoint"]


def _from_legacy_args(a: Mapping[str, Any]) -> Recipe:
    """A recipe from the ``vars(args)`` that checkpoints stored before ``RECIPE_VERSION`` 1
    (neox.finetune's flags at commit fb213e3). Only fields that were flags then exist here;
    the rest take their defaults."""
    try:
        filter_layers = a["filter_layers"]
        return Recipe(
            model=ModelRecipe(
                checkpoint=a["checkpoint"], preset=a["model"], seed=a["seed"],
                filter_layers=tuple(filter_layers) if filter_layers is not None else None,
                finetune=FinetuneMode(
                    a["finetune"], lora_rank=a["lora_rank"], lora_alpha=a["lora_alpha"],
                    lora_targets=tuple(t.strip() for t in a["lora_targets"].split(",")),
                    seed=a["seed"]),
                dtype=a["dtype"]),
            data=DataConfig(data=a["data"], data_dir=a["data_dir"], tokenizer=a["tokenizer"],
                            cache_dir=a["cache_dir"], seq_len=a["seq_len"],
                            val_fraction=a["val_fraction"]),
            optim=OptimConfig(lr=a["lr"], warmup=a["warmup"], weight_decay=a["weight_decay"],
                              clip=a["clip"]),
            training=TrainingConfig(batch_size=a["batch_size"], grad_accum=a["grad_accum"],
                                    epochs=a["epochs"], max_steps=a["max_steps"],
                                    eval_every=a["eval_every"], seed=a["seed"]),
            offload=OffloadConfig(offload_optimizer=a["offload_optimizer"]),
            output=OutputConfig(output_dir=a["output_dir"], save_every=a["save_every"],
                                keep_last=max(1, a["keep_last"]), export_hf=a["export_hf"]))
    except KeyError as e:
        raise RecipeError(f"run settings (old format): {e.args[0]!r} is missing") from None
    except (TypeError, AttributeError, ValueError) as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"run settings (old format): {e}") from None


def recipe_from_checkpoint(extra: Mapping[str, Any], where: str) -> tuple[Recipe, NeoXConfig]:
    """The recipe and model configuration a ``neox.finetune`` checkpoint stored (its manifest's
    ``extra``), in the current form or the one before ``RECIPE_VERSION`` 1. ``where`` names
    the checkpoint in messages. Raises ``RecipeError``."""
    if "recipe" in extra:
        try:
            recipe = Recipe.from_dict(extra["recipe"])
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None
    elif "args" in extra:
        try:
            recipe = _from_legacy_args(extra["args"])
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None
    else:
        raise RecipeError(f"{where}: not a checkpoint of neox.finetune (its manifest has no run "
                          f"recipe); use python -m zerocore.consolidate")
    if not isinstance(extra.get("config"), Mapping):
        raise RecipeError(f"{where}: the run's model configuration is missing from the manifest")
    try:
        config = NeoXConfig.from_hf_dict(extra["config"])
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: the stored model configuration is invalid: {e}") from None
    return recipe, config
