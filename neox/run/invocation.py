"""What one invocation does with a run beyond its recipe: the checkpoint it continues from, and
what it accepts on the way (an unverifiable checkpoint, changed training text, another run in
the output directory). Not part of the recipe: they change where a run starts, not what is
trained. Declared once, as the recipe's fields are (``neox.setting``): ``neox.finetune``'s
flags, the flags the ranks agree (``neox.run.same_recipe``) and ``--allow-unverified`` of the
commands that read a run's checkpoint (export, evaluate, generate) derive from them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from neox.run.recipe import OUTPUT
from neox.setting import Flag, setting

__all__ = ["Invocation", "ALLOW_UNVERIFIED"]


@dataclasses.dataclass(frozen=True)
class Invocation:
    """neox.finetune's flags that are not the recipe's but change what the run does."""

    resume: Path | None = setting(None, flag=Flag(
        OUTPUT, "continue a run from a checkpoint (a step-XXXXXXXX directory, or a folder of "
                "them: the newest of its run); flags not given are the checkpoint's; any number "
                "of ranks. Or continue a DeepSpeed ZeRO-3 run of a GPT-NeoX model (its directory "
                "holding 'latest', or a global_stepN directory) as a new run of the flags given "
                "(the same model and --finetune mode): its weights, Adam state and step are "
                "loaded, the optimizer flags not given are its; its data order is not saved, so "
                "the sampler starts at the beginning", parse=Path))
    allow_unverified: bool = setting(False, flag=Flag(
        OUTPUT, "accept a run's checkpoint of an older format (1 or 2), whose rank files do not "
                "record which save, rank and step they are of (neox.finetune: with --resume)"))
    data_changed: bool = setting(False, flag=Flag(
        OUTPUT, "with --resume: the training text differs from the one the run trained on, and "
                "that is intended; the weights and optimizer continue, the data order restarts "
                "at the beginning of the current epoch"))
    overwrite: bool = setting(False, flag=Flag(
        OUTPUT, "start a new run in an output directory that holds another run, deleting its "
                "checkpoints, metrics and exports first"))


# The one declaration of --allow-unverified, for the commands that read a run's checkpoint.
ALLOW_UNVERIFIED = next(f for f in dataclasses.fields(Invocation) if f.name == "allow_unverified")
