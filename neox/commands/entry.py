"""How ``python -m neox.<command>`` runs a command: Ctrl-C before the command has handling of
its own ends in the launcher's one line, not a traceback.

    code = run_command("neox.commands.finetune")

Importing a command imports torch, which takes seconds (6 s on a busy 2-core machine); the
command then checks its flags and files before ``neox.finetune``'s launcher installs its own
SIGINT handler. Ctrl-C in that window used to end in Python's ``KeyboardInterrupt`` traceback
through torch's import (10-50 lines, exit -2). ``run_command`` imports the command's module and
calls its ``main``; a ``KeyboardInterrupt`` from either (after the ``finally`` blocks it passed
through ran) becomes ``stopped by SIGINT`` on stderr and exit 130, as the launcher says once it
runs. Nothing of the run exists yet when the import is interrupted.

Under torchrun a command's process is a rank whose parent is torchrun's agent: ``run_command``
ties it to the agent (Linux's parent-death signal) before anything else, so that an agent killed
while its ranks still import torch (seconds) or rendezvous takes them with it. Set after the
imports, as it once was, a rank whose agent died meanwhile was an orphan waiting for peers that
would never come. An agent that died before the tie is found by the parent having changed.

It must itself import nothing heavy: it runs before torch is imported (``neox``'s package face
imports its names when first used).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

__all__ = ["run_command", "tie_to_torchrun_agent"]

# The signal a torchrun rank gets when its agent dies: what torchrun itself sends its ranks to
# stop them (a rank that handles it may end cleanly; one still starting has no handler).
AGENT_DEATH_SIGNAL = signal.SIGTERM


def tie_to_torchrun_agent() -> None:
    """Under torchrun (RANK and WORLD_SIZE set, as ``neox.finetune`` tells it), asks the kernel
    for ``AGENT_DEATH_SIGNAL`` when the agent, this process's parent, dies; leaves at once, in
    one line, if it has died already. Nothing elsewhere (the command is then its own launcher,
    whose ranks tie themselves to it)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(AGENT_DEATH_SIGNAL), 0, 0, 0)
    # Asked again once the tie is made: an agent dying after it sends the signal, one dying
    # before it made this process another's child, which this sees. (One that died before the
    # first question, in the interpreter's own start-up, cannot be told from a parent that
    # started this process: torchrun names no agent to compare with.)
    if os.getppid() != parent:
        print(f"rank {os.environ['RANK']}: torchrun's agent ended before this rank started; "
              f"exiting", file=sys.stderr, flush=True)
        os._exit(128 + AGENT_DEATH_SIGNAL)


def run_command(module: str) -> int:
    """Imports ``module`` and returns its ``main()``'s exit code (Ctrl-C: 130, said in one
    line). A torchrun rank is tied to its agent first (``tie_to_torchrun_agent``)."""
    tie_to_torchrun_agent()
    try:
        return importlib.import_module(module).main()
    except KeyboardInterrupt:
        print(f"stopped by {signal.SIGINT.name}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
