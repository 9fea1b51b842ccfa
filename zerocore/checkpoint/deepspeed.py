"""A DeepSpeed ZeRO-3 checkpoint, read without DeepSpeed: ``export`` writes it as safetensors
under the model's own parameter names (the command ``python -m zerocore.from_deepspeed``), and
``load_deepspeed_checkpoint`` resumes such a run on a zerocore-sharded model.

A DeepSpeed checkpoint directory holds ``latest`` (the tag of the newest save) and one directory
per tag, ``global_stepN/``, in which each data-parallel rank r wrote
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (parameter names and shapes, frozen parameters'
partitions, buffers, the DeepSpeed config, step counters) and ``[bf16_]zero_pp_rank_<r>_
mp_rank_00_optim_states.pt`` (its partition of every fp32 master parameter and of Adam's two
moments, each a flat tensor per parameter group, the optimizer's step and hyper-parameters, the
loss-scaler state). In ZeRO-3 each parameter is split into ``ceil(numel / N)``-element pieces,
one per rank (the last padded), laid end to end in each rank's flat tensor in parameter order.

Reading is safe and streaming:
- The files are pickles. They are read by torch's weights-only unpickler with an allowlist:
  DeepSpeed's own classes that appear in them (``ZeroStageEnum``, its loss scalers) are mapped
  to inert records defined here, so nothing in a file can run code; any other class is refused
  in one line naming the file and the class.
- Tensors are not loaded with the pickle: each is a reference (file, byte offset, dtype,
  shape) into the file's uncompressed zip record, and only the bytes of the tensor being written
  are read (``os.pread``-style), so host memory stays near the largest tensor, whatever the
  model's size.
- Everything is checked before anything is written (files present for every rank, world size,
  stage, DeepSpeed version, every flat tensor's size against the parameter shapes, records
  inside their files); each failure is one ``DeepSpeedCheckpointError`` line (a ``ValueError``)
  saying what is wrong and what to do. Output is written into a temporary directory renamed
  to OUT at the end.

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

ZeRO stage 1/2 checkpoints, tensor- or pipeline-parallel ones (``mp_rank_01``...) and
DeepSpeed versions before 0.10 are refused, saying so.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import struct
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from zerocore.checkpoint.agreed import agreed, sharded_of
from zerocore.checkpoint.errors import DeepSpeedCheckpointError
from zerocore.checkpoint.durable_io import fsync_dir, make_dir, rename, write_file

__all__ = ["DeepSpeedCheckpoint", "DeepSpeedCheckpointError", "export",
           "load_deepspeed_checkpoint", "is_deepspeed_checkpoint", "peft_name", "adapter_names",
           "MODEL_FILE", "TRAINABLE_FILE", "ADAPTER_FILE", "ADAPTER_CONFIG"]

MODEL_FILE = "model.safetensors"
TRAINABLE_FILE = "trainable.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The oldest DeepSpeed whose ZeRO-3 files this reader knows (param_shapes, frozen_param_shapes
# and frozen_param_fragments in the model states); tested with 0.19.8.
OLDEST_VERSION = (0, 10)


# -- safe reading ------------------------------------------------------------------------------

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
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return DeepSpeedCheckpointError(f"{path}: refused, not a safe DeepSpeed checkpoint file: "
                                    f"{first}")


def read_pickle(path: Path) -> Any:
    """The object a torch file holds, unpickled by torch's weights-only unpickler with
    ``STAND_INS`` allowed, every tensor replaced by a ``TensorRef`` (no tensor data read)."""
    from torch import _weights_only_unpickler as wou

    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise DeepSpeedCheckpointError(f"{path}: missing") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise DeepSpeedCheckpointError(f"{path}: not a complete torch file ({e}): truncated "
                                       f"or damaged; copy it again from where the run saved "
                                       f"it") from None
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
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise DeepSpeedCheckpointError(f"{path}: damaged ({e})") from None
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
        start, dtype, record = by_cdata[t.untyped_storage()._cdata]
        if t.dtype != dtype or (t.numel() > 1 and not t.is_contiguous()):
            raise DeepSpeedCheckpointError(f"{path}: a tensor of record {record} is not a "
                                           f"contiguous {dtype} view")
        if (t.storage_offset() + t.numel()) * dtype.itemsize > t.untyped_storage().nbytes():
            raise DeepSpeedCheckpointError(f"{path}: a tensor runs past its record {record}")
        return TensorRef(path, start + t.storage_offset() * dtype.itemsize, dtype,
                         tuple(t.shape))

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ref(x)
        if isinstance(x, dict):
            return type(x)((k, walk(v)) for k, v in x.items()) if type(x) is not dict else \
                {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and not isinstance(x, torch.Size):
            return tuple(walk(v) for v in x)
        if isinstance(x, DeepSpeedRecord):
            x.state = walk(x.state)
        return x

    return walk(obj)


# -- the checkpoint -------------------------------------------------------------------------------

MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclasses.dataclass(frozen=True)
class TrainableParam:
    """Where a trained parameter's pieces are: in flat group ``group`` of every rank, elements
    ``[offset, offset + piece)`` (the last rank's piece padded)."""

    name: str
    shape: tuple[int, ...]
    group: int
    offset: int
    piece: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _version(text: Any) -> tuple[int, ...] | None:
    m = re.match(r"^(\d+)\.(\d+)", str(text)) if text is not None else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _tensor_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, TensorRef) for t in x)


