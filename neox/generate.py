"""``python -m neox.generate``: sample text from a GPT-NeoX model;
the command is ``neox.commands.generate``."""

import sys

from neox.commands.generate import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
