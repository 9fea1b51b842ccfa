"""``python -m zerocore.selftest``: checks this installation's kernels and engine and prints one
table of what works. The checks are ``zerocore.tools.selftest``; this module keeps the command's
name."""

import sys

from zerocore.tools.selftest import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
