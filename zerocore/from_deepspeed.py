"""python -m zerocore.from_deepspeed CKPT OUT: a DeepSpeed ZeRO-3 checkpoint, read without
DeepSpeed, written as safetensors under the model's own parameter names
(``zerocore.checkpoint.deepspeed`` says how it is read and what is written). A module of its
own, which the package does not import, so that ``python -m`` runs it without a warning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zerocore.checkpoint.errors import CheckpointError
from zerocore.checkpoint.deepspeed import ADAPTER_CONFIG, TRAINABLE_FILE, export
from zerocore.checkpoint.durable_io import write_error

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zerocore.from_deepspeed",
        description="Write a DeepSpeed ZeRO-3 checkpoint's weights as safetensors under the "
                    "model's own parameter names, without DeepSpeed: every parameter in fp32 "
                    "(what DeepSpeed's zero_to_fp32.py gives) by default. Nothing in the "
                    "checkpoint's pickles can run code. To resume the run on zerocore, pass "
                    "the checkpoint directory to zerocore.load_checkpoint instead.")
    p.add_argument("checkpoint", type=Path,
                   help="the directory DeepSpeed saved into (holding 'latest'), or a tag "
                        "directory (global_stepN)")
    p.add_argument("out", type=Path, help="output directory (must not exist)")
    p.add_argument("--tag", help="the save to read (a directory name such as global_step100); "
                                 "default: the one 'latest' names")
    p.add_argument("--trainable-only", action="store_true",
                   help="only the parameters that had optimizer state (LoRA adapters, biases): "
                        "a PEFT adapter directory when their names are PEFT's, else "
                        f"{TRAINABLE_FILE}")
    p.add_argument("--dtype", choices=["fp32", "16bit"], default="fp32",
                   help="fp32: the master values (default); 16bit: the run's bf16/fp16 values")
    p.add_argument("--adapter-config", type=Path, metavar="FILE",
                   help=f"the LoRA config ({ADAPTER_CONFIG}, or a directory holding one) to "
                        f"write beside the adapter; default: the one in CHECKPOINT, if any")
    args = p.parse_args(argv)
    try:
        export(args.checkpoint, args.out, tag=args.tag, trainable_only=args.trainable_only,
               dtype=args.dtype, adapter_config=args.adapter_config)
    except CheckpointError as e:  # DeepSpeedCheckpointError, CheckpointWriteError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # anything else the filesystem refused: one line, the path and errno
        print(f"error: {write_error('read or write', Path(e.filename or args.out), e)}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
