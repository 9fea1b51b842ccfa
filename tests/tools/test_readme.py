"""The README a newcomer meets, and the docs/ pages it sends them to, checked against the code
(issue 42, item 1):

- the README is short and starts with code: at most 300 lines, its first code block within its
  first 60, and its set-up section holds exactly the two commands (one runs the main job on its
  built-in default, one the tests), byte for byte;
- every docs/ page is linked from the README, and every link and every repository path named in
  the README and docs/ leads to a file that exists;
- every code block marked runnable (``<!-- runnable -->`` on the line before its fence; ``<!--
  runnable e2e -->`` for the ones that take more than a few seconds) runs and exits 0;
- every ``--flag`` a command line names is a flag of that command (its own ``--help``), and
  every flag named in prose is one of our commands' or of the tools named in ``FOREIGN``;
- docs/policies.md lists every field of every policy with its default, and nothing else, and
  every ``Policy(field=...)`` written anywhere names a field the policy has.

docs/decisions.md is left out of the last three: it records each decision as it was made (as
bench/records/ record figures), with the files and flags of its time, and is not rewritten when
they change. The lists of flag values are tests/tools/test_readme_flags.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import zerocore.policies
from tests.support.dist_utils import free_port
from tests.support.neox_testing import REPO, cli_env

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
RECORDS = {REPO / "docs" / "decisions.md"}
CURRENT = [README, *(d for d in DOCS if d not in RECORDS)]
MAX_LINES = 300
FIRST_CODE_BY = 60
SETUP_COMMANDS = (
    "pip install torch==2.13.0 ninja && pip install --no-build-isolation -e . "
    "&& python -m neox.finetune",
    "pip install torch==2.13.0 ninja && pip install --no-build-isolation -e '.[test]' "
    "&& python -m pytest",
)
# Paths the documents name that the repository does not hold: what a command writes.
WRITTEN = {"bench/results/"}
# Flags of tools that are not ours, which the documents name: they are checked by their owners.
FOREIGN = {
    "torchrun": {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend",
                 "--rdzv-endpoint"},
    "pip": {"--no-build-isolation", "--index-url"},
    "pytest": {"--benchmark-only", "--dist"},
}
# A bound on one runnable block or one --help, only so that a hung one fails instead of holding
# the tier: the fast blocks take 2-3 s on 2 loaded cores, the e2e ones (a process group and 20
# steps, transformers' import, a plan) 12-19 s.
RUN_TIMEOUT_S = 600

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:zerocore|neox|tests|bench|docs|examples|csrc|\.ci)/[\w./-]*[\w/])")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
RUNNABLE = re.compile(r"^<!-- runnable( e2e)? -->\n```(\w+)\n(.*?)^```$", re.M | re.S)
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
INLINE = re.compile(r"`([^`\n]+)`")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# (a) short, code first, the two set-up commands -------------------------------------------------

def first_fence_line(text: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("```"))


def setup_commands(text: str) -> list[str]:
    """The commands of the README's set-up section: its lines indented four spaces."""
    section = text.split("\n## Set-up", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in section.splitlines() if line.startswith("    ")]


def test_readme_is_short_and_starts_with_code():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, len(text.splitlines())
    assert first_fence_line(text) <= FIRST_CODE_BY, first_fence_line(text)


def test_readme_has_exactly_the_two_set_up_commands():
    assert setup_commands(README.read_text()) == list(SETUP_COMMANDS)


# (b) and (c) every page linked, every link and path resolves ------------------------------------

def links(path: Path) -> list[str]:
    """The repository files ``path``'s Markdown links point to, relative to the repository."""
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append(os.path.normpath(os.path.relpath(path.parent / target.split("#")[0], REPO)))
    return out


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(links(README))
    assert {rel(d) for d in DOCS} - linked == set()


def missing_files(path: Path) -> list[str]:
    """What ``path`` links to or names as a repository path that does not exist."""
    named = [p for p in REPO_PATH.findall(path.read_text()) if p not in WRITTEN]
    return [p for p in [*links(path), *named] if not (REPO / p).exists()]


