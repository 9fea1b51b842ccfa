"""``python -m zerocore.consolidate CKPT OUT``: full (unsharded) weights from a sharded checkpoint,
one layer at a time. The work is ``zerocore.checkpoint.consolidate``; this module keeps the
command's name and the names it has always offered to importers."""

import sys

from zerocore.checkpoint.consolidate import (TRAINABLE_FILE, consolidate, iter_full_layers, main,
                                             save_trainable, tensor_name)

__all__ = ["consolidate", "iter_full_layers", "save_trainable", "tensor_name", "TRAINABLE_FILE",
           "main"]

if __name__ == "__main__":
    sys.exit(main())
