"""What the commands share: the parser and its help format, the argparse types of the flags
that are not the recipe's, and the recipe's flags, each made from its field's declaration
(``neox.setting``; the recipe's fields are in ``neox.run.recipe``).

Only the commands import this module (and argparse); it imports none of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from neox.run.inference import ModelSource
from neox.run.invocation import ALLOW_UNVERIFIED
from neox.run.recipe import recipe_fields
from neox.setting import BadValue, finite_float, flag_name, setting_of

__all__ = ["Parser", "HelpFormatter", "positive_int", "nonnegative_int", "nonnegative_float",
           "argparse_type", "finite", "recipe_argument", "recipe_field", "add_recipe_flags",
           "add_model_arguments", "add_loading_arguments", "loading_source", "explicit_flags"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are two lines: the full usage of a tool with forty
    flags buries the one line that says what is wrong, so it points to ``--help`` instead."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"({self.prog} --help lists every flag)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default after its help, unless the help already says it or there is
    nothing to show (no value, or an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False,
                                                                      argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as argparse calls a type: its ``BadValue`` message is shown after the flag's
    name; another ValueError reads "invalid <parse's name> value"."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except BadValue as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


# argparse type: a finite number (``inf`` and ``nan`` are refused).
finite = argparse_type(finite_float)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def recipe_argument(group: Any, field: dataclasses.Field, **override: Any) -> None:
    """The argument a setting's field declares: the recipe's, or the invocation's
    (``neox.run.invocation``). ``override``: argparse keywords that a command that is not a run
    gives the same flag, e.g. its own help."""
    flag = setting_of(field).flag
    assert flag is not None, field.name
    if flag.has_default:
        default = flag.default() if callable(flag.default) else flag.default
    else:
        default = flag.text(field.default) if flag.text is not None else field.default
    if flag.env is not None and os.environ.get(flag.env):
        # Read here, at the edge (the test suite sets it to hide the shared data).
        default = (flag.parse or str)(os.environ[flag.env])
    kw: dict[str, Any] = {"default": default, "help": flag.help}
    if isinstance(field.default, bool) and flag.parse is None and flag.choices is None:
        kw["action"] = "store_true"
    else:
        if flag.parse is not None:
            kw["type"] = argparse_type(flag.parse)
        if flag.choices is not None:
            kw["choices"] = list(flag.choices)
        for name in ("nargs", "metavar", "const"):
            if getattr(flag, name) is not None:
                kw[name] = getattr(flag, name)
    kw.update(override)
    group.add_argument(flag_name(field), **kw)


def recipe_field(*path: str) -> dataclasses.Field:
    """The recipe's field at ``path`` (``"data", "tokenizer"``), whose flag a command that is
    not a run takes too."""
    return next(field for at, field in recipe_fields() if at == path)


def add_recipe_flags(p: argparse.ArgumentParser, groups: Sequence[str]
                     ) -> dict[str, argparse._ArgumentGroup]:
    """The recipe's flags of these --help sections, in this order; returns the sections, for
    the command's own flags."""
    made = {name: p.add_argument_group(name) for name in groups}
    for _, field in recipe_fields():
        flag = setting_of(field).flag
        if flag is not None and flag.group in made:
            recipe_argument(made[flag.group], field)
    return made


# What the model flags say in a command that loads a model instead of training one.
_LOADING = {
    "checkpoint": dict(
        type=Path, help="pretrained weights: a Hugging Face GPT-NeoX directory (e.g. a run's "
                        "OUTPUT_DIR/hf) or EleutherAI 20B slim-weights directory, or a "
                        "fine-tuning run: its output directory (the newest checkpoint) or one of "
                        "its step-XXXXXXXX checkpoints; default: the built-in run's output "
                        "runs/neox-finetune"),
    "preset": dict(default=None),
    "seed": dict(help="seeds a preset's random weights (and sampling)"),
}


def add_model_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The model flags of a command that loads a model (neox.evaluate, neox.generate): the
    recipe's, as a run names them, meaning a model to load."""
    group = p.add_argument_group("model")
    for path, field in recipe_fields():
        flag = setting_of(field).flag
        if path[0] == "model" and flag is not None and flag.group == "model":
            recipe_argument(group, field, **_LOADING.get(field.name, {}))
    return group


def add_loading_arguments(p: argparse.ArgumentParser) -> None:
    """The model flags (a run's, meaning a model to load), the tokenizer and the device: the
    flags of ``neox.run.inference.ModelSource``."""
    add_model_arguments(p)
    recipe_argument(p, recipe_field("data", "tokenizer"),
                    help="tokenizer.json (default: the run's or the checkpoint's; for a preset: "
                         "the GPT-NeoX tokenizer in --data-dir)")
    recipe_argument(p, recipe_field("data", "data_dir"),
                    help="local data (default: shared/data beside the repository)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    recipe_argument(p, ALLOW_UNVERIFIED)


def loading_source(args: argparse.Namespace) -> ModelSource:
    """The ``ModelSource`` that ``add_loading_arguments``' flags give."""
    values = vars(args)
    return ModelSource(**{f.name: values[f.name] for f in dataclasses.fields(ModelSource)})


def explicit_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations of the flags actually given on the command line (not defaults)."""
    # argparse fills in a default only where the namespace lacks the attribute: start from a
    # namespace holding a marker everywhere, and what the command line set is what changed.
    marker = object()
    namespace = argparse.Namespace(**{dest: marker for dest in vars(parser.parse_args([]))})
    parser.parse_args(argv, namespace=namespace)
    return {dest for dest, value in vars(namespace).items() if value is not marker}
