"""One recipe across ranks: under torchrun every node parses its own command line, so the ranks
agree the whole recipe before building anything (before reading weights, allocating, or writing
a file), and refuse in one line on every rank, naming each flag that differs and its value on
each node.

What is agreed derives from the recipe's declarations (``neox.run.recipe``, ``neox.setting``):
every field's flag, except a field declared ``per_node`` (a directory on each node's own disk:
``--data-dir``, ``--cache-dir``, ``--offload-path``); with them the number of ranks on each node
(neox lays the ranks out node by node, as many on each) and the invocation's own flags that change
what the run does (``RUN_FLAGS``). The launch's flags (``--timeout``, ``--port``, ...) are each
node's own. Three steps, every rank together (``agree_request``):

1. the flags as each node parsed them, before anything is read: a flag that differs is named
   as the user typed it, not as its consequences (another checkpoint read, a layout refused on
   one node only);
2. the checks that read files (the weights' configuration, the checkpoint to resume), each
   rank's own, agreed (``zerocore.run_agreed``): a problem on one node is reported, the others
   stop with it;
3. the recipe those give: the same flags naming files that differ between nodes (another
   checkpoint under the same path) are named too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import zerocore
from neox.run.invocation import Invocation
from neox.run.recipe import Recipe, recipe_fields
from neox.setting import flag_dest, flag_name, setting_of

__all__ = ["RUN_FLAGS", "RANKS_PER_NODE", "given_flags", "recipe_values", "agree_request"]

# The invocation's flags (not the recipe's) that change what the run does: what it continues
# from and what it accepts on the way (their dests).
RUN_FLAGS = tuple(flag_dest(f) for f in dataclasses.fields(Invocation))
# How the ranks on each node are named in a refusal (torchrun's LOCAL_WORLD_SIZE).
RANKS_PER_NODE = "ranks per node (torchrun --nproc-per-node)"
_WHAT = "neox.finetune"


def _text(value: Any) -> str:
    if value is None:
        return "(not given)"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def given_flags(values: Mapping[str, Any]) -> dict[str, str]:
    """The flags every rank must share, by name, from the parsed values (by dest), as text:
    every recipe field's flag but the ``per_node`` ones, paths made absolute as the recipe
    stores them, then ``RUN_FLAGS``. Reads no file and checks nothing: it cannot fail on one
    rank alone."""
    flags: dict[str, str] = {}
    for _, field in recipe_fields():
        s = setting_of(field)
        if s.flag is None or s.per_node or flag_dest(field) not in values:
            continue
        value = values[flag_dest(field)]
        if s.flag.store is not None and not s.flag.late and value is not None:
            value = s.flag.store(value)
        flags[flag_name(field)] = _text(value)
    for dest in RUN_FLAGS:
        value = values[dest]
        flags["--" + dest.replace("_", "-")] = _text(
            Path(value).resolve() if isinstance(value, Path) else value)
    return flags


def recipe_values(recipe: Recipe) -> dict[str, str]:
    """The recipe's fields every rank must share, by flag name (by path for a field without a
    flag), as text."""
    values: dict[str, str] = {}
    for path, field in recipe_fields():
        s = setting_of(field)
        if s.per_node:
            continue
        value: Any = recipe
        for name in path:
            value = getattr(value, name)
        text = s.flag.text if s.flag is not None and s.flag.text is not None else _text
        values[flag_name(field) if s.flag is not None else ".".join(path)] = text(value)
    return values


def agree_request(flags: Mapping[str, str], prepare: Callable[[], Any], *, node: int | None,
                  ranks_per_node: int | None) -> Any:
    """Collective, on every rank of the world, before anything is built: agrees ``flags``
    (``given_flags``) and ``ranks_per_node`` (this node's), runs ``prepare()`` (the checks and
    the ``RunRequest``, which reads files) agreed, and agrees the recipe and checkpoint it
    gives. ``node``, ``ranks_per_node``: torchrun's GROUP_RANK and LOCAL_WORLD_SIZE (None
    where not set). Returns ``prepare()``'s request; raises ``zerocore.ValuesDiffer`` (a
    ValueError, alike on every rank) when the ranks differ, ``prepare``'s own error (the lowest
    rank that failed) or ``zerocore.PeerError`` when it failed."""
    zerocore.agree_values({RANKS_PER_NODE: _text(ranks_per_node), **flags}, what=_WHAT, node=node,
                          text=str, advice="start every torchrun agent with the same flags "
                                           "and the same --nproc-per-node")
    request = zerocore.run_agreed(prepare)
    continued = {"the checkpoint continued": _text(request.resume or request.deepspeed)}
    zerocore.agree_values({**continued, **recipe_values(request.recipe)}, what=_WHAT,
                          node=node, text=str,
                          advice="the flags agree, so the files they name differ between "
                                 "nodes (--checkpoint, --resume, --tokenizer): give every node "
                                 "the same files")
    return request

