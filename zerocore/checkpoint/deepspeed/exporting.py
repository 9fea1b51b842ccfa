"""``export``: a DeepSpeed ZeRO-3 checkpoint's weights written as safetensors under the model's
own parameter names (the command ``python -m zerocore.from_deepspeed``).

What is written (OUT must not exist):
- default: ``model.safetensors``, every parameter (frozen ones too: ZeRO-3 checkpoints hold
  them) and the saved buffers, as DeepSpeed's ``zero_to_fp32.py`` gives them (the same tensors,
  bit for bit: fp32 master values, frozen and buffer values in fp32);
- ``--trainable-only``: only the parameters that had optimizer state. When their names are
  PEFT's (LoRA adapters), a PEFT adapter directory: ``adapter_model.safetensors`` under PEFT's
  saved names (without the adapter name) and, when the checkpoint directory or
  ``--adapter-config`` provides it, ``adapter_config.json``; otherwise ``trainable.safetensors``;
- ``--dtype 16bit``: the run's 16-bit values (bf16 or fp16, as it trained) instead: the master
  values cast as DeepSpeed casts them into its 16-bit parameters, frozen ones as stored.

Output is written into a temporary directory renamed to OUT at the end."""

from __future__ import annotations

import json
import math
import re
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from zerocore.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zerocore.checkpoint.deepspeed.streaming_safetensors import write_safetensors
from zerocore.checkpoint.durable_io import fsync_dir, make_dir, rename, write_file
from zerocore.checkpoint.errors import DeepSpeedCheckpointError

__all__ = ["export", "adapter_names", "peft_name", "MODEL_FILE", "TRAINABLE_FILE",
           "ADAPTER_FILE", "ADAPTER_CONFIG"]

MODEL_FILE = "model.safetensors"
TRAINABLE_FILE = "trainable.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


_LORA_RE = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
                      r"lora_magnitude_vector)\.([^.]+)(?=\.|$)")


def adapter_names(names: list[str]) -> set[str]:
    """The PEFT adapter names (``default``...) that LoRA parameter names carry."""
    return {m.group(2) for n in names for m in [_LORA_RE.search(n)] if m}


