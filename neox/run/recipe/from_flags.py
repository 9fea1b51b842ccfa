"""The recipe that parsed flag values describe, each field's flag taken from its declaration.

The walk of a field from the command line to ``zerocore.shard`` (docs/decisions.md, "neox's
recipe by concern") makes three returns: this module's ``recipe_from_flags`` returns the recipe
holding it, ``neox.commands.finetune.run_request`` the ``RunRequest`` holding that, and the
field's part's ``policies()`` the engine policy ``neox.run.build`` hands ``zerocore.shard``.
So the value is turned into the field's here, inline, and the parts are made here too.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from neox.run.recipe.recipe import PARTS, Recipe, recipe_fields
from neox.setting import UsageError, flag_dest, flag_name, problem, setting_of

__all__ = ["recipe_from_flags"]


def recipe_from_flags(values: Mapping[str, Any], late: Mapping[str, Any] = {}) -> Recipe:
    """The recipe that flag values describe: ``values`` by the flags' dests (as a parsed
    namespace holds them; flags absent take their fields' defaults), ``late`` the values of
    the fields the command resolved itself (the block lists, by dest). A value its field's
    check refuses is a ``UsageError`` naming the flag."""
    given: dict[tuple[str, ...], dict[str, Any]] = {}   # a part's path -> its fields given
    for path, field in recipe_fields():
        s = setting_of(field)
        dest = flag_dest(field) if s.flag is not None else None
        if s.flag is not None and dest in late:
            value = late[dest]
        elif s.flag is not None and dest in values and not s.flag.late:
            # The flag's value as the field holds it: a word's value, a tuple, a stored form.
            value = values[dest]
            if isinstance(s.flag.choices, Mapping):
                value = s.flag.choices[value]
            if isinstance(value, list):
                value = tuple(value)
            if s.flag.store is not None:
                value = s.flag.store(value)
        elif s.follows is not None and s.follows in values:
            value = values[s.follows]
        else:
            continue
        message = problem(field, value, name=flag_name(field) if s.flag else None)
        if message is not None:
            raise UsageError(message if s.flag is None or "{name}" in s.problem
                             else f"{flag_name(field)}: {message}")
        given.setdefault(path[:-1], {})[path[-1]] = value
    # Nested settings (the fine-tuning mode) into their parts, innermost first.
    for path in sorted((p for p in given if len(p) > 1), key=len, reverse=True):
        kind = type(functools.reduce(getattr, path[1:], PARTS[path[0]]()))
        given.setdefault(path[:-1], {})[path[-1]] = kind(**given.pop(path))
    return Recipe(**{name: kind(**given.get((name,), {})) for name, kind in PARTS.items()})
