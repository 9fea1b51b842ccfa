"""A setting declared once, on the dataclass field it sets: its check, its command-line flag,
whether a resumed run may change it, and the recipe version from which stored recipes always
hold it. The recipe's checks, the parser (``neox.commands.flags``), a resume's identity checks
(``neox.run.resume``) and their messages all derive from that one declaration, so adding a flag
is the field, its ``setting(...)`` and its use (docs/decisions.md, "A flag is declared once").

Nothing here knows argparse or starts anything: the declarations are data. The text forms a
flag's value is parsed from (``finite_float``, ``byte_budget``, ...) live here too, beside the
checks of the values they give.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["UsageError", "BadValue", "Flag", "Setting", "setting", "setting_of", "problem",
           "first_problem", "flag_name", "flag_dest", "is_int", "is_finite", "finite_float",
           "byte_budget", "comma_list", "path_text", "absolute_path"]


class UsageError(ValueError):
    """A problem with the user's input: reported as one clear message, without a traceback."""


class BadValue(ValueError):
    """A flag's text that is not a value of its kind; the message says what is expected
    (the parser shows it after the flag's name)."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """The command-line form of a setting."""

    group: str                      # the --help section it is listed in
    help: str
    name: str | None = None         # default: "--" and the field's name, with dashes
    # text -> the flag's value (``BadValue`` for text of the wrong kind); None: the text itself
    # (a switch, for a bool field)
    parse: Callable[[str], Any] | None = None
    # the flag's value -> the field's (a path made absolute, so that a run resumes from any
    # working directory); None: the same
    store: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] | Mapping[str, Any] | None = None  # a mapping: word -> value
    nargs: int | str | None = None
    metavar: str | tuple[str, ...] | None = None
    const: Any = None
    # The command line's default where it is not the field's (``--finetune auto``), when
    # ``has_default``; a callable is called when the parser is built. ``env``: an environment
    # variable that replaces it when set (read by the parser, at the edge).
    default: Any = None
    env: str | None = None
    has_default: bool = False
    text: Callable[[Any], str] | None = None   # the field's default as the flag writes it
    resumable: bool = False   # given on --resume it overrides the checkpoint's; else must agree
    # The command turns the flag's value into the field's (it needs the model's block count):
    # the field's check applies to that, not to the flag's value.
    late: bool = False


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a field declares about itself (``setting(...)`` puts it in the field's metadata)."""

    check: Callable[[Any], bool] | None = None
    # the message when ``check`` fails; "{name}" is the field (or its flag), "{value!r}" the value
    problem: str = ""
    flag: Flag | None = None
    follows: str | None = None    # the field takes the value of this flag (its dest): --seed
    # The first recipe version whose recipes all hold the field; older ones may lack it, and
    # their runs are the ones its default gives.
    since: int = 1
    # A value written by an older neox -> this one's (frozen weights: "compute" -> None)
    upgrade: Callable[[Any], Any] | None = None
    # The value may differ from node to node (a directory on each node's own disk): the ranks
    # of a run across nodes do not agree it (neox.run.same_recipe); every other field they do.
    per_node: bool = False


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            **declared: Any) -> Any:
    """A dataclass field with its ``Setting`` (the keywords are its attributes)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"setting": Setting(**declared)})


def setting_of(field: dataclasses.Field) -> Setting:
    return field.metadata.get("setting", Setting())


def problem(field: dataclasses.Field, value: Any, *, name: str | None = None) -> str | None:
    """Why ``value`` cannot be ``field``'s, named ``name`` (default: the field's name); None
    when it can."""
    s = setting_of(field)
    if s.check is None or s.check(value):
        return None
    return s.problem.format(name=name or field.name, value=value).strip()


def first_problem(obj: Any) -> str | None:
    """The first field of a settings dataclass whose value fails its check, as a message."""
    for field in dataclasses.fields(obj):
        message = problem(field, getattr(obj, field.name))
        if message is not None:
            return message
    return None


def flag_name(field: dataclasses.Field) -> str:
    flag = setting_of(field).flag
    assert flag is not None, field.name
    return flag.name or "--" + field.name.replace("_", "-")


def flag_dest(field: dataclasses.Field) -> str:
    """The flag's name as the parsed namespace holds it (``--lr`` -> ``lr``)."""
    return flag_name(field).removeprefix("--").replace("-", "_")


# -- values and their text forms ------------------------------------------------------------------

def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def finite_float(text: str) -> float:
    """A finite number (``inf`` and ``nan`` are refused)."""
    value = float(text)
    if not math.isfinite(value):
        raise BadValue(f"must be a finite number, got {text}")
    return value


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def byte_budget(text: str) -> int | str:
    """``all``, or a number of bytes with an optional unit (KiB, MiB, GiB, TiB; kB, MB, GB,
    TB), e.g. ``2GiB`` or ``1.5GB``."""
    t = text.strip().lower()
    if t == "all":
        return "all"
    number = t.rstrip("kmgtib")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not math.isfinite(value) or value < 0:
        raise BadValue(
            f"must be 'all' or a size such as 2GiB, 512MiB or 1000000 (bytes), got {text!r}")
    return int(value * _UNITS[unit])


def comma_list(text: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def path_text(text: str) -> Path:
    """A path given on the command line: never empty (``Path("")`` is the working directory,
    which an empty value never meant: an unset variable in a script, usually)."""
    if not text.strip():
        raise BadValue(f"must be a path, got {text!r}")
    return Path(text)


def absolute_path(path: Path | str | None) -> str | None:
    """A path as the recipe stores it: absolute, so that the run can be resumed and exported
    from any working directory."""
    return None if path is None else str(Path(path).resolve())
