"""The run recipe: what a fine-tuning run is, as small typed, versioned, frozen dataclasses, one
per concern, each in its own module: the model (``model``), the text (``data``), the optimizer
(``optim``), the loop (``training``), the engine's policies for the layers (``sharding``), what
lives off the device (``offload``), how the ranks share the model across nodes (``layout``) and
what the run writes (``output``). Each part that concerns zerocore gives ``zerocore.shard`` its
policies itself (``recipe.sharding.policies(...)``, ``recipe.offload.policies()``,
``recipe.layout.policies(...)``).

Each field is declared once, with its check, its flag (its help, how its text is parsed) and
whether a resumed run may change it (``neox.setting``): the parser of ``neox.finetune`` and
``neox.plan``, the checks of a stored recipe, the identity checks of a resume
(``neox.run.resume``), the agreement of the ranks (``neox.run.same_recipe``) and their messages
derive from the declarations. Adding a flag is one field in the part it concerns, and its use.
Every checkpoint stores ``recipe.to_dict()`` (tagged with ``RECIPE_VERSION``; its sections are
version 7's, with version 8's field in ``loop``: ``neox.run.recipe.recipe``), and
``neox.export`` reads it back with ``Recipe.from_dict``. Renaming a command-line flag or moving a
field between parts therefore changes nothing stored.

Versions (``RECIPE_VERSION`` is the newest field's ``since``): 1, the first; 2 stores frozen
weights in the engine's words (``null`` or a format such as ``"int8"``, as
``zerocore.FrozenWeights``; version 1 wrote ``"compute"`` for ``null``) and holds every field;
3 adds ``sample_temperature``; 4, ``compile``; 5, ``offload`` (``--offload
params|optimizer|all``); 6, ``hybrid`` and ``quantize_gradients`` (``--hybrid hsdp``,
``--quantize-gradients int8``); 7, ``offload_device``, ``offload_path`` and ``offload_pool``
(``--offload-device nvme``); 8, ``frozen_placement`` (``--frozen-placement replicated``; older
recipes were sharded), and frozen weights may be ``"nf4"`` or ``"fp8"``; 9, ``offload_overlap``
(``--offload-overlap off``; older recipes load as ``"exact"``, bitwise what their runs did). A
field's ``since``
says from which version recipes always hold it; older ones may lack it and take its default,
and its ``upgrade`` turns their values into this version's. Checkpoints written before the recipe
existed stored the command line's ``vars(args)``; ``recipe_from_checkpoint``
(``neox.run.recipe.legacy``) reads that old form, in this one place.

How the run is launched (processes, ports, timeouts) and what this invocation does with the
output directory (resume, overwrite) are not part of the recipe: they do not change what is
trained.
"""

from neox.run.recipe.data import DataConfig
from neox.run.recipe.declaring import (DATA, FROM_SCRATCH, LOOP, MODEL, OPTIM, OUTPUT, STEP,
                                       RecipeError)
from neox.run.recipe.from_flags import recipe_from_flags
from neox.run.recipe.layout import HYBRIDS, LayoutConfig
from neox.run.recipe.legacy import recipe_from_checkpoint
from neox.run.recipe.model import ModelRecipe
from neox.run.recipe.offload import OFFLOADS, OffloadConfig, offload_words
from neox.run.recipe.optim import OptimConfig
from neox.run.recipe.output import OutputConfig
from neox.run.recipe.recipe import RECIPE_VERSION, Recipe, recipe_fields
from neox.run.recipe.sharding import AUTO_PLACEMENT, ShardingConfig
from neox.run.recipe.training import TrainingConfig

__all__ = ["RECIPE_VERSION", "Recipe", "ModelRecipe", "DataConfig", "OptimConfig",
           "TrainingConfig", "ShardingConfig", "OffloadConfig", "LayoutConfig", "OutputConfig",
           "RecipeError", "recipe_from_checkpoint", "recipe_fields", "recipe_from_flags",
           "FROM_SCRATCH", "OFFLOADS", "HYBRIDS", "offload_words", "MODEL", "STEP", "DATA",
           "OPTIM", "LOOP", "OUTPUT", "AUTO_PLACEMENT"]
