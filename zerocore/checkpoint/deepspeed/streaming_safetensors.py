"""A safetensors file written tensor by tensor: each tensor is produced just before its bytes
are written, so only one is in memory whatever the file's size."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from zerocore.checkpoint.durable_io import write_file
from zerocore.checkpoint.errors import DeepSpeedCheckpointError

__all__ = ["write_safetensors"]


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...],
                                                       Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Writes a safetensors file whose tensors are produced one at a time by each entry's
    function (so only one is in memory), in the order given; ``path`` must not exist. Durable
    (fsynced); returns the file's SHA-256 and size."""
    if sys.byteorder != "little":
        raise DeepSpeedCheckpointError("safetensors files are little-endian; this machine is not")
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for name, dtype, shape, _ in entries:
        if dtype not in _ST_DTYPES:
            raise DeepSpeedCheckpointError(f"{name}: dtype {dtype} has no safetensors name")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data start 8-byte aligned, as safetensors writes them

    def fill(f: Any) -> None:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape, produce in entries:
            t = produce()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise AssertionError(f"{name}: produced {t.dtype} {tuple(t.shape)}, declared "
                                     f"{dtype} {tuple(shape)}")
            if t.numel():
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))

    return write_file(path, fill)
