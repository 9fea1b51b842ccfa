"""python -m neox.export CKPT OUT: a fine-tuning checkpoint as a Hugging Face directory, on the
CPU, one layer at a time, without the processes that trained it.

The base weights come from where the run took them (its ``--checkpoint``, or the preset's seeded
random initialisation), the trained parameters from the checkpoint's fp32 master shards; both are
recorded in the checkpoint's manifest (the run's recipe and model configuration). LoRA adapters
are merged into the weights (default) or, with ``--lora separate``, the base model is exported
unchanged and the adapters are written beside it in PEFT's layout
(``adapter/adapter_model.safetensors`` + ``adapter_config.json``).

The checkpoint is verified whole before any path its recipe names is opened; one of a format
older than rank-file identities is exported only with ``--allow-unverified``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from neox.commands.flags import HelpFormatter, Parser, recipe_argument, recipe_field
from neox.run.export import export, export_trainable
from neox.run.invocation import ALLOW_UNVERIFIED
from neox.run.recipe import RecipeError
from neox.run.run_dir import OutputDirError
from neox.run.trained import run_checkpoint
from neox.weights import WeightsError
from zerocore.checkpoint import CheckpointError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m neox.export", description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path,
                   help="a neox.finetune checkpoint (step-XXXXXXXX), or a run's output directory "
                        "or its checkpoints folder (the run's newest checkpoint)")
    p.add_argument("out", type=Path, help="output directory (must not exist or be empty)")
    p.add_argument("--lora", choices=["merged", "separate"], default="merged",
                   help="merge LoRA adapters into the weights, or write them beside the base "
                        "model in PEFT's layout")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists (it is replaced only once the export is "
                        "complete)")
    recipe_argument(p, recipe_field("data", "tokenizer"),
                    help="tokenizer.json to put in the export (default: the run's own, found "
                         "by its checksum beside the checkpoints or where the run took it)")
    p.add_argument("--trainable-only", action="store_true",
                   help="write only the trained tensors (biases, LoRA adapters, ...) under the "
                        "model's own names to OUT/trainable.safetensors; no base weights read")
    recipe_argument(p, ALLOW_UNVERIFIED)
    args = p.parse_args(argv)
    if args.tokenizer is not None and not args.tokenizer.is_file():
        print(f"error: --tokenizer {args.tokenizer}: no such file", file=sys.stderr)
        return 2
    try:
        found = run_checkpoint(args.checkpoint)
        if found is not None and found != args.checkpoint:
            print(f"the newest checkpoint of the run in {args.checkpoint}: {found}")
            args.checkpoint = found
        if args.trainable_only:
            out = export_trainable(args.checkpoint, args.out, overwrite=args.overwrite,
                                   allow_unverified=args.allow_unverified)
        else:
            out = export(args.checkpoint, args.out, lora=args.lora, overwrite=args.overwrite,
                         tokenizer=args.tokenizer, allow_unverified=args.allow_unverified)
    except FileExistsError:
        print(f"error: {args.out} exists and is not an empty directory; choose another output "
              f"directory, or pass --overwrite to replace it", file=sys.stderr)
        return 2
    except OutputDirError as e:  # a run directory without a checkpoint: run_checkpoint's words
        print(f"error: {str(e).replace('--resume ', '')}", file=sys.stderr)
        return 2
    except (WeightsError, CheckpointError, RecipeError) as e:
        # (CheckpointWriteError, a CheckpointError, is every write's: one line, path and reason)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {e.filename or args.out}: [Errno {e.errno}] "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
