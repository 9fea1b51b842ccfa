"""Loading zerocore._C: an installed build whose sources have since changed (an editable install
after a ``git pull``) is noticed, instead of loading a library that lacks the new ops."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from zerocore.kernels import _extension, _sources


def _write_info(folder, fingerprint) -> None:
    info = {"torch": torch.__version__, "cuda": None, "cuda_arch_list": None, "avx2": True}
    if fingerprint is not None:
        info["fingerprint"] = fingerprint
    (folder / "_C_build.json").write_text(json.dumps(info))


def test_a_build_of_other_sources_is_stale(tmp_path):
    current = _sources.fingerprint(_sources.repo_root(), with_cuda=False,
                                   torch_version=torch.__version__, cuda_arch_list=None)
    _write_info(tmp_path, current)
    assert not _extension._prebuilt_is_stale(str(tmp_path))
    _write_info(tmp_path, "0" * 64)
    assert _extension._prebuilt_is_stale(str(tmp_path))
    _write_info(tmp_path, None)  # a build that recorded no fingerprint: trusted as before
    assert not _extension._prebuilt_is_stale(str(tmp_path))


# -- the compile is never silent ------------------------------------------------------------------

def test_compile_progress_says_each_file_and_keeps_talking_between(tmp_path):
    """What setup.py and the first-import compile show: a line as each object file appears, and
    one every quiet_s seconds while none does (the clock is fake, the thread real)."""
    import os
    import threading
    import time
    now = [0.0]
    lines: list[str] = []
    said = threading.Event()

    def say(line: str) -> None:
        lines.append(line)
        said.set()

    def step(seconds: float, write: str | None = None) -> None:
        """Advances the fake clock (and writes an object file), then waits for the watcher."""
        said.clear()
        if write:
            (tmp_path / write).write_bytes(b"")
        now[0] += seconds
        assert said.wait(5), lines

    since = time.time() - 1
    (tmp_path / "old.o").write_bytes(b"")  # a leftover of an earlier build: not counted
    os.utime(tmp_path / "old.o", (since - 100, since - 100))
    with _sources.compile_progress(say, 3, lambda: _sources.objects_written_since(
            str(tmp_path), since), poll_s=0.01, quiet_s=20.0, clock=lambda: now[0]):
        step(7, "a.o")
        step(30)               # nothing done for 20 s: a heartbeat
        step(5, "b.o")
    assert lines == ["zerocore: 1 of 3 files compiled (7 s)",
                     "zerocore: 1 of 3 files compiled (37 s)",
                     "zerocore: 2 of 3 files compiled (42 s)"]


def _screen(written: str) -> list[str]:
    """The lines a terminal shows after ``written``: characters overwrite at the cursor, "\\r"
    and "\\b" move it back, "\\033[K" erases to the end of the line, "\\n" starts the next."""
    lines, col = [""], 0
    i = 0
    while i < len(written):
        if written.startswith("\033[K", i):
            lines[-1] = lines[-1][:col]
            i += 3
            continue
        c = written[i]
        if c == "\n":
            lines.append("")
            col = 0
        elif c == "\r":
            col = 0
        elif c == "\b":
            col = max(col - 1, 0)
        else:
            line = lines[-1].ljust(col)
            lines[-1] = line[:col] + c + line[col + 1:]
            col += 1
        i += 1
    return lines


def test_build_messages_stand_on_their_own_lines_beside_pips_spinner():
    """setup.py's messages on a terminal where pip draws its spinner between them (as pip's
    InteractiveSpinner does: its line, then each character erased by backspace and space):
    every message is a line of its own, and pip's line stays."""
    terminal = _sources.TerminalLines()
    spinner = "  Building editable for zerocore (pyproject.toml) ... "
    written = spinner + "-"
    messages = ["zerocore: compiling", "zerocore: 1 of 9 files compiled",
                "zerocore: compiled zerocore._C in 31 s"]
    for i, message in enumerate(messages):
        written += terminal.text(message)
        written += "\b \b" + "\\|/-"[i]  # the spinner's next character
    written += "\b \bdone\n"
    assert _screen(written) == [spinner + "-", *messages, "done", ""]
    # Each message written as a plain line would have ended the spinner's line instead.
    assert _screen(spinner + "-" + messages[0] + "\n")[0].endswith("-zerocore: compiling")


def test_one_compile_time_is_stated():
    """setup.py and the first-import compile quote the figure measured (docs/decisions.md); the
    README quotes the same."""
    from pathlib import Path
    root = Path(_sources.repo_root())
    for path in (root / "setup.py", root / "zerocore" / "kernels" / "_extension.py"):
        text = path.read_text()
        assert "CPU_COMPILE_TIME" in text and "minutes on 2 cores" not in text, path
    assert f"{_sources.CPU_COMPILE_TIME} to compile" in (root / "README.md").read_text()


def test_build_messages_reach_stderr_when_nothing_configured_logging():
    """The compile's messages go through the ``zerocore`` logger as warnings: with no logging
    configured (a plain ``import zerocore`` on a terminal), logging's last-resort handler
    writes each one as it is, one line on stderr; an application that configures logging
    gets them through its own handlers."""
    code = ("from zerocore.kernels import _extension; "
            "_extension._say('zerocore: 1 of 3 files compiled (7 s)')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=_sources.repo_root(), check=True)
    assert proc.stderr == "zerocore: 1 of 3 files compiled (7 s)\n" and proc.stdout == ""
    configured = ("import logging, sys; logging.basicConfig(stream=sys.stdout, "
                  "format='%(name)s %(levelname)s %(message)s'); " + code)
    proc = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True,
                          cwd=_sources.repo_root(), check=True)
    assert proc.stdout == ("zerocore.kernels._extension WARNING zerocore: 1 of 3 files "
                           "compiled (7 s)\n") and proc.stderr == ""