@pytest.mark.parametrize("path", CURRENT, ids=rel)
def test_every_link_and_path_resolves(path):
    assert missing_files(path) == []


# (d) runnable blocks ----------------------------------------------------------------------------

def runnable_blocks() -> list:
    params = []
    for path in CURRENT:
        text = path.read_text()
        for m in RUNNABLE.finditer(text):
            line = text[:m.start()].count("\n") + 2  # the fence's line
            marks = [pytest.mark.e2e] if m.group(1) else []
            params.append(pytest.param(m.group(2), m.group(3), marks=marks,
                                       id=f"{rel(path)}:{line}"))
    return params


def run_block(language: str, code: str, work: Path) -> subprocess.CompletedProcess:
    """Runs a block as its reader would: a bash block line by line with ``python`` this
    interpreter; a Python block as a script of one rank, with the variables torchrun sets for a
    world of one."""
    env = cli_env()
    if language == "bash":
        bin_dir = work / "bin"
        bin_dir.mkdir()
        (bin_dir / "python").symlink_to(sys.executable)
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        assert language == "python", language
        (work / "block.py").write_text(code)
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        argv = [sys.executable, "block.py"]
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def test_the_documents_have_runnable_blocks_of_each_tier():
    # The marker's extraction finds what is there: a fast one and e2e ones, in the README too.
    blocks = runnable_blocks()
    assert any(not b.marks for b in blocks) and any(b.marks for b in blocks)
    assert sum(b.id.startswith("README.md:") for b in blocks) >= 3


@pytest.mark.parametrize("language, code", runnable_blocks())
def test_a_runnable_block_runs(language, code, tmp_path):
    proc = run_block(language, code, tmp_path)
    assert proc.returncode == 0, f"{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# (e) flags against the commands' --help ---------------------------------------------------------

def command_lines(text: str) -> list[str]:
    """Every command line the text shows: in code blocks that are not Python, in blocks indented
    four spaces, and in inline code that starts with ``python`` or ``torchrun``; continuation
    lines joined, each ``&&`` part apart."""
    lines = []
    for language, body in FENCE.findall(text):
        if language != "python":
            lines += body.splitlines()
    lines += [line for line in text.splitlines() if line.startswith("    ")]
    lines += [span for span in INLINE.findall(text)
              if span.startswith(("python ", "torchrun "))]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [part.split("  #")[0].strip() for line in joined.splitlines()
            for part in line.split("&&") if part.strip()]


