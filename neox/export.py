"""``python -m neox.export``: a fine-tuning checkpoint as a Hugging Face directory;
the command is ``neox.commands.export``."""

import sys

from neox.commands.export import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