class DeepSpeedCheckpoint:
    """One saved tag of a DeepSpeed ZeRO-3 run, opened and checked (no tensor data read yet).

    ``DeepSpeedCheckpoint(path, tag=None)``: ``path`` is the directory DeepSpeed saved into
    (holding ``latest``; ``tag`` overrides it) or a tag directory itself. Attributes:
    ``tag_dir``, ``world_size``, ``ds_version``, ``dtype16`` (the run's 16-bit dtype, None for
    fp32), ``trainable`` (name -> TrainableParam, in DeepSpeed's order), ``frozen`` (name ->
    shape), ``buffers`` (name -> TensorRef), ``shared`` (alias -> name), ``steps`` (Adam's step
    per flat group), ``param_groups`` (their hyper-parameters), ``loss_scaler`` (the scaler's
    state, a dict), ``global_steps``, ``global_samples``.
    """

    def __init__(self, path: str | Path, tag: str | None = None):
        self.root = Path(path)
        self.tag_dir = self._tag_dir(tag)
        model_files = self._rank_files(MODEL_FILE_RE, "model_states")
        optim_files = self._rank_files(OPTIM_FILE_RE, "optim_states")
        n = len(optim_files)
        if len(model_files) != n:
            # Each list is ranks 0.. without a gap (_rank_files): the shorter one lacks the
            # file of the rank after its last.
            rank = min(len(model_files), n)
            missing = (optim_files[0].name.split("zero_pp_rank_")[0] +
                       f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" if n == rank else
                       f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
            raise DeepSpeedCheckpointError(
                f"{self.tag_dir / missing}: missing ({len(model_files)} model-state files and "
                f"{n} optimizer-state files here); copy the whole directory again")
        self.world_size = n
        self.model_states = [self._model_states(p) for p in model_files]
        self.optim_states = [self._optim_states(p) for p in optim_files]
        self._check_ranks(model_files, optim_files)
        first = self.model_states[0]
        self.ds_version = str(first.get("ds_version"))
        config = first.get("ds_config") or {}
        self.dtype16 = (torch.bfloat16 if _enabled(config, "bf16", "bfloat16") else
                        torch.float16 if _enabled(config, "fp16") else None)
        self.global_steps = first.get("global_steps")
        self.global_samples = first.get("global_samples")
        self.trainable = self._layout(model_files[0], optim_files)
        self.frozen = {k: tuple(v) for k, v in (first.get("frozen_param_shapes") or {}).items()}
        self._check_frozen(model_files)
        buffer_names = set(first.get("buffer_names") or [])
        module = first.get("module") or {}
        self.buffers = {k: v for k, v in module.items()
                        if k in buffer_names and isinstance(v, TensorRef)}
        self.shared = dict(first.get("shared_params") or {})
        opt0 = self.optim_states[0]
        inner = opt0["optimizer_state_dict"]
        self.param_groups = [{k: v for k, v in g.items() if k != "params"}
                             for g in inner["param_groups"]]
        self.steps = [_step(inner["state"][g]["step"]) if g in inner["state"] else 0
                      for g in range(len(self.param_groups))]
        scaler = opt0.get("loss_scaler")
        self.loss_scaler = (dict(scaler.state) if isinstance(scaler, DeepSpeedRecord)
                            and isinstance(scaler.state, dict) else None)
        self.dynamic_loss_scale = bool(opt0.get("dynamic_loss_scale", False))

    # -- opening ---------------------------------------------------------------------------------

    def _tag_dir(self, tag: str | None) -> Path:
        root = self.root
        if not root.is_dir():
            raise DeepSpeedCheckpointError(f"{root}: no such directory")
        if tag is None and any(OPTIM_FILE_RE.match(p.name) for p in root.iterdir()):
            return root  # a tag directory itself
        tags = sorted(p.name for p in root.iterdir() if p.is_dir())
        if tag is None:
            latest = root / "latest"
            if not latest.is_file():
                raise DeepSpeedCheckpointError(
                    f"{root}: no 'latest' file saying which save to read; give --tag "
                    f"(directories here: {', '.join(tags) or 'none'})")
            tag = latest.read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise DeepSpeedCheckpointError(f"{root}: tag {tag!r} is not a directory name")
        if not (root / tag).is_dir():
            raise DeepSpeedCheckpointError(f"{root}: tag {tag!r} has no directory "
                                           f"{root / tag} (directories here: "
                                           f"{', '.join(tags) or 'none'})")
        return root / tag

    def _rank_files(self, pattern: re.Pattern, what: str) -> list[Path]:
        found: dict[int, Path] = {}
        for p in sorted(self.tag_dir.iterdir()):
            m = pattern.match(p.name)
            if not m:
                if p.name.endswith(f"_{what}.pt") and what == "model_states" \
                        and p.name.startswith("mp_rank_"):
                    raise DeepSpeedCheckpointError(
                        f"{p}: a ZeRO stage 1/2 checkpoint (one model-state file for all "
                        f"ranks): only ZeRO stage 3 checkpoints are supported")
                continue
            if m.group(2) != "00":
                raise DeepSpeedCheckpointError(
                    f"{p}: a tensor- or pipeline-parallel checkpoint (mp_rank "
                    f"{m.group(2)}): only data-parallel ZeRO-3 checkpoints are supported")
            rank = int(m.group(1))
            if rank in found:
                raise DeepSpeedCheckpointError(f"{self.tag_dir}: two {what} files for rank "
                                               f"{rank}: {found[rank].name} and {p.name}")
            found[rank] = p
        if not found:
            raise DeepSpeedCheckpointError(
                f"{self.tag_dir}: no *_{what}.pt files: not a DeepSpeed ZeRO checkpoint "
                f"directory")
        missing = [r for r in range(max(found) + 1) if r not in found]
        if missing:
            raise DeepSpeedCheckpointError(
                f"{self.tag_dir}: the {what} file of rank {missing[0]} is missing (found "
                f"ranks {sorted(found)}); copy the whole directory again")
        return [found[r] for r in range(len(found))]

    def _model_states(self, path: Path) -> dict[str, Any]:
        sd = read_pickle(path)
        if not isinstance(sd, dict) or "param_shapes" not in sd or "module" not in sd:
            raise DeepSpeedCheckpointError(f"{path}: not a DeepSpeed model-state file (no "
                                           f"param_shapes)")
        version = _version(sd.get("ds_version"))
        if version is None or version < OLDEST_VERSION or version[0] != 0:
            raise DeepSpeedCheckpointError(
                f"{path}: written by DeepSpeed {sd.get('ds_version')}; this reader knows the "
                f"ZeRO-3 files of DeepSpeed 0.10 to 0.x (tested with 0.19.8)")
        return sd

    def _optim_states(self, path: Path) -> dict[str, Any]:
        sd = read_pickle(path)
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise DeepSpeedCheckpointError(f"{path}: not a DeepSpeed ZeRO optimizer-state file "
                                           f"(no zero_stage)")
        stage = int(osd["zero_stage"])
        if stage != 3:
            raise DeepSpeedCheckpointError(
                f"{path}: ZeRO stage {stage}: only ZeRO stage 3 checkpoints are supported")
        for key in ("fp32_flat_groups", "optimizer_state_dict", "partition_count"):
            if key not in osd:
                raise DeepSpeedCheckpointError(f"{path}: optimizer_state_dict has no {key!r}")
        inner = osd["optimizer_state_dict"]
        if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
            raise DeepSpeedCheckpointError(f"{path}: the inner optimizer state has no "
                                           f"state/param_groups")
        if not _tensor_list(osd["fp32_flat_groups"]):
            raise DeepSpeedCheckpointError(f"{path}: fp32_flat_groups is not a list of "
                                           f"tensors")
        return osd

    def _check_ranks(self, model_files: list[Path], optim_files: list[Path]) -> None:
        n = self.world_size
        for path, sd in zip(model_files, self.model_states):
            if sd.get("dp_world_size", n) != n:
                raise DeepSpeedCheckpointError(
                    f"{path}: written by a run of {sd.get('dp_world_size')} data-parallel "
                    f"ranks, but {n} ranks' files are here: files of two saves are mixed, or "
                    f"some are missing")
            for key in ("global_steps", "param_shapes", "frozen_param_shapes", "ds_version"):
                if sd.get(key) != self.model_states[0].get(key):
                    raise DeepSpeedCheckpointError(
                        f"{path}: its {key} differs from rank 0's ({model_files[0].name}): "
                        f"files of two different saves are mixed; copy the directory again")
        for path, osd in zip(optim_files, self.optim_states):
            count = osd["partition_count"]
            count = max(count) if isinstance(count, (list, tuple)) else count
            if count != n:
                raise DeepSpeedCheckpointError(
                    f"{path}: partitioned over {count} ranks, but {n} ranks' files are here: "
                    f"the files of rank(s) {list(range(n, count)) or '?'} are missing or files "
                    f"of another save are mixed in")
            steps = [_step(s.get("step", 0))
                     for s in osd["optimizer_state_dict"]["state"].values()]
            steps0 = [_step(s.get("step", 0)) for s in
                      self.optim_states[0]["optimizer_state_dict"]["state"].values()]
            if steps != steps0:
                raise DeepSpeedCheckpointError(
                    f"{path}: Adam's step {steps} differs from rank 0's {steps0}: files of two "
                    f"saves are mixed; copy the directory again")

    def _layout(self, model_file: Path, optim_files: list[Path]) -> dict[str, TrainableParam]:
        n = self.world_size
        shapes = self.model_states[0]["param_shapes"]
        groups = self.optim_states[0]["fp32_flat_groups"]
        if len(shapes) != len(groups):
            raise DeepSpeedCheckpointError(
                f"{model_file}: {len(shapes)} parameter groups, but {optim_files[0].name} "
                f"holds {len(groups)} flat groups: the files do not belong together")
        out: dict[str, TrainableParam] = {}
        for g, named in enumerate(shapes):
            offset = 0
            for name, shape in named.items():
                numel = math.prod(shape)
                piece = math.ceil(numel / n)
                out[name] = TrainableParam(name, tuple(shape), g, offset, piece)
                offset += piece
            for path, osd in zip(optim_files, self.optim_states):
                flat = osd["fp32_flat_groups"]
                state = osd["optimizer_state_dict"]["state"].get(g, {})
                tensors = {"fp32_flat_groups": flat[g] if g < len(flat) else None,
                           "exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq")}
                for what, t in tensors.items():
                    if not isinstance(t, TensorRef):
                        raise DeepSpeedCheckpointError(
                            f"{path}: group {g} has no {what} tensor (optimizer "
                            f"{self.model_states[0].get('ds_config', {}).get('optimizer')}): "
                            f"only Adam/AdamW checkpoints are supported")
                    if t.numel != offset or t.dtype != torch.float32:
                        raise DeepSpeedCheckpointError(
                            f"{path}: {what}[{g}] holds {t.numel} {t.dtype} elements, but its "
                            f"{len(named)} parameters take {offset} fp32 elements per rank over "
                            f"{n} ranks: the file does not match the parameter shapes or the "
                            f"world size")
        return out

    def _check_frozen(self, model_files: list[Path]) -> None:
        n = self.world_size
        for path, sd in zip(model_files, self.model_states):
            frags = sd.get("frozen_param_fragments") or {}
            for name, shape in self.frozen.items():
                t = frags.get(name)
                piece = math.ceil(math.prod(shape) / n)
                if not isinstance(t, TensorRef) or t.numel != piece:
                    got = "none" if not isinstance(t, TensorRef) else f"{t.numel} elements"
                    raise DeepSpeedCheckpointError(
                        f"{path}: frozen parameter {name!r} {tuple(shape)}: fragment of "
                        f"{piece} elements expected over {n} ranks, {got} found")

    # -- values ----------------------------------------------------------------------------------

    def names(self, *, trainable_only: bool = False) -> list[str]:
        """What zero_to_fp32 writes, in its order: buffers, frozen parameters, trained ones,
        shared aliases (``trainable_only``: the trained ones alone)."""
        if trainable_only:
            return list(self.trainable)
        names = list(self.buffers) + list(self.frozen) + list(self.trainable)
        return names + [a for a, src in self.shared.items() if src in names and a not in names]

    def shape(self, name: str) -> tuple[int, ...]:
        name = self.shared.get(name, name) if name not in self._own() else name
        if name in self.trainable:
            return self.trainable[name].shape
        if name in self.frozen:
            return self.frozen[name]
        return self.buffers[name].shape

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype of what the checkpoint holds for ``name`` (fp32 for trained ones)."""
        name = self.shared.get(name, name) if name not in self._own() else name
        if name in self.trainable:
            return torch.float32
        if name in self.frozen:
            return self.model_states[0]["frozen_param_fragments"][name].dtype
        return self.buffers[name].dtype

    def _own(self) -> set[str]:
        return set(self.trainable) | set(self.frozen) | set(self.buffers)

    def read(self, name: str, what: str = "fp32") -> torch.Tensor:
        """The full tensor ``name``: for a trained parameter its fp32 master (``what`` =
        "fp32") or Adam moment ("exp_avg", "exp_avg_sq"), assembled from every rank's piece;
        a frozen parameter or buffer as stored."""
        if name not in self._own() and name in self.shared:
            name = self.shared[name]
        n = self.world_size
        if name in self.trainable:
            p = self.trainable[name]
            out = torch.empty(p.numel, dtype=torch.float32)
            for r in range(n):
                lo = r * p.piece
                count = min(p.piece, p.numel - lo)
                if count <= 0:
                    break
                self._flat(r, p.group, what).read(p.offset, count, out=out[lo:lo + count])
            return out.view(p.shape)
        if name in self.frozen:
            shape = self.frozen[name]
            numel = math.prod(shape)
            piece = math.ceil(numel / n)
            frag0 = self.model_states[0]["frozen_param_fragments"][name]
            out = torch.empty(numel, dtype=frag0.dtype)
            for r in range(n):
                lo = r * piece
                count = min(piece, numel - lo)
                if count <= 0:
                    break
                self.model_states[r]["frozen_param_fragments"][name].read(
                    0, count, out=out[lo:lo + count])
            return out.view(shape)
        if name in self.buffers:
            return self.buffers[name].read().view(self.buffers[name].shape)
        raise KeyError(name)

    def _flat(self, rank: int, group: int, what: str) -> TensorRef:
        osd = self.optim_states[rank]
        if what == "fp32":
            return osd["fp32_flat_groups"][group]
        return osd["optimizer_state_dict"]["state"][group][what]


def _enabled(config: dict[str, Any], *keys: str) -> bool:
    return any(isinstance(config.get(k), dict) and bool(config[k].get("enabled")) for k in keys)


def _step(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint directory (a ``latest`` file and no
    zerocore manifest, or a tag directory of rank files): what ``zerocore.load_checkpoint``
    hands to ``load_deepspeed_checkpoint``."""
    path = Path(path)
    if not path.is_dir() or (path / "manifest.json").exists():
        return False
    if (path / "latest").is_file():
        return True
    return any(OPTIM_FILE_RE.match(p.name) for p in path.iterdir())


