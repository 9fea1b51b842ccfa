"""``python -m neox.finetune``: fine-tune a GPT-NeoX model; the command is
``neox.commands.finetune``."""

import os
import sys

from neox.commands.entry import run_command

if __name__ == "__main__":  # (before the command's import: Ctrl-C there is one line too)
    code = run_command("neox.commands.finetune")
    sys.stdout.flush()
    sys.stderr.flush()
    # The run is over (its ranks are gone, the output directory's lock released): leave
    # without the interpreter's teardown, which with torch imported takes 0.5-0.7 s on a busy
    # 2-core machine; after SIGTERM it counted against the 2 s in which the run must be gone.
    os._exit(code)

from neox.commands.finetune import main  # noqa: E402

__all__ = ["main"]
