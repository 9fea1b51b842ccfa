"""The documents say what a newcomer sees (issue 20, item 7): the README's first set-up command
runs the built-in run, and docs/neox.md, which the README sends its reader to for it, shows its
output and the commands to type after it (issue 42 moved them there from the README).

- The output block is the built-in run's own output: line for line where it shows lines, each
  "..." standing for lines it leaves out, progress lines picked from those the run prints (a
  terminal redraws them in place), timings ignored, integers equal and decimals to rounding.
- Every command shown for working with the run's output, in docs/neox.md's fine-tuning section
  and then in docs/checkpoints.md, works when typed in order after the first command, in a fresh
  directory (everything it writes lands under ``runs/``, which git ignores). Lines naming a
  placeholder (``path/to``, ``CKPT``, a DeepSpeed run's ``ds_run/``, ...) are templates, not
  commands, and are not run.

The built-in run trains on tiny_shakespeare, which a newcomer's machine downloads; here it is
the repository's copy (tests/data/tiny_shakespeare.txt.gz) put in the run's cache beforehand, so
that these tests run in any clone, without network or ../shared. The run takes about a minute
on 2 quiet cores.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.neox_testing import REPO, cli_env, tiny_shakespeare

NEOX_DOC = REPO / "docs" / "neox.md"
CHECKPOINTS_DOC = REPO / "docs" / "checkpoints.md"
FIRST_COMMAND = [sys.executable, "-m", "neox.finetune"]  # the first set-up command's run

# What varies between runs of the same code on the same data: wall-clock figures and the port.
TIMINGS = [(re.compile(r"[\d,]+ tok/s"), "<rate> tok/s"),
           (re.compile(r"\d+s elapsed, ~\d+s left"), "<elapsed>"),
           (re.compile(r"tcp://127\.0\.0\.1:\d+"), "tcp://127.0.0.1:<port>"),
           (re.compile(r"^built in [\d.]+ s$"), "built in <time>")]
# Where the corpus and tokenizer came from depends on what the machine has cached or downloaded;
# the document shows one case and the test compares only what follows from the run.
WHERE_FROM = ("corpus: ", "tokenizer: ")
NUMBER = re.compile(r"-?\d[\d,]*\.\d+(?:e[-+]\d+)?|-?\d[\d,]*")
PROGRESS = re.compile(r"^\[[#.]+\] (\d+)/(\d+) ")
# Decimals agree to 1% relative: the run is deterministic on one machine (fp32 on the CPU, fixed
# seeds), but another CPU's BLAS may round its matrix products differently, and over 207 steps
# that moves a printed loss in its third or fourth digit, not its second.
REL = 1e-2
# What marks a template (a path the reader supplies) rather than a command to type as is.
PLACEHOLDERS = ("path/to", "CKPT", "BASE_MODEL", "ds_run/", "...")


def section(text: str, first: str, last: str) -> str:
    """Markdown text from the heading starting with ``first`` to the end of the one starting with
    ``last``."""
    start = text.index(f"\n## {first}")
    end = text.index(f"\n## {last}", start)
    end = text.find("\n## ", end + 1)
    return text[start:end if end != -1 else len(text)]


def output_block() -> list[str]:
    """The fenced block of the fine-tuning section: what the built-in run printed."""
    text = section(NEOX_DOC.read_text(), "Fine-tuning GPT-NeoX", "Fine-tuning GPT-NeoX")
    return text.split("\n```\n", 2)[1].splitlines()


def readme_commands() -> list[str]:
    """The commands shown (indented four spaces or more) in docs/neox.md's fine-tuning section,
    then in docs/checkpoints.md, in order; continuation lines joined, comments dropped."""
    text = (section(NEOX_DOC.read_text(), "Fine-tuning GPT-NeoX", "Fine-tuning GPT-NeoX")
            + CHECKPOINTS_DOC.read_text())
    commands, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and not (line.startswith("    ") and stripped.startswith("python ")):
            continue
        stripped = stripped.split("  #", 1)[0].rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1]
            continue
        command, pending = pending + stripped, ""
        if not any(p in command for p in PLACEHOLDERS):
            commands.append(command)
    return commands


def _normal(line: str) -> str:
    for pattern, stand_in in TIMINGS:
        line = pattern.sub(stand_in, line)
    return line


def same_line(shown: str, printed: str) -> bool:
    """``shown`` (the document) and ``printed`` (run) say the same, timings aside."""
    shown, printed = _normal(shown), _normal(printed)
    if shown.startswith(WHERE_FROM):
        return printed.startswith(shown[:shown.index(":")])
    if NUMBER.sub("#", shown) != NUMBER.sub("#", printed):
        return False
    for a, b in zip(NUMBER.findall(shown), NUMBER.findall(printed)):
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
        if "." in a or "." in b:
            if abs(x - y) > REL * max(abs(x), abs(y)):
                return False
        elif x != y:
            return False
    return True


def mismatch(shown: list[str], printed: list[str]) -> str | None:
    """Why ``shown`` is not an abridged copy of ``printed``, or None. Each line shown must be the
    next line printed, except that "..." skips any number of lines, a progress line may skip
    other progress lines, and the sample's text (after its header) is compared by its presence
    only: one rounding difference elsewhere picks other tokens."""
    i, skipping = 0, False
    in_sample = False
    for line in shown:
        if line.strip() == "...":
            skipping = True
            continue
        if in_sample:
            continue
        progress = PROGRESS.match(line)
        while i < len(printed):
            if same_line(line, printed[i]):
                break
            if not (skipping or (progress and PROGRESS.match(printed[i]))):
                return (f"docs/neox.md line {line!r} does not match the run's line "
                        f"{printed[i]!r}\n"
                        f"(run output from there:\n" + "\n".join(printed[i:i + 5]) + ")")
            i += 1
        else:
            return (f"docs/neox.md line {line!r} is not in the run's output after the lines "
                    f"before it")
        in_sample = line.startswith("sample (")
        i += 1
        skipping = False
    rest = printed[i:]
    while in_sample and rest and rest[0].startswith("  "):
        rest = rest[1:]
    if rest and not skipping:
        return f"the run printed more than docs/neox.md shows: {rest[:3]}"
    return None


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> tuple[Path, dict[str, str], str]:
    """The built-in run in a fresh directory, with a cache (HOME) that holds only the corpus, as
    the download leaves it: its stdout."""
    work = tmp_path_factory.mktemp("newcomer")
    env = {**cli_env(), "HOME": str(work / "home")}
    tiny_shakespeare(work / "home" / ".cache" / "zerocore")
    proc = subprocess.run(FIRST_COMMAND, cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work, env, proc.stdout


def test_the_matcher_finds_a_changed_line():
    """The comparison can fail: a changed loss, a missing line, an unshown extra line."""
    printed = ["a 1", "[#..] 1/3 loss 2.000 | 1s elapsed, ~2s left", "[##.] 2/3 loss 1.5",
               "[###] 3/3 loss 1.000 | 3s elapsed, ~0s left", "done 3", "sample (4 tokens):",
               "  text"]
    shown = ["a 1", "[#..] 1/3 loss 2.000 | 9s elapsed, ~9s left",
             "[###] 3/3 loss 1.001 | 3s elapsed, ~0s left", "done 3", "sample (4 tokens):",
             "  other text"]
    assert mismatch(shown, printed) is None
    assert mismatch([*shown[:2], "[###] 3/3 loss 1.2"], printed) is not None
    assert mismatch(["a 1", "done 3"], printed) is not None
    assert mismatch(["a 1", "...", "done 3"], printed) is not None  # the sample not shown
    assert mismatch(["a 1", "...", "done 4", "..."], printed) is not None


def test_readme_commands_are_found():
    commands = readme_commands()
    assert commands[0].startswith("python -m neox.evaluate")
    assert any(c.startswith("python -m zerocore.consolidate") for c in commands)
    assert all(" runs/" in c or "--output-dir" not in c for c in commands), commands


@pytest.mark.e2e
def test_the_readme_output_block_is_what_the_built_in_run_prints(newcomer):
    work, env, stdout = newcomer
    # The document writes the home directory as ~, as a newcomer reads it.
    printed = stdout.replace(env["HOME"], "~").splitlines()
    problem = mismatch(output_block(), printed)
    assert problem is None, problem


def readme_metrics_keys() -> tuple[list[str], list[str]]:
    """The keys docs/neox.md says every line of metrics.jsonl holds, and those a validated step's
    line holds besides."""
    text = section(NEOX_DOC.read_text(), "Fine-tuning GPT-NeoX", "Fine-tuning GPT-NeoX")
    said = " ".join(text[text.index("`metrics.jsonl` (one JSON line"):].split())
    every, validated = said.split("per step, each step once: ", 1)[1].split(";", 1)
    return re.findall(r"`(\w+)`", every), re.findall(r"`(\w+)`", validated.split(")", 1)[0])


@pytest.mark.e2e
def test_metrics_jsonl_holds_what_the_readme_says(newcomer):
    """Each step once, each line with the keys docs/neox.md names, the validation in the last
    step's line (not a line of its own repeating that step's number)."""
    work, _, stdout = newcomer
    every, validated = readme_metrics_keys()
    assert validated == ["val_loss", "val_acc"], validated
    lines = [json.loads(line) for line in
             (work / "runs" / "neox-finetune" / "metrics.jsonl").read_text().splitlines()]
    total = int(re.search(r"^training (\d+) steps", stdout, re.M).group(1))
    assert [r["step"] for r in lines] == list(range(1, total + 1))
    for r in lines[:-1]:
        assert list(r) == every, r
    assert list(lines[-1]) == every + validated, lines[-1]


@pytest.mark.e2e
def test_every_readme_command_works_in_order_after_the_first(newcomer):
    work, env, _ = newcomer
    for command in readme_commands():
        argv = shlex.split(command)
        assert argv[0] == "python", command
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    # Everything written is under runs/ (and home/, the test's own stand-in for ~).
    assert sorted(p.name for p in work.iterdir()) == ["home", "runs"]
