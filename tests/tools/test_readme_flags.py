"""Every list of a flag's values the README and the docs/ pages print is the list the command
accepts (issue 40, item 6: the README listed `--hybrid {none,hsdp}` for a command that had taken
`hpz` for a round). docs/decisions.md is left out: it records each decision with the flags of its
time. Whether each flag named exists at all is tests/tools/test_readme.py's.

Two forms are printed: `--flag {a,b,c}`, argparse's own, and `--flag a|b|c`; both name every
value, unless the list holds "..." (`--model tiny|pythia-70m|...|gpt-neox-20b`), whose named
values must then each be accepted. The commands' parsers are built in-process
(``build_parser``), not run. A flag the prose names with a list must exist in at least one of
the commands, and every command that has it must accept exactly that list: neox.finetune and
neox.plan share their recipe's flags, and a list printed once stands for both.
"""

from __future__ import annotations

import argparse
import re

import pytest

from neox.commands import finetune, plan
from tests.support.neox_testing import REPO

DOCUMENTS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
                                  if p.name != "decisions.md"))
BRACES = re.compile(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}")
BARS = re.compile(r"(--[a-z][a-z0-9-]*) ((?:[A-Za-z0-9_.-]+\|)+[A-Za-z0-9_.-]+)")


def parsers() -> list[argparse.ArgumentParser]:
    return [finetune.build_parser(), plan.build_parser()]


def printed_lists() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, flag, values) of every flag list the documents print."""
    found = []
    for name in DOCUMENTS:
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
            for pattern, sep in ((BRACES, ","), (BARS, "|")):
                for flag, values in pattern.findall(line):
                    found.append((f"{name}:{number}", flag,
                                  tuple(v.strip() for v in values.split(sep))))
    return found


def accepted(flag: str) -> dict[str, tuple[str, ...] | None]:
    """The values each command accepts for ``flag`` (None: any value), by its prog."""
    out = {}
    for p in parsers():
        for action in p._actions:
            if flag in action.option_strings:
                out[p.prog] = tuple(action.choices) if action.choices is not None else None
    return out


def test_the_documents_print_flag_lists():
    # The extraction itself finds what is there: --hybrid's and --quantize-gradients' lists.
    flags = {flag for _, flag, _ in printed_lists()}
    assert {"--hybrid", "--quantize-gradients", "--offload", "--model"} <= flags


@pytest.mark.parametrize("where, flag, values", printed_lists(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_printed_flag_list_is_what_the_command_accepts(where, flag, values):
    commands = accepted(flag)
    assert commands, f"{where}: {flag} is not a flag of {[p.prog for p in parsers()]}"
    partial = "..." in values
    named = tuple(v for v in values if v != "...")
    for prog, choices in commands.items():
        assert choices is not None, f"{where}: {prog} takes any value for {flag}"
        if partial:
            assert set(named) <= set(choices), (
                f"{where}: {flag} lists {named}; {prog} accepts {choices}")
        else:
            assert sorted(named) == sorted(choices), (
                f"{where}: {flag} lists {{{','.join(named)}}}; {prog} accepts "
                f"{{{','.join(choices)}}}")