def peft_name(name: str, adapter: str) -> str:
    """A PEFT model's parameter name as PEFT saves it: without the adapter's name
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return re.sub(rf"\.{re.escape(adapter)}(?=\.|$)", "", name)


def _adapter_config(ckpt: DeepSpeedCheckpoint, given: Path | None) -> bytes | None:
    """The LoRA config: ``given`` (a file, or a directory holding adapter_config.json), else
    the one beside the tag directories (where Hugging Face's Trainer saves it), else none."""
    candidates = [given / ADAPTER_CONFIG if given.is_dir() else given] if given else \
        [ckpt.tag_dir.parent / ADAPTER_CONFIG, ckpt.tag_dir / ADAPTER_CONFIG]
    for path in candidates:
        if not path.is_file():
            if given:
                raise DeepSpeedCheckpointError(f"{path}: no such file (--adapter-config)")
            continue
        raw = path.read_bytes()
        try:
            config = json.loads(raw)
        except ValueError as e:
            raise DeepSpeedCheckpointError(f"{path}: not JSON ({e})") from None
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise DeepSpeedCheckpointError(
                f"{path}: not a PEFT LoRA config (peft_type is "
                f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
        return raw
    return None


def export(checkpoint: str | Path, out: str | Path, *, tag: str | None = None,
           trainable_only: bool = False, dtype: str = "fp32",
           adapter_config: str | Path | None = None,
           log: Callable[[str], Any] = print) -> Path:
    """Writes the DeepSpeed checkpoint's weights to the new directory ``out`` (see the module
    docstring for what, and ``--help``); returns ``out``. dtype: "fp32" (the master values)
    or "16bit" (the run's bf16/fp16 values). Everything is checked before anything is written;
    errors are one ``DeepSpeedCheckpointError`` line, or a ``CheckpointWriteError`` naming the
    path and the errno."""
    out = Path(out)
    if dtype not in ("fp32", "16bit"):
        raise DeepSpeedCheckpointError(f"dtype must be 'fp32' or '16bit', got {dtype!r}")
    if out.exists() or out.is_symlink():
        raise DeepSpeedCheckpointError(f"{out} exists; choose a new output directory (nothing "
                                       f"is overwritten)")
    ckpt = DeepSpeedCheckpoint(checkpoint, tag)
    if dtype == "16bit" and ckpt.dtype16 is None:
        raise DeepSpeedCheckpointError(
            f"{ckpt.tag_dir}: --dtype 16bit: this run trained in fp32 (its DeepSpeed config "
            f"enables neither bf16 nor fp16), so it has no 16-bit values; leave --dtype out")
    names = ckpt.names(trainable_only=trainable_only)
    trained = set(ckpt.trainable)
    adapters = adapter_names(names) if trainable_only else set()
    if len(adapters) > 1:
        raise DeepSpeedCheckpointError(f"{ckpt.tag_dir}: the run trained {len(adapters)} "
                                       f"adapters ({sorted(adapters)}); a PEFT directory holds "
                                       f"one: leave --trainable-only out to write them all")
    config = _adapter_config(ckpt, Path(adapter_config) if adapter_config else None) \
        if adapters else None
    if adapter_config and not adapters:
        raise DeepSpeedCheckpointError(f"--adapter-config: the trained parameters of "
                                       f"{ckpt.tag_dir} are not PEFT LoRA adapters "
                                       f"(--trainable-only writes them as {TRAINABLE_FILE})")

    def out_dtype(name: str) -> torch.dtype:
        stored = ckpt.stored_dtype(name)
        if not stored.is_floating_point:
            return stored  # integer buffers keep their values
        if dtype == "fp32":
            return torch.float32  # as zero_to_fp32: master values, the rest upcast
        source = ckpt.shared.get(name, name) if name not in ckpt._own() else name
        return ckpt.dtype16 if source in trained else stored

    def producer(name: str, to: torch.dtype) -> Callable[[], torch.Tensor]:
        # DeepSpeed's 16-bit parameters are its fp32 masters cast (round to nearest even).
        return lambda: ckpt.read(name).to(to)

    adapter = next(iter(adapters)) if adapters else None
    entries = [(peft_name(n, adapter) if adapter else n, out_dtype(n), ckpt.shape(n),
                producer(n, out_dtype(n))) for n in names]
    saved = [e[0] for e in entries]
    if len(set(saved)) != len(saved):
        raise DeepSpeedCheckpointError(f"{ckpt.tag_dir}: two parameters would be saved under "
                                       f"one name after removing the adapter name {adapter!r}")
    filename = ADAPTER_FILE if adapter else TRAINABLE_FILE if trainable_only else MODEL_FILE
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    make_dir(out.parent, parents=True)
    make_dir(tmp)
    try:
        write_safetensors(tmp / filename, entries, metadata={"format": "pt"})
        if config is not None:
            write_file(tmp / ADAPTER_CONFIG, lambda f: f.write(config))
        fsync_dir(tmp)
        rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        for p in tmp.glob("*") if tmp.exists() else ():
            p.unlink(missing_ok=True)
        if tmp.exists():
            tmp.rmdir()
        raise
    total = sum(math.prod(e[2]) * e[1].itemsize for e in entries)
    log(f"wrote {out / filename}: {len(entries)} tensors, {total:,} bytes "
        f"({'16-bit' if dtype == '16bit' else 'fp32'}) from {ckpt.tag_dir} "
        f"(DeepSpeed {ckpt.ds_version}, ZeRO-3, {ckpt.world_size} ranks)")
    if adapter and config is None:
        log(f"note: no LoRA config found (neither {ckpt.tag_dir.parent / ADAPTER_CONFIG} nor "
            f"--adapter-config): add {ADAPTER_CONFIG} to {out} before loading it with PEFT")
    return out
