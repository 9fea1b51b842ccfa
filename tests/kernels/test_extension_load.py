"""Loading zerocore._C: an installed build whose sources have since changed (an editable install
after a ``git pull``) is noticed, instead of loading a library that lacks the new ops."""

from __future__ import annotations

import contextlib
import json
import logging
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


# -- a killed compile does not block later imports -----------------------------------------------

@contextlib.contextmanager
def _capture_warnings(on_record=None):
    """The messages of zerocore's kernel loader while the block runs (on_record(record) is
    called as each comes)."""
    said = []

    class Collect(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
            if on_record is not None:
                on_record(record)

    handler = Collect()
    _extension.logger.addHandler(handler)
    try:
        yield said
    finally:
        _extension.logger.removeHandler(handler)


# A builder as zerocore runs one: it takes zerocore's lock, then torch's baton (the `lock` file
# cpp_extension.load creates), and is killed mid-compile.
_KILLED_BUILDER = """
import os, signal, sys
from torch.utils.file_baton import FileBaton
from zerocore.kernels import _extension

def build():
    assert FileBaton(os.path.join(sys.argv[1], "lock")).try_acquire()
    os.kill(os.getpid(), signal.SIGKILL)

_extension._build_locked(sys.argv[1], build)
"""


def test_a_killed_compile_leaves_no_lock_that_blocks_the_next(tmp_path):
    """The next build takes torch's baton at once (without the fix, torch's loader finds the dead
    builder's `lock` and polls for it forever: here try_acquire is False), says what it removed,
    and a build that finds no stale lock says nothing."""
    from torch.utils.file_baton import FileBaton

    done = subprocess.run([sys.executable, "-c", _KILLED_BUILDER, str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    assert (tmp_path / "lock").exists(), "the simulated builder must leave torch's lock behind"

    def build():
        baton = FileBaton(str(tmp_path / "lock"))
        acquired = baton.try_acquire()
        if acquired:
            baton.release()
        return acquired

    with _capture_warnings() as said:
        assert _extension._build_locked(str(tmp_path), build) is True
    assert said == [f"zerocore: removing {tmp_path / 'lock'}, left by a compile that was killed"]
    with _capture_warnings() as said:
        assert _extension._build_locked(str(tmp_path), build) is True
    assert said == []


def test_a_live_builders_lock_is_waited_for_not_removed(tmp_path):
    """While another process holds zerocore's lock (building), its `lock` is not touched: the
    second builder waits, saying so, and runs once the first has finished."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys\n"
         "f = open(os.path.join(sys.argv[1], 'zerocore.flock'), 'a')\n"
         "fcntl.flock(f, fcntl.LOCK_EX)\n"
         "open(os.path.join(sys.argv[1], 'lock'), 'w').close()\n"
         "print('holding', flush=True)\n"
         "sys.stdin.readline()\n"
         "os.remove(os.path.join(sys.argv[1], 'lock'))\n", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "holding\n"
    seen = []

    def build():
        seen.append((tmp_path / "lock").exists())
        return "built"

    def say_and_release(record):
        # The waiting line comes before the wait: only then let the holder finish.
        if "waiting for it" in record.getMessage():
            holder.stdin.write("\n")
            holder.stdin.flush()

    with _capture_warnings(on_record=say_and_release) as said:
        assert _extension._build_locked(str(tmp_path), build) == "built"
    assert holder.wait() == 0
    assert said == [f"zerocore: another process is compiling the kernels into {tmp_path}; "
                    f"waiting for it"]
    assert seen == [False], "the live builder's lock was removed by the waiting one"
