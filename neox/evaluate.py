"""``python -m neox.evaluate``: a model's loss and perplexity on a text;
the command is ``neox.commands.evaluate``."""

import sys

from neox.commands.evaluate import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
