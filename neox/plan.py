"""``python -m neox.plan``: what a fine-tuning run needs per GPU, before the machines are rented;
the command is ``neox.commands.plan``."""

import sys

from neox.commands.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
