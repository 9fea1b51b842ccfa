"""The run recipe: what a fine-tuning run is, as small typed, versioned dataclasses.

``neox.finetune`` parses its flags into a ``Recipe`` at the edge; the training code hands each
function only the part it needs (``ModelRecipe``, ``DataConfig``, ``OptimConfig``,
``LoopConfig``, ``OutputConfig``); every checkpoint stores ``recipe.to_dict()`` (tagged with
``RECIPE_VERSION``), and ``neox.export`` reads it back with ``Recipe.from_dict``. Renaming a
command-line flag therefore changes nothing stored.

Checkpoints written before the recipe existed stored the command line's ``vars(args)`` under
``extra["args"]``; ``recipe_from_checkpoint`` reads that old form, in this one place.

How the run is launched (processes, ports, timeouts) and what this invocation does with the
output directory (resume, overwrite) are not part of the recipe: they do not change what is
trained.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode

__all__ = ["RECIPE_VERSION", "Recipe", "ModelRecipe", "DataConfig", "OptimConfig", "LoopConfig",
           "OutputConfig", "RecipeError", "recipe_from_checkpoint"]

RECIPE_VERSION = 1


class RecipeError(ValueError):
    """A stored recipe that cannot be read (unknown version, missing or mistyped field)."""


def _check(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise RecipeError(f"{where}: {what}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """Which model is trained, and how: the weights it starts from, the kept blocks, the
    fine-tuning mode and the compute dtype."""

    checkpoint: str | None = None          # pretrained weights directory; None: the preset
    preset: str = "tiny"                   # used when checkpoint is None (random init)
    seed: int = 0                          # the preset's random initialisation
    filter_layers: tuple[int, ...] | None = None  # kept blocks, 0-based; None: all
    finetune: FinetuneMode = FinetuneMode()
    dtype: str | None = None               # "fp32" | "bf16" | "fp16"; None: fp32 CPU, bf16 GPU
    reduce_dtype: str = "fp32"             # gradients are reduce-scattered in this dtype
    allow_outside_weights: bool = False    # weight files outside the checkpoint directory
    # How frozen weights are held and gathered: "compute" (the compute dtype) or "int8"
    # (zerocore.FrozenWeights("int8"): quantized once, dequantized after each gather).
    frozen_weights: str = "compute"

    def __post_init__(self) -> None:
        w = "recipe.model"
        _check(self.checkpoint is None or isinstance(self.checkpoint, str), w,
               f"checkpoint must be a path or null, got {self.checkpoint!r}")
        _check(isinstance(self.preset, str), w, f"preset must be a name, got {self.preset!r}")
        _check(_int(self.seed), w, f"seed must be an integer, got {self.seed!r}")
        _check(self.filter_layers is None or (
            isinstance(self.filter_layers, tuple)
            and all(_int(i) and i >= 0 for i in self.filter_layers)), w,
            f"filter_layers must be block indices or null, got {self.filter_layers!r}")
        _check(self.dtype in (None, "fp32", "bf16", "fp16"), w,
               f"dtype must be fp32, bf16, fp16 or null, got {self.dtype!r}")
        _check(self.reduce_dtype in ("fp32", "bf16", "fp16"), w,
               f"reduce_dtype must be fp32, bf16 or fp16, got {self.reduce_dtype!r}")
        _check(isinstance(self.finetune, FinetuneMode), w, "finetune must be a FinetuneMode")
        _check(self.frozen_weights in ("compute", "int8"), w,
               f"frozen_weights must be compute or int8, got {self.frozen_weights!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text and the tokenizer come from, and how the text is cut."""

    data: str | None = None        # a UTF-8 text file; None: tiny_shakespeare
    data_dir: str | None = None    # local copies of the default corpus; None: shared/data
    tokenizer: str | None = None   # tokenizer.json; None: the checkpoint's, else a trained BPE
    cache_dir: str | None = None   # None: ~/.cache/zerocore
    seq_len: int = 128
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        w = "recipe.data"
        _check(_int(self.seq_len) and self.seq_len >= 1, w,
               f"seq_len must be >= 1, got {self.seq_len!r}")
        _check(_finite(self.val_fraction) and 0 <= self.val_fraction < 1, w,
               f"val_fraction must be in [0, 1), got {self.val_fraction!r}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = 3e-4
    warmup: int = 0
    weight_decay: float = 0.0
    clip: float = 1.0              # global gradient-norm clip; 0: off
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        w = "recipe.optim"
        _check(_finite(self.lr) and self.lr > 0, w, f"lr must be a finite number > 0, got "
               f"{self.lr!r}")
        _check(_int(self.warmup) and self.warmup >= 0, w, f"warmup must be >= 0, got "
               f"{self.warmup!r}")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, w,
               f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        _check(_finite(self.clip) and self.clip >= 0, w,
               f"clip must be a finite number >= 0 (0: off), got {self.clip!r}")
        _check(isinstance(self.betas, tuple) and len(self.betas) == 2
               and all(_finite(b) and 0 <= b < 1 for b in self.betas), w,
               f"betas must be two numbers in [0, 1), got {self.betas!r}")
        _check(_finite(self.eps) and self.eps > 0, w, f"eps must be a finite number > 0, got "
               f"{self.eps!r}")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The training loop: batches, steps, evaluation, and where the optimizer state lives."""

    batch_size: int = 16           # sequences per rank per micro-batch
    grad_accum: int = 1            # micro-batches per optimizer step
    epochs: int = 1
    max_steps: int | None = None
    eval_every: int = 0            # 0: evaluate at the end only
    seed: int = 0                  # data order
    offload_optimizer: bool = False
    max_nonfinite_steps: int = 3   # steps in a row with NaN/inf loss or gradients: stop
    # Blocks (checkpoint indices, among the kept ones) whose activations are recomputed in
    # backward instead of kept; () none. Of those, every k-th is (the first, the k+1-th, ...).
    # Results are bitwise the same either way, so a resumed run may change them.
    activation_checkpointing: tuple[int, ...] = ()
    activation_checkpointing_every: int = 1
    # Gathered-memory budget per rank (zerocore.Prefetch.keep_gathered): bytes, or "all".
    # Bitwise neutral too: a resumed run may change it.
    keep_gathered: int | str = 0

    def __post_init__(self) -> None:
        w = "recipe.loop"
        for name in ("batch_size", "grad_accum", "epochs", "max_nonfinite_steps"):
            value = getattr(self, name)
            _check(_int(value) and value >= 1, w, f"{name} must be >= 1, got {value!r}")
        _check(self.max_steps is None or (_int(self.max_steps) and self.max_steps >= 1), w,
               f"max_steps must be >= 1 or null, got {self.max_steps!r}")
        _check(_int(self.eval_every) and self.eval_every >= 0, w,
               f"eval_every must be >= 0, got {self.eval_every!r}")
        _check(_int(self.seed), w, f"seed must be an integer, got {self.seed!r}")
        _check(isinstance(self.offload_optimizer, bool), w, "offload_optimizer must be a bool")
        _check(isinstance(self.activation_checkpointing, tuple)
               and all(_int(i) and i >= 0 for i in self.activation_checkpointing), w,
               f"activation_checkpointing must be block indices, got "
               f"{self.activation_checkpointing!r}")
        _check(_int(self.activation_checkpointing_every)
               and self.activation_checkpointing_every >= 1, w,
               f"activation_checkpointing_every must be >= 1, got "
               f"{self.activation_checkpointing_every!r}")
        _check(self.keep_gathered == "all" or (_int(self.keep_gathered)
                                               and self.keep_gathered >= 0), w,
               f"keep_gathered must be a number of bytes >= 0 or 'all', got "
               f"{self.keep_gathered!r}")


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """What the run writes, and where."""

    output_dir: str = str(Path("runs") / "neox-finetune")
    save_every: int = 0            # 0: only at the end
    keep_last: int = 3             # checkpoints of this run kept
    export_hf: bool = False
    sample_tokens: int = 48        # a text sample printed at the end; 0: none
    measure_memory: bool = False   # each rank's peak over the steps, printed beside the plan

    def __post_init__(self) -> None:
        w = "recipe.output"
        _check(isinstance(self.output_dir, str) and self.output_dir != "", w,
               f"output_dir must be a path, got {self.output_dir!r}")
        _check(_int(self.save_every) and self.save_every >= 0, w,
               f"save_every must be >= 0, got {self.save_every!r}")
        _check(_int(self.keep_last) and self.keep_last >= 1, w,
               f"keep_last must be >= 1, got {self.keep_last!r}")
        _check(isinstance(self.export_hf, bool), w, "export_hf must be a bool")
        _check(_int(self.sample_tokens) and self.sample_tokens >= 0, w,
               f"sample_tokens must be >= 0, got {self.sample_tokens!r}")
        _check(isinstance(self.measure_memory, bool), w, "measure_memory must be a bool")


_PARTS: dict[str, type] = {"model": ModelRecipe, "data": DataConfig, "optim": OptimConfig,
                           "loop": LoopConfig, "output": OutputConfig}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that defines a fine-tuning run; stored in each of its checkpoints."""

    model: ModelRecipe = ModelRecipe()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    loop: LoopConfig = LoopConfig()
    output: OutputConfig = OutputConfig()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict, tagged with the version."""
        d: dict[str, Any] = {"version": RECIPE_VERSION}
        for name in _PARTS:
            d[name] = _jsonable(dataclasses.asdict(getattr(self, name)))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """The inverse of ``to_dict``. Unknown versions, unknown or missing fields and wrong
        types are ``RecipeError``s naming the field."""
        _check(isinstance(d, Mapping), "recipe", f"must be a mapping, got {type(d).__name__}")
        version = d.get("version")
        _check(version == RECIPE_VERSION, "recipe.version",
               f"{version!r} is not a recipe version this neox reads ({RECIPE_VERSION}); a "
               f"newer neox wrote it")
        unknown = sorted(set(d) - set(_PARTS) - {"version"})
        _check(not unknown, "recipe", f"unknown fields {unknown}")
        parts = {}
        for name, kind in _PARTS.items():
            _check(isinstance(d.get(name), Mapping), f"recipe.{name}", "missing or not a mapping")
            parts[name] = _from_fields(kind, d[name], f"recipe.{name}")
        return cls(**parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


# Fields added to this recipe version after recipes were first written with it: absent from
# those, they take their defaults (which give the runs those recipes describe).
_ADDED_LATER = frozenset({"keep_gathered", "frozen_weights"})


def _from_fields(kind: type, d: Mapping[str, Any], where: str) -> Any:
    """A dataclass from its stored fields, with lists back to tuples where the field is one."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(d) - set(fields))
    _check(not unknown, where, f"unknown fields {unknown}")
    missing = sorted(set(fields) - set(d) - _ADDED_LATER)
    _check(not missing, where, f"missing fields {missing}")
    values: dict[str, Any] = {}
    for name, value in d.items():
        if name == "finetune":
            _check(isinstance(value, Mapping), f"{where}.finetune", "not a mapping")
            value = _from_fields(FinetuneMode, value, f"{where}.finetune")
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    try:
        return kind(**values)
    except (TypeError, ValueError) as e:  # FinetuneMode raises ValueError for a bad mode
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"{where}: {e}") from None


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
            loop=LoopConfig(batch_size=a["batch_size"], grad_accum=a["grad_accum"],
                            epochs=a["epochs"], max_steps=a["max_steps"],
                            eval_every=a["eval_every"], seed=a["seed"],
                            offload_optimizer=a["offload_optimizer"]),
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
