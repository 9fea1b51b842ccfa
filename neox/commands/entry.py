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

It must itself import nothing heavy: it runs before torch is imported (``neox``'s package face
imports its names when first used).
"""

from __future__ import annotations

import importlib
import signal
import sys

__all__ = ["run_command"]


def run_command(module: str) -> int:
    """Imports ``module`` and returns its ``main()``'s exit code (Ctrl-C: 130, said in one
    line)."""
    try:
        return importlib.import_module(module).main()
    except KeyboardInterrupt:
        print(f"stopped by {signal.SIGINT.name}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
