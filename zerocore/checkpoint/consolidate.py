"""python -m zerocore.consolidate CKPT OUT: rebuild full (unsharded) weights from a sharded
checkpoint, on the CPU, one layer at a time.

OUT becomes a directory of safetensors files named ``layers.<i>.<parameter name>`` (with
``--model-names``, a ``zerocore.shard_model`` checkpoint's tensors by the model's own names):
- default: one file per layer plus ``model.safetensors.index.json`` (Hugging Face's sharded
  layout), streamed so host memory stays near one layer;
- ``--trainable-only``: one ``trainable.safetensors`` with only the trained parameters (biases or
  LoRA adapters): its size is proportional to what was trained, not to the model.
Frozen weights are in a checkpoint only if it was saved with ``include_frozen``; otherwise they
are the base model's, and a full export goes through the application (``neox`` export).
The checkpoint is verified first (``open_checkpoint``); one of a format older than rank-file
identities is consolidated only with ``--allow-unverified``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from zerocore.checkpoint.errors import CheckpointError
from zerocore.checkpoint.dirs import latest_checkpoint
from zerocore.checkpoint.manifest import MANIFEST, read_manifest, unverified_reason
# iter_full_layers lived here: importers of zerocore.consolidate.iter_full_layers keep working.
from zerocore.checkpoint.reader import DTYPES, iter_full_layers, open_checkpoint
from zerocore.checkpoint.durable_io import make_dir, write_atomically, write_error, writing

__all__ = ["consolidate", "iter_full_layers", "save_trainable", "tensor_name", "TRAINABLE_FILE",
           "main"]

TRAINABLE_FILE = "trainable.safetensors"


def tensor_name(index: int, name: str, model_names: bool) -> str:
    """A consolidated tensor's name: ``layers.<i>.<name>``, or the name alone with
    ``model_names`` (``shard_model`` checkpoints, whose names are the model's own)."""
    return name if model_names else f"layers.{index}.{name}"


def save_trainable(path: Path, layers: Iterable[tuple[int, dict[str, torch.Tensor]]], *,
                   model_names: bool = False) -> Path:
    """The trained parameters only, as one safetensors file whose tensors are named
    ``layers.<i>.<parameter name>`` (``model_names``: ``<parameter name>``), written atomically
    (a temporary file beside it, renamed). What ``--trainable-only`` writes from a checkpoint,
    and what an application writes from a live model (``ShardedSequential.iter_full_states(
    trainable_only=True, to_rank=...)``). A write error is one ``CheckpointWriteError`` line
    naming the path and the reason (whatever safetensors or the OS raised); an earlier file at
    ``path`` is then unchanged."""
    tensors: dict[str, torch.Tensor] = {}
    for index, state in layers:
        tensors.update({tensor_name(index, name, model_names): t for name, t in state.items()})
    return write_atomically(Path(path), lambda tmp: save_file(tensors, str(tmp)))


def consolidate(ckpt: Path, out: Path, *, trainable_only: bool = False,
                dtype: torch.dtype | None = None, model_names: bool = False, log=print,
                allow_unverified: bool = False) -> Path:
    """Writes the consolidated weights to ``out`` (atomically: a temporary directory renamed at
    the end). Returns out. model_names: tensors named by their parameter names alone, without
    ``layers.<i>.`` (for checkpoints of ``zerocore.shard_model``, whose parameter names are the
    model's own); refused when two layers hold the same name. allow_unverified: consolidate a
    checkpoint of a format whose rank files do not record whose they are (logged)."""
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new output directory (nothing is "
                              f"overwritten)")
    # Everything that can be known to fail is checked before anything is written: the whole
    # checkpoint is verified (manifest, COMMIT, every rank file).
    reader = open_checkpoint(ckpt, allow_unverified=allow_unverified)
    manifest = reader.manifest
    if unverified_reason(manifest):
        log(f"note: {ckpt} cannot be verified ({unverified_reason(manifest)}); consolidating it "
            f"as --allow-unverified asks")
    n_layers = len(manifest["layers"])
    if not trainable_only and not manifest["include_frozen"]:
        missing = [i for i, saved in enumerate(manifest["layers"]) if saved["frozen"] is not None]
        if missing:
            raise CheckpointError(
                f"{ckpt}: cannot rebuild the full weights: the checkpoint holds no frozen "
                f"weights (it was saved without include_frozen, so layers {missing} keep theirs "
                f"in the base model); use --trainable-only, or export through the application "
                f"with the base model")
    if model_names:
        names = [slot[0] for saved in manifest["layers"] for g in (saved["trainable"],
                 saved["frozen"]) if g is not None for slot in g["slots"]]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise CheckpointError(f"{ckpt}: --model-names: layers share parameter names "
                                  f"({twice[:3]}...); this checkpoint's names are per layer "
                                  f"(zerocore.shard): leave --model-names out")
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    make_dir(tmp, parents=True)
    try:
        trainable: list[tuple[int, dict[str, torch.Tensor]]] = []
        index: dict[str, str] = {}
        total = 0
        for i, tensors in reader.full_layers(trainable_only=trainable_only, dtype=dtype):
            named = {tensor_name(i, k, model_names): v for k, v in tensors.items()}
            total += sum(t.numel() * t.element_size() for t in named.values())
            if trainable_only:
                trainable.append((i, tensors))
            elif named:
                name = f"model-{i + 1:05d}-of-{n_layers:05d}.safetensors"
                with writing(out / name):  # safetensors' own error, as one line
                    save_file(named, str(tmp / name))
                index.update({k: name for k in named})
            log(f"layer {i + 1}/{n_layers}: {len(named)} tensors")
        if trainable_only:
            save_trainable(tmp / TRAINABLE_FILE, trainable, model_names=model_names)
        else:
            with writing(out / "model.safetensors.index.json"), \
                    open(tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
        with writing(out, f"rename {tmp} to"):
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerocore.consolidate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path,
                   help="a checkpoint directory (step-XXXXXXXX), or a folder of them (the newest "
                        "committed one is used, and named)")
    p.add_argument("out", type=Path, help="output directory (must not exist)")
    p.add_argument("--trainable-only", action="store_true",
                   help="write only the trained parameters")
    p.add_argument("--dtype", choices=["fp32", "training"], default="fp32",
                   help="fp32, or the dtype the model was trained in")
    p.add_argument("--model-names", action="store_true",
                   help="name tensors by the model's own parameter names, without "
                        "'layers.<i>.' (checkpoints of zerocore.shard_model)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="read a checkpoint of an older format (1 or 2), whose rank files do not "
                        "record which save, rank and step they are of")
    args = p.parse_args(argv)
    dtype = None
    try:
        if not (args.checkpoint / MANIFEST).is_file():
            newest = latest_checkpoint(args.checkpoint) if args.checkpoint.is_dir() else None
            if newest is not None:
                print(f"the newest checkpoint in {args.checkpoint}: {newest}")
                args.checkpoint = newest
        if args.dtype == "training":
            dtype = DTYPES[read_manifest(args.checkpoint,
                                         allow_unverified=args.allow_unverified)["param_dtype"]]
        out = consolidate(args.checkpoint, args.out, trainable_only=args.trainable_only,
                          dtype=dtype, model_names=args.model_names,
                          allow_unverified=args.allow_unverified)
    except (CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing OUT: one line naming the path and the errno, not a traceback
        print(f"error: {write_error('write', Path(e.filename or args.out), e)}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
