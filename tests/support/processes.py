"""The processes of a run a test started, found by an environment variable that every
descendant inherits (``/proc/PID/environ``), whoever its parent is by then: a rank whose
launcher died is another process's child."""

from __future__ import annotations

import time
from pathlib import Path

# The environment variable that marks every process of one run started by a test.
RUN_MARK = "NEOX_TEST_RUN"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


def marked(mark: str) -> list[int]:
    """The live processes whose environment carries ``RUN_MARK=mark``."""
    found, needle = [], f"{RUN_MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0") and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def left_after(mark: str, seconds: float) -> list[int]:
    """The processes marked ``mark`` still alive ``seconds`` from now (or as soon as none is)."""
    deadline = time.monotonic() + seconds
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return marked(mark)
