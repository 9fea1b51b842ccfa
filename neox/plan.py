"""``python -m neox.plan``: what a fine-tuning run needs per GPU, before the machines are rented;
the command is ``neox.commands.plan``."""

import sys

from neox.commands.entry import run_command

if __name__ == "__main__":  # (before the command's import: Ctrl-C there is one line too)
    sys.exit(run_command("neox.commands.plan"))

from neox.commands.plan import main  # noqa: E402

__all__ = ["main"]
