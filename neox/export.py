"""``python -m neox.export``: a fine-tuning checkpoint as a Hugging Face directory;
the command is ``neox.commands.export``."""

import sys

from neox.commands.entry import run_command

if __name__ == "__main__":  # (before the command's import: Ctrl-C there is one line too)
    sys.exit(run_command("neox.commands.export"))

from neox.commands.export import main  # noqa: E402

__all__ = ["main"]
