"""Reading a DeepSpeed checkpoint's pickles safely: torch's weights-only unpickler with an
allowlist, DeepSpeed's own classes that appear in its files (``ZeroStageEnum``, its loss scalers)
mapped to inert records defined here, so nothing in a file can run code; any other class is
refused in one line naming the file and the class. Tensors are not loaded with the pickle: each
becomes a ``TensorRef`` (file, byte offset, dtype, shape) into the file's uncompressed zip
record, read later, only the bytes asked for."""

from __future__ import annotations

import dataclasses
import io
import math
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from zerocore.checkpoint.errors import DeepSpeedCheckpointError

__all__ = ["ZeroStage", "DeepSpeedRecord", "STAND_INS", "TensorRef", "Unpickled", "read_pickle",
           "MAX_DEPTH"]


class ZeroStage(int):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an ``int`` enum)."""


class DeepSpeedRecord:
    """Stands in for an object of one of DeepSpeed's classes found in a checkpoint: it only
    keeps what the pickle gave it (constructor arguments, state); it has no behaviour."""

    ds_class = "?"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<record of {self.ds_class}: {self.state!r}>"


def _record(ds_class: str) -> type:
    return type(ds_class.rsplit(".", 1)[1], (DeepSpeedRecord,), {"ds_class": ds_class})


# The only non-torch classes a DeepSpeed ZeRO checkpoint may name, each mapped to an inert
# stand-in. torch's weights-only unpickler allows its own tensor and container types.
STAND_INS: tuple[tuple[type, str], ...] = (
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    *((_record(name), name) for name in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    )),
)


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor in a torch zip file, not read: its bytes are ``nbytes`` at ``offset``."""

    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, start: int = 0, count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` of the flattened tensor, read from the file
        (into ``out``, 1-D, of this dtype, when given)."""
        count = self.numel - start if count is None else count
        if start < 0 or count < 0 or start + count > self.numel:
            raise DeepSpeedCheckpointError(f"{self.path}: elements {start}..{start + count} "
                                           f"asked of a tensor of {self.numel}")
        if out is None:
            out = torch.empty(count, dtype=self.dtype)
        size = self.dtype.itemsize
        view = memoryview(out.view(torch.uint8).numpy()) if count else memoryview(b"")
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * size)
            got = f.readinto(view) if count else 0
        if got != count * size:
            raise DeepSpeedCheckpointError(f"{self.path}: truncated: {got} of {count * size} "
                                           f"bytes of a tensor could be read")
        return out


def _refusal(path: Path, e: Exception) -> DeepSpeedCheckpointError:
    text = str(e)
    m = re.search(r"GLOBAL (\S+)", text)
    if m:
        return DeepSpeedCheckpointError(
            f"{path}: refused: it names {m.group(1)}, which is neither a tensor type nor one "
            f"of DeepSpeed's checkpoint classes; nothing in it was run. A DeepSpeed ZeRO "
            f"checkpoint never needs it: was this file made or changed by something else?")
    return DeepSpeedCheckpointError(f"{path}: refused, not a safe DeepSpeed checkpoint file: "
                                    f"{_first_line(e)}")


@dataclasses.dataclass(frozen=True)
class Unpickled:
    """What a torch file holds: ``value`` (tensors as ``TensorRef``), and ``saved_as``, the name
    torch gave the file's records when it was written (``torch.save(obj, "x/name.pt")`` files
    them under ``name/``; "archive" when it was written to a file object): the file's own
    name at the time, whatever it is called now."""

    value: Any
    saved_as: str


# DeepSpeed's files nest five levels deep (optimizer state in optimizer state, per group, per
# moment); a file nested far deeper is not one of them, and would exhaust Python's stack in
# every walk over it (a list holding itself is infinitely deep).
MAX_DEPTH = 64


def read_pickle(path: Path) -> Unpickled:
    """The object a torch file holds, unpickled by torch's weights-only unpickler with
    ``STAND_INS`` allowed, every tensor replaced by a ``TensorRef`` (no tensor data read).
    Anything else, a structure nested deeper than ``MAX_DEPTH`` included, is one
    ``DeepSpeedCheckpointError`` line."""
    from torch import _weights_only_unpickler as wou

    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise DeepSpeedCheckpointError(f"{path}: missing") from None
    except IsADirectoryError:
        raise DeepSpeedCheckpointError(f"{path}: a directory, not a torch file") from None
    except Exception as e:  # noqa: BLE001  (zipfile's parser of a damaged file raises many)
        raise DeepSpeedCheckpointError(f"{path}: not a complete torch file ({_first_line(e)}): "
                                       f"truncated or damaged; copy it again from where the "
                                       f"run saved it") from None
    with zf:
        names = zf.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise DeepSpeedCheckpointError(f"{path}: not a torch file (no data.pkl record)")
        prefix = pkl[0][:-len("data.pkl")]
        if f"{prefix}byteorder" in names and zf.read(f"{prefix}byteorder") != b"little":
            raise DeepSpeedCheckpointError(f"{path}: written big-endian; only little-endian "
                                           f"files are read")
        try:
            data = zf.read(pkl[0])
        except Exception as e:  # noqa: BLE001  (a damaged record: zlib, CRC, EOF, ...)
            raise DeepSpeedCheckpointError(f"{path}: damaged ({_first_line(e)}): copy it "
                                           f"again from where the run saved it") from None
        file_size = path.stat().st_size
        storages: dict[str, tuple[Any, int, torch.dtype]] = {}
        by_cdata: dict[int, tuple[int, torch.dtype, str]] = {}

        def persistent_load(saved_id: Any) -> Any:
            typename, storage_type, key, _location, numel = saved_id
            if torch.serialization._maybe_decode_ascii(typename) != "storage":
                raise pickle_error(f"unknown persistent id {typename!r}")
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            key = torch.serialization._maybe_decode_ascii(key)
            if key not in storages:
                record = f"{prefix}data/{key}"
                try:
                    info = zf.getinfo(record)
                except KeyError:
                    raise DeepSpeedCheckpointError(f"{path}: tensor record {record} is "
                                                   f"missing: truncated or damaged") from None
                nbytes = numel * dtype.itemsize
                if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
                    raise DeepSpeedCheckpointError(f"{path}: tensor record {record} holds "
                                                   f"{info.file_size} bytes, {nbytes} expected")
                # The data start after the record's local header (30 bytes, name, extra).
                zf.fp.seek(info.header_offset)
                head = zf.fp.read(30)
                if len(head) != 30:
                    raise DeepSpeedCheckpointError(f"{path}: truncated (record {record})")
                start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") \
                    + int.from_bytes(head[28:30], "little")
                if start + nbytes > file_size:
                    raise DeepSpeedCheckpointError(f"{path}: truncated: record {record} ends "
                                                   f"past the end of the file")
                untyped = torch.UntypedStorage(nbytes, device="meta")
                typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype,
                                                   _internal=True)
                storages[key] = (typed, start, dtype)
                by_cdata[untyped._cdata] = (start, dtype, record)
            return storages[key][0]

        def pickle_error(msg: str) -> Exception:
            return wou.UnpicklingError(msg)

        unpickler = wou.Unpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        try:
            with torch.serialization.safe_globals(list(STAND_INS)):
                obj = unpickler.load()
        except DeepSpeedCheckpointError:
            raise
        except Exception as e:  # the unpickler's refusal, or a damaged pickle
            raise _refusal(path, e) from None

    def ref(t: torch.Tensor) -> TensorRef:
        try:
            found = by_cdata.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # a sparse or other storage-less layout
            found = None
        if found is None:
            raise DeepSpeedCheckpointError(f"{path}: holds a tensor that is not a plain one "
                                           f"of its own records ({t.layout}): not a DeepSpeed "
                                           f"checkpoint file")
        start, dtype, record = found
        if t.dtype != dtype or (t.numel() > 1 and not t.is_contiguous()):
            raise DeepSpeedCheckpointError(f"{path}: a tensor of record {record} is not a "
                                           f"contiguous {dtype} view")
        if (t.storage_offset() + t.numel()) * dtype.itemsize > t.untyped_storage().nbytes():
            raise DeepSpeedCheckpointError(f"{path}: a tensor runs past its record {record}")
        return TensorRef(path, start + t.storage_offset() * dtype.itemsize, dtype,
                         tuple(t.shape))

    def walk(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise DeepSpeedCheckpointError(
                f"{path}: refused: its contents nest more than {MAX_DEPTH} levels deep (or hold "
                f"themselves); DeepSpeed's files nest a few: was this file made or changed by "
                f"something else?")
        if isinstance(x, torch.Tensor):
            return ref(x)
        if isinstance(x, dict):
            items = ((k, walk(v, depth + 1)) for k, v in x.items())
            return dict(items) if type(x) is dict else type(x)(items)
        if isinstance(x, list):
            return [walk(v, depth + 1) for v in x]
        if isinstance(x, tuple) and not isinstance(x, torch.Size):
            return tuple(walk(v, depth + 1) for v in x)
        if isinstance(x, DeepSpeedRecord):
            x.state = walk(x.state, depth + 1)
        return x

    return Unpickled(walk(obj, 0), prefix[:-1])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
