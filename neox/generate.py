"""``python -m neox.generate``: sample text from a GPT-NeoX model;
the command is ``neox.commands.generate``."""

import sys

from neox.commands.entry import run_command

if __name__ == "__main__":  # (before the command's import: Ctrl-C there is one line too)
    sys.exit(run_command("neox.commands.generate"))

from neox.commands.generate import main  # noqa: E402

__all__ = ["main"]
