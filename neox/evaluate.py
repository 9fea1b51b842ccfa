"""``python -m neox.evaluate``: a model's loss and perplexity on a text;
the command is ``neox.commands.evaluate``."""

import sys

from neox.commands.entry import run_command

if __name__ == "__main__":  # (before the command's import: Ctrl-C there is one line too)
    sys.exit(run_command("neox.commands.evaluate"))

from neox.commands.evaluate import main  # noqa: E402

__all__ = ["main"]