def program_of(command: str) -> tuple[str, list[str]] | None:
    """(our program, its arguments) of a command line, or None when it runs no program of ours:
    ``python -m neox.X``/``zerocore...``, ``python path.py``, or either under torchrun."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    if not words or words[0] not in ("python", "torchrun"):
        return None
    for i, word in enumerate(words[1:], 1):
        if word == "-m" and i + 1 < len(words):
            module = words[i + 1]
            ours = module.split(".")[0] in ("neox", "zerocore")
            return (module, words[i + 2:]) if ours else None
        if word.endswith(".py"):  # ours when the repository holds it (a reader's train.py is not)
            return (word, words[i + 1:]) if word.startswith(("examples/", "bench/")) else None
    return None


# Every program's --help in one interpreter (a run of each apart cost about 3 s, a dozen programs,
# most of it importing torch again): each runs as ``python -m PROGRAM --help`` or ``python PATH
# --help`` would run it, as ``__main__`` with that argv, its standard output captured, its exit
# status kept.
HELP_ALL = """
import contextlib, io, json, os, runpy, sys
helps = {}
for program in sys.argv[1:]:
    sys.argv, text, status = [program, "--help"], io.StringIO(), 0
    with contextlib.redirect_stdout(text):
        try:
            if program.endswith(".py"):
                sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
                runpy.run_path(program, run_name="__main__")
            else:
                runpy.run_module(program, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            status = exit.code or 0
    helps[program] = (status, text.getvalue())
print(json.dumps(helps))
"""


@functools.lru_cache(maxsize=None)
def help_texts() -> dict[str, tuple[int, str]]:
    """``program --help``'s (exit status, output) for each of our programs the documents run."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", HELP_ALL, *sorted(programs())],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def flags_of(program: str) -> frozenset[str]:
    """The flags ``program --help`` lists."""
    status, text = help_texts()[program]
    assert status == 0, f"{program} --help exited with {status}"
    return frozenset(FLAG.findall(text))


def programs() -> set[str]:
    """Our programs the current documents run."""
    return {found[0] for path in CURRENT for c in command_lines(path.read_text())
            if (found := program_of(c))}


def test_command_lines_are_found():
    # The extraction finds the commands of every kind of place: blocks, indented, inline.
    found = programs()
    assert {"neox.finetune", "neox.plan", "neox.export", "zerocore.consolidate",
            "zerocore.from_deepspeed", "examples/finetune_hf_trainer.py"} <= found, found
    assert program_of("torchrun --nnodes 2 -m neox.finetune --cpu") == ("neox.finetune",
                                                                        ["--cpu"])
    assert program_of("python -m pytest -m e2e") is None


def unknown_flags(path: Path) -> list[str]:
    """Flags ``path`` names that its command does not take (a command line's) or that no
    command takes (prose's)."""
    text = path.read_text()
    problems = []
    for command in command_lines(text):
        found = program_of(command)
        if found:
            program, args = found
            problems += [f"{program} {flag}" for flag in FLAG.findall(" ".join(args))
                         if flag not in flags_of(program)]
    known = set().union(*map(flags_of, programs()), *FOREIGN.values())
    prose = FENCE.sub("", text)
    problems += [f"(prose) {flag}" for flag in FLAG.findall(prose) if flag not in known]
    return sorted(set(problems))


@pytest.mark.e2e  # each program's --help is a run of it: about 3 s each, a dozen programs
@pytest.mark.parametrize("path", CURRENT, ids=rel)
def test_every_flag_named_is_a_flag_of_its_command(path):
    assert unknown_flags(path) == []


# (e) the policies page against the policies -----------------------------------------------------

POLICIES = {name: cls for name, cls in vars(zerocore.policies).items()
            if dataclasses.is_dataclass(cls) and cls.__module__ == zerocore.policies.__name__}
POLICY_HEADING = re.compile(r"^## `zerocore\.(\w+)`$", re.M)
FIELD_ROW = re.compile(r"^\| `(\w+)` \| `([^`]*)` \|", re.M)


def documented_policies() -> dict[str, list[tuple[str, str]]]:
    """Each policy section of docs/policies.md: its table's (field, default) rows."""
    parts = POLICY_HEADING.split((REPO / "docs" / "policies.md").read_text())
    return {name: FIELD_ROW.findall(body.split("\n## ")[0])
            for name, body in zip(parts[1::2], parts[2::2])}


def test_the_policies_page_lists_every_field_of_every_policy_with_its_default():
    documented = documented_policies()
    assert sorted(documented) == sorted(POLICIES)
    for name, rows in documented.items():
        fields = dataclasses.fields(POLICIES[name])
        assert [f for f, _ in rows] == [f.name for f in fields], name
        for (field, default), f in zip(rows, fields):
            assert default == repr(f.default), f"{name}.{field}: {default} is not {f.default!r}"


POLICY_CALL = re.compile(r"\b(" + "|".join(POLICIES) + r")\(([^()]*)\)")


def policy_keywords_unknown(text: str) -> list[str]:
    return [f"{name}({keyword}=)" for name, args in POLICY_CALL.findall(text)
            for keyword in re.findall(r"(?<![\w.])(\w+)=", args)
            if keyword not in {f.name for f in dataclasses.fields(POLICIES[name])}]


def test_policy_calls_name_fields_the_policies_have():
    assert policy_keywords_unknown("Prefetch(keep_gathered=2) Offload(optimizer=True)") == []
    assert policy_keywords_unknown("Offload(optimiser=True)") == ["Offload(optimiser=)"]
    for path in CURRENT:
        assert policy_keywords_unknown(path.read_text()) == [], rel(path)