# -- writing safetensors, tensor by tensor ------------------------------------------------------

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


# -- export ---------------------------------------------------------------------------------------

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


# -- resuming on zerocore ---------------------------------------------------------------------

def load_deepspeed_checkpoint(path: str | Path, model: Any, optimizer: torch.optim.Optimizer,
                              *, scaler: Any = None, tag: str | None = None,
                              ds_name: Callable[[int, str], str] | None = None,
                              frozen: str = "load") -> dict[str, Any]:
    """Collective: resumes a DeepSpeed ZeRO-3 run on a zerocore model sharded over any number
    of ranks: fp32 master weights, Adam's moments and step, the optimizer's hyper-parameters
    (lr, betas, eps, weight_decay), the loss-scaler state and the frozen weights the checkpoint
    holds. Returns ``{"deepspeed": {...}}``: the run's tag, global_steps, global_samples and
    DeepSpeed version (the data position is the caller's: DeepSpeed does not save it).

    model: a ``zerocore.shard_model`` model (its parameter names are the model's, as DeepSpeed
        saved them) or a ``zerocore.shard`` model (layer i's parameter ``name`` is DeepSpeed's
        ``f"{i}.{name}"``, the names of an ``nn.Sequential`` of the layers); ``ds_name(i, name)``
        overrides the mapping. Every trained parameter of the model must be one of the
        checkpoint's trained parameters with the same shape, and the reverse.
    frozen: "load" takes the frozen weights the checkpoint holds; "check" keeps the model's
        and refuses the checkpoint unless they are its frozen weights (cast to the model's
        dtype; an int8-quantized frozen group cannot be compared and is not checked): for an
        application whose base weights come from elsewhere, and must be the run's.
    Every rank reads the pieces it needs from the DeepSpeed files (no rank gathers the
    model). Everything is checked before anything is changed; a failure on any rank raises
    ``DeepSpeedCheckpointError`` (one line) on every rank."""
    if frozen not in ("load", "check"):
        raise ValueError(f"frozen must be 'load' or 'check', got {frozen!r}")
    sharded = sharded_of(model)
    if ds_name is None:
        ds_name = sharded.param_name  # the unsharded model's names, as DeepSpeed saved them
    rank = sharded.rank

    def verify() -> DeepSpeedCheckpoint:
        ckpt = DeepSpeedCheckpoint(path, tag)
        where = ckpt.tag_dir
        mine: dict[str, tuple[int, ...]] = {}
        frozen_mine: dict[str, tuple[int, ...]] = {}
        for layer in sharded.layers:
            for group, names in ((layer.trainable, mine), (layer.frozen, frozen_mine)):
                if group is not None:
                    for slot in group.layout.slots:
                        names[ds_name(layer.index, slot.name)] = tuple(slot.shape)
        theirs = {n: p.shape for n, p in ckpt.trainable.items()}
        if set(mine) != set(theirs):
            only_model = sorted(set(mine) - set(theirs))
            only_ckpt = sorted(set(theirs) - set(mine))
            raise DeepSpeedCheckpointError(
                f"{where}: the model's trained parameters are not the checkpoint's: "
                f"{len(only_model)} only in the model {only_model[:3]}, {len(only_ckpt)} only "
                f"in the checkpoint {only_ckpt[:3]}; shard the model the run trained, with the "
                f"same parameters requiring grad")
        for n, shape in mine.items():
            if shape != theirs[n]:
                raise DeepSpeedCheckpointError(f"{where}: parameter {n!r} has shape {shape} in "
                                               f"the model, {theirs[n]} in the checkpoint")
        for n, shape in frozen_mine.items():
            if n in ckpt.frozen and ckpt.frozen[n] != shape:
                raise DeepSpeedCheckpointError(f"{where}: frozen parameter {n!r} has shape "
                                               f"{shape} in the model, {ckpt.frozen[n]} in the "
                                               f"checkpoint")
        steps = set(ckpt.steps)
        if len(steps) > 1:
            raise DeepSpeedCheckpointError(f"{where}: its parameter groups are at different "
                                           f"Adam steps {ckpt.steps}; zerocore keeps one")
        hyper = [{k: g.get(k) for k in ("lr", "betas", "eps", "weight_decay")}
                 for g in ckpt.param_groups]
        if any(h != hyper[0] for h in hyper):
            raise DeepSpeedCheckpointError(
                f"{where}: its {len(hyper)} parameter groups have different hyper-parameters "
                f"({hyper}); zerocore's optimizer steps every shard with one group's")
        if any(g.get("bias_correction", True) is False for g in ckpt.param_groups) or \
                any(g.get("amsgrad") for g in ckpt.param_groups):
            raise DeepSpeedCheckpointError(f"{where}: Adam without bias correction or with "
                                           f"amsgrad: zerocore's Adam has neither")
        if frozen == "check":
            _check_frozen_weights(ckpt, sharded, rank, ds_name)
        if scaler is not None and ckpt.loss_scaler is not None and \
                bool(ckpt.dynamic_loss_scale) != bool(scaler.dynamic):
            raise DeepSpeedCheckpointError(
                f"{where}: the run's loss scale was "
                f"{'dynamic' if ckpt.dynamic_loss_scale else 'static'}"
                f", the scaler given is {'dynamic' if scaler.dynamic else 'static'}: "
                f"make them agree")
        return ckpt

    ckpt = agreed(verify, sharded.group)

    def restore() -> None:
        sharded.release_gathered()
        step = float(ckpt.steps[0]) if ckpt.steps else 0.0
        with torch.no_grad():
            for layer in sharded.layers:
                if layer.trainable is not None:
                    layout = layer.trainable.layout
                    shard = layer.trainable.shard
                    values = {what: _shard_of(ckpt, layout, rank, layer.index, ds_name, what)
                              for what in ("fp32", "exp_avg", "exp_avg_sq")}
                    shard.copy_(values["fp32"])
                    state = optimizer.state.setdefault(shard, {})
                    for key in ("exp_avg", "exp_avg_sq"):
                        v = values[key].to(shard.device)
                        if key in state:
                            state[key].copy_(v)
                        else:
                            state[key] = v
                    if "step" in state and isinstance(state["step"], torch.Tensor):
                        state["step"].fill_(step)
                    else:
                        state["step"] = torch.tensor(step)
                if frozen == "load" and layer.frozen is not None and all(
                        ds_name(layer.index, s.name) in ckpt.frozen
                        for s in layer.frozen.layout.slots):
                    layout = layer.frozen.layout
                    layer.frozen.load_frozen(_shard_of(ckpt, layout, rank, layer.index, ds_name,
                                                       "fp32", dtype=layer.frozen.shard.dtype))
        saved = ckpt.param_groups[0] if ckpt.param_groups else {}
        for group in optimizer.param_groups:
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in saved and key in group:
                    group[key] = tuple(saved[key]) if key == "betas" else saved[key]
        if scaler is not None and ckpt.loss_scaler is not None:
            scaler.load_state_dict(_scaler_state(ckpt.loss_scaler, scaler))

    agreed(restore, sharded.group)
    return {"deepspeed": {"tag": ckpt.tag_dir.name, "global_steps": ckpt.global_steps,
                          "global_samples": ckpt.global_samples,
                          "ds_version": ckpt.ds_version, "world_size": ckpt.world_size}}


