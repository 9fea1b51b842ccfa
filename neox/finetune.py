"""``python -m neox.finetune``: fine-tune a GPT-NeoX model; the command is
``neox.commands.finetune``."""

import os
import sys

from neox.commands.finetune import main

__all__ = ["main"]

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The run is over (its ranks are gone, the output directory's lock released): leave
    # without the interpreter's teardown, which with torch imported takes 0.5-0.7 s on a busy
    # 2-core machine; after SIGTERM it counted against the 2 s in which the run must be gone.
    os._exit(code)
