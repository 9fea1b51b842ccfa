"""``SafetensorsFiles``: the tensors of a Hugging Face weights directory (``model.safetensors``,
or the files ``model.safetensors.index.json`` names), read by element range straight from the
files, so that a rank holding a slice of a tensor reads that slice's bytes and no others.

A safetensors file is an 8-byte little-endian header length, a JSON header (for each tensor its
dtype, shape and ``data_offsets``: begin and end bytes, relative to the end of the header) and
the tensors' bytes, row-major. Everything here is checked when the directory is opened (the
headers parsed, every offset inside its file, every byte count matching its shape, every file
the index names present and inside the directory), so that a bad file is refused before any
memory is allocated for the model; reading afterwards is one ``os.preadv`` per range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors' dtype names; the float ones are what models store, the others buffers and masks.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# A header longer than this is not a safetensors header (the format's own limit is 100 MB).
MAX_HEADER = 100 * 2 ** 20


class SafetensorsError(ValueError):
    """A weights directory that cannot be read as it claims: one line saying what and where."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype, shape and first byte in the file."""
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def inside(root: Path, name: str, *, what: str, allow_outside: bool) -> Path:
    """``root / name``, refused when it resolves outside ``root`` (an absolute name, ``..``, a
    symbolic link leading out) unless ``allow_outside``: a weights directory naming files
    elsewhere is not self-contained. The Hugging Face hub cache's snapshot links into the
    download's ``blobs/`` count as inside (every file of a cached snapshot is such a link)."""
    target = root / name
    if allow_outside:
        return target
    base = root.resolve()
    roots = [base]
    if base.parent.name == "snapshots" and base.parent.parent.name.startswith("models--"):
        roots.append(base.parent.parent / "blobs")
    resolved = target.resolve()
    if not any(resolved == r or r in resolved.parents for r in roots):
        raise SafetensorsError(f"{root}: {what} {name!r} leads outside the directory (to "
                               f"{resolved}); copy the file into it, or pass "
                               f"allow_outside=True")
    return target


def read_header(file: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, every entry checked against the file's size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{file}: truncated ({size} bytes; no safetensors "
                                       f"header); download or write it again")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER or 8 + length > size:
                raise SafetensorsError(f"{file}: truncated or not a safetensors file (header "
                                       f"of {length} bytes in a file of {size}); download or "
                                       f"write it again")
            header = json.loads(f.read(length))
    except OSError as e:
        raise SafetensorsError(f"{file}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SafetensorsError(f"{file}: its header is not JSON; not a safetensors file, or "
                               f"damaged") from None
    data = 8 + length
    out = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{file}: tensor {key!r} has a malformed header entry "
                                   f"{spec!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise SafetensorsError(f"{file}: tensor {key!r} ({spec['dtype']} {list(shape)}) "
                                   f"spans bytes {begin}..{end}, not {nbytes}; damaged file")
        if data + end > size:
            raise SafetensorsError(f"{file}: truncated: tensor {key!r} ends at byte "
                                   f"{data + end}, the file has {size}; download or write it "
                                   f"again")
        out[key] = Entry(file, dtype, shape, data + begin)
    return out


class SafetensorsFiles:
    """The tensors of a weights directory by checkpoint key, each readable by element range.

    ``bytes_read`` and ``calls`` count what ``read`` has read (what the tests check: a rank
    reads its slices, never a whole tensor it holds a slice of).
    """

    def __init__(self, path: str | os.PathLike, *, allow_outside: bool = False):
        self.path = Path(path)
        if not self.path.is_dir():
            raise SafetensorsError(f"{self.path}: no such directory; give the directory "
                                   f"holding config.json and {SINGLE} (or {INDEX})")
        index = self.path / INDEX
        if index.exists():
            files = self._indexed(index, allow_outside)
        elif (self.path / SINGLE).exists():
            files = {SINGLE: None}
        else:
            raise SafetensorsError(f"{self.path}: neither {SINGLE} nor {INDEX} is there; save "
                                   f"the model with save_pretrained (safetensors, the default)")
        self.entries: dict[str, Entry] = {}
        for name, keys in files.items():
            file = inside(self.path, name, what="the weight file", allow_outside=allow_outside)
            if not file.is_file():
                raise SafetensorsError(f"{self.path}: {INDEX} names {name!r}, which is not "
                                       f"there; download the missing file")
            found = read_header(file)
            for key in keys or found:
                if key not in found:
                    raise SafetensorsError(f"{file}: tensor {key!r} is listed in {INDEX} but "
                                           f"not in the file")
                self.entries[key] = found[key]
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0
        self.calls = 0

    def _indexed(self, index: Path, allow_outside: bool) -> dict[str, list[str]]:
        """The index's files, each with the keys it holds there."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise SafetensorsError(f"{index}: not a safetensors index (JSON with a "
                                   f"'weight_map'); download or write it again") from None
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(str(name), []).append(key)
        for name in files:
            inside(self.path, name, what=f"{INDEX} names", allow_outside=allow_outside)
        return files

    def read(self, key: str, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, in its stored dtype: the
        range's bytes alone, read from the file by offset. out: a 1-D uint8 tensor to read
        into (its first bytes; the result is a view of it), for a caller that reuses one
        buffer from read to read; None: a new one."""
        entry = self.entries[key]
        if not 0 <= start <= stop <= entry.numel:
            raise IndexError(f"{key}: range [{start}, {stop}) outside its {entry.numel} "
                             f"elements")
        size = entry.dtype.itemsize
        # A torch tensor, not a bytearray: what the read holds is a tensor allocation, which
        # zerocore.PeakMemory sees (and the plan counts: ``MemoryPlan.loading``).
        nbytes = (stop - start) * size
        if out is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes:
            raise ValueError(f"{key}: out must be a 1-D uint8 tensor of at least {nbytes} "
                             f"bytes, got {out.dtype} {tuple(out.shape)}")
        else:
            buf = out[:nbytes]
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        view, offset, done = memoryview(buf.numpy()), entry.begin + start * size, 0
        while done < len(view):  # a read may return fewer bytes than asked (2 GiB at most)
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise SafetensorsError(f"{entry.file}: ends before tensor {key!r} does (the "
                                       f"file shrank since it was opened)")
            done += got
        self.bytes_read += len(view)
        self.calls += 1
        return buf.view(entry.dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "SafetensorsFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