def _shard_of(ckpt: DeepSpeedCheckpoint, layout: Any, rank: int, index: int,
              ds_name: Callable[[int, str], str], what: str,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's ``[shard_numel]`` slice of a flat group, filled from the checkpoint's
    full tensors (one parameter at a time; padding zero)."""
    lo, hi = layout.shard_range(rank)
    out = torch.zeros(hi - lo, dtype=dtype)
    for slot in layout.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            continue
        full = ckpt.read(ds_name(index, slot.name), what).reshape(-1)
        out[a - lo:b - lo] = full[a - slot.offset:b - slot.offset].to(dtype)
    return out


def _check_frozen_weights(ckpt: DeepSpeedCheckpoint, sharded: Any, rank: int,
                          ds_name: Callable[[int, str], str]) -> None:
    """Refuses the checkpoint unless this rank's shard of every frozen group equals the
    checkpoint's frozen weights there, compared in the narrower of the two dtypes (a bf16 run
    holds the fp32 base rounded; a bf16 model holds it rounded too)."""
    for layer in sharded.layers:
        group = layer.frozen
        if group is None or not group.shard.dtype.is_floating_point:
            continue  # none, or int8-quantized: nothing to compare the run's values with
        slots = group.layout.slots
        if not all(ds_name(layer.index, s.name) in ckpt.frozen for s in slots):
            continue  # as "load": the checkpoint holds no copy of this layer's frozen weights
        held = group.shard.detach().cpu().reshape(-1)
        lo, hi = group.layout.shard_range(rank)
        for slot in slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a >= b:
                continue
            name = ds_name(layer.index, slot.name)
            theirs = ckpt.read(name).reshape(-1)[a - slot.offset:b - slot.offset]
            mine = held[a - lo:b - lo]
            common = theirs.dtype if theirs.dtype.itemsize <= mine.dtype.itemsize else mine.dtype
            if not torch.equal(mine.to(common), theirs.to(common)):
                raise DeepSpeedCheckpointError(
                    f"{ckpt.tag_dir}: frozen parameter {name!r} differs from the model's: the "
                    f"base weights given are not the ones the DeepSpeed run trained on")


def _scaler_state(ds: dict[str, Any], scaler: Any) -> dict[str, Any]:
    """zerocore's loss-scaler state from DeepSpeed's: the current scale, the hysteresis left
    and the overflow-free steps since the last change (DeepSpeed counts iterations since the
    last overflow)."""
    mine = scaler.state_dict()
    mine["loss_scale"] = float(ds.get("cur_scale", mine["loss_scale"]))
    if "cur_hysteresis" in ds:
        mine["hysteresis_left"] = int(ds["cur_hysteresis"])
    if "cur_iter" in ds and "last_overflow_iter" in ds and ds.get("scale_window"):
        mine["good_steps"] = int(ds["cur_iter"] - ds["last_overflow_iter"] - 1) \
            % int(ds["scale_window"])
    return mine


# -- command line ---------------------------------------------------------------------------------
