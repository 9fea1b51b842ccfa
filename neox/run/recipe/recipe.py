"""The whole recipe (``Recipe``, one part per concern) and its stored form.

The stored form is version 7's, unchanged by the split into concerns: sections ``model``,
``data``, ``optim``, ``loop`` and ``output``, the ``loop`` section holding the fields of the
training, sharding, offload and layout parts, and ``model`` the sharding part's reduce dtype
and frozen weights as well. A checkpoint written by this neox is therefore read by the neox
before the split, and the other way round; the stored names never change with the code's.
Version 8 adds one field to ``loop`` (the sharding part's ``frozen_placement``): a neox that
reads version 7 at most refuses it as newer, and this one reads version 7's as sharded.
Version 9 adds one more (the offload part's ``offload_overlap``), read as ``"exact"`` from
older versions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

from neox.run.recipe.data import DataConfig
from neox.run.recipe.declaring import RecipeError
from neox.run.recipe.layout import LayoutConfig
from neox.run.recipe.model import ModelRecipe
from neox.run.recipe.offload import OffloadConfig
from neox.run.recipe.optim import OptimConfig
from neox.run.recipe.output import OutputConfig
from neox.run.recipe.sharding import ShardingConfig
from neox.run.recipe.training import TrainingConfig
from neox.setting import is_int, problem, setting_of

__all__ = ["Recipe", "PARTS", "recipe_fields", "RECIPE_VERSION", "SECTIONS"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that defines a fine-tuning run, one part per concern; stored in each of its
    checkpoints."""

    model: ModelRecipe = ModelRecipe()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    training: TrainingConfig = TrainingConfig()
    sharding: ShardingConfig = ShardingConfig()
    offload: OffloadConfig = OffloadConfig()
    layout: LayoutConfig = LayoutConfig()
    output: OutputConfig = OutputConfig()

    def to_dict(self) -> dict[str, Any]:
        """The stored form: a JSON-serialisable dict, tagged with the version."""
        d: dict[str, Any] = {"version": RECIPE_VERSION, **{s: {} for s in _STORED}}
        for section, kept in _STORED.items():
            for part, name in kept.values():
                d[section][name] = _jsonable(getattr(getattr(self, part), name))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """The inverse of ``to_dict``, for every version this neox reads. Unknown versions,
        unknown or missing fields and wrong types are ``RecipeError``s naming the stored
        section and field."""
        if not isinstance(d, Mapping):
            raise RecipeError(f"recipe: must be a mapping, got {type(d).__name__}")
        version = d.get("version")
        if not (is_int(version) and 1 <= version <= RECIPE_VERSION):
            raise RecipeError(f"recipe.version: {version!r} is not a recipe version this neox "
                              f"reads (1 to {RECIPE_VERSION}); a newer neox wrote it")
        unknown = sorted(set(d) - set(_STORED) - {"version"})
        if unknown:
            raise RecipeError(f"recipe: unknown fields {unknown}")
        parts: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
        for section, kept in _STORED.items():
            if not isinstance(d.get(section), Mapping):
                raise RecipeError(f"recipe.{section}: missing or not a mapping")
            fields = {name: _field(*kept[name]) for name in kept}
            values = _stored_values(fields, d[section], f"recipe.{section}", version)
            for name, value in values.items():
                parts[kept[name][0]][name] = value
        return cls(**{name: PARTS[name](**values) for name, values in parts.items()})


PARTS: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(Recipe)}

# The stored form's sections: each part's fields are in the section of its name, or "loop"
# (the four parts version 7's LoopConfig held); the sharding part's reduce dtype and frozen
# weights are where version 7 kept them, in "model".
SECTIONS = {"model": ("model",), "data": ("data",), "optim": ("optim",),
            "loop": ("training", "sharding", "offload", "layout"), "output": ("output",)}
_IN_MODEL = {("sharding", "reduce_dtype"), ("sharding", "frozen_weights")}


def _stored_in() -> dict[str, dict[str, tuple[str, str]]]:
    """section -> stored name -> (part, field name)."""
    stored: dict[str, dict[str, tuple[str, str]]] = {s: {} for s in SECTIONS}
    for section, parts in SECTIONS.items():
        for part in parts:
            for field in dataclasses.fields(PARTS[part]):
                where = "model" if (part, field.name) in _IN_MODEL else section
                assert field.name not in stored[where], (where, field.name)
                stored[where][field.name] = (part, field.name)
    return stored


_STORED = _stored_in()


def _field(part: str, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(PARTS[part]) if f.name == name)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def _stored_values(fields: Mapping[str, dataclasses.Field], d: Mapping[str, Any], where: str,
                   version: int) -> dict[str, Any]:
    """The values of ``fields`` a stored section (of recipe ``version``) holds, checked: lists
    back to tuples, a nested settings dataclass (the fine-tuning mode) read the same way, values
    of older versions upgraded. A field an older version may lack is left out (its default)."""
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise RecipeError(f"{where}: unknown fields {unknown}")
    missing = sorted(n for n, f in fields.items() if n not in d and setting_of(f).since <= version)
    if missing:
        raise RecipeError(f"{where}: missing fields {missing}")
    values: dict[str, Any] = {}
    for name, value in d.items():
        field = fields[name]
        s = setting_of(field)
        if dataclasses.is_dataclass(field.default):
            if not isinstance(value, Mapping):
                raise RecipeError(f"{where}.{name}: not a mapping")
            kind = type(field.default)
            nested = {f.name: f for f in dataclasses.fields(kind)}
            try:
                value = kind(**_stored_values(nested, value, f"{where}.{name}", version))
            except (TypeError, ValueError) as e:  # FinetuneMode raises ValueError for a bad mode
                if isinstance(e, RecipeError):
                    raise
                raise RecipeError(f"{where}.{name}: {e}") from None
        elif isinstance(value, list):
            value = tuple(value)
        if s.upgrade is not None and version < s.since:
            value = s.upgrade(value)
        message = problem(field, value)
        if message is not None:
            raise RecipeError(f"{where}: {message}")
        values[name] = value
    return values


def recipe_fields() -> Iterator[tuple[tuple[str, ...], dataclasses.Field]]:
    """(path, field) of every field of a recipe, in declaration order, the fine-tuning mode's
    included: ``(("model", "finetune", "lora_rank"), <field>)``."""
    def walk(kind: type, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        for field in dataclasses.fields(kind):
            if dataclasses.is_dataclass(field.default):
                yield from walk(type(field.default), path + (field.name,))
            else:
                yield path + (field.name,), field
    for name, kind in PARTS.items():
        yield from walk(kind, (name,))


# The version a recipe is written with: the newest of its fields' ``since``, so that declaring a
# field with ``since=N + 1`` is what makes this neox write version N + 1 (and an older neox refuse
# it as newer, instead of misreading it).
RECIPE_VERSION = max(setting_of(field).since for _, field in recipe_fields())
