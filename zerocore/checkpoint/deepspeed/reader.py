"""One saved tag of a DeepSpeed ZeRO-3 run, opened and checked without reading tensor data:
``DeepSpeedCheckpoint`` (the rank files, their layout, the optimizer's flat groups), and
``is_deepspeed_checkpoint``.

A tag directory holds, for each data-parallel rank r, ``zero_pp_rank_<r>_mp_rank_00_model_
states.pt`` (parameter names and shapes, frozen parameters' partitions, buffers, the DeepSpeed
config, step counters) and ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (its partition
of every fp32 master parameter and of Adam's two moments, each a flat tensor per parameter group,
the optimizer's step and hyper-parameters, the loss-scaler state). In ZeRO-3 each parameter is
split into ``ceil(numel / N)``-element pieces, one per rank (the last padded), laid end to end in
each rank's flat tensor in parameter order."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch

from zerocore.checkpoint.deepspeed.rank_files import (MODEL_FILE_RE, OPTIM_FILE_RE,
                                                      check_model_states, check_optim_states,
                                                      check_saved_as, step_value)
from zerocore.checkpoint.deepspeed.unpickler import DeepSpeedRecord, TensorRef, read_pickle
from zerocore.checkpoint.errors import DeepSpeedCheckpointError

__all__ = ["DeepSpeedCheckpoint", "TrainableParam", "is_deepspeed_checkpoint", "MODEL_FILE_RE",
           "OPTIM_FILE_RE", "OLDEST_VERSION"]

# The oldest DeepSpeed whose ZeRO-3 files this reader knows (param_shapes, frozen_param_shapes
# and frozen_param_fragments in the model states); tested with 0.19.8.
OLDEST_VERSION = (0, 10)


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
        for alias, source in self.shared.items():
            if source not in self._own():
                raise DeepSpeedCheckpointError(
                    f"{model_files[0]}: shared_params makes {alias!r} an alias of {source!r}, "
                    f"which is no parameter or buffer of the checkpoint: the file was made or "
                    f"changed by something else")
        opt0 = self.optim_states[0]
        inner = opt0["optimizer_state_dict"]
        self.param_groups = [{k: v for k, v in g.items() if k != "params"}
                             for g in inner["param_groups"]]
        self.steps = [step_value(inner["state"][g].get("step", 0)) if g in inner["state"]
                      else 0 for g in range(len(self.param_groups))]
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
        bf16 = {r for r, p in found.items() if p.name.startswith("bf16_")}
        if bf16 and len(bf16) != len(found):  # DeepSpeed names every rank's alike
            plain = sorted(set(found) - bf16)
            raise DeepSpeedCheckpointError(
                f"{found[plain[0]]}: a plain optimizer-state file among bf16_ ones (of ranks "
                f"{sorted(bf16)}): files of a bf16 run and of another are mixed; copy the "
                f"directory again")
        missing = [r for r in range(max(found) + 1) if r not in found]
        if missing:
            raise DeepSpeedCheckpointError(
                f"{self.tag_dir}: the {what} file of rank {missing[0]} is missing (found "
                f"ranks {sorted(found)}); copy the whole directory again")
        return [found[r] for r in range(len(found))]

    def _model_states(self, path: Path) -> dict[str, Any]:
        file = read_pickle(path)
        check_saved_as(path, file.saved_as)
        sd = file.value
        check_model_states(path, sd)
        version = _version(sd.get("ds_version"))
        if version is None or version < OLDEST_VERSION or version[0] != 0:
            raise DeepSpeedCheckpointError(
                f"{path}: written by DeepSpeed {sd.get('ds_version')}; this reader knows the "
                f"ZeRO-3 files of DeepSpeed 0.10 to 0.x (tested with 0.19.8)")
        return sd

    def _optim_states(self, path: Path) -> dict[str, Any]:
        file = read_pickle(path)
        check_saved_as(path, file.saved_as)
        return check_optim_states(path, file.value)

    def _check_ranks(self, model_files: list[Path], optim_files: list[Path]) -> None:
        n = self.world_size
        for path, sd in zip(model_files, self.model_states):
            if sd.get("dp_world_size", n) != n:
                raise DeepSpeedCheckpointError(
                    f"{path}: written by a run of {sd.get('dp_world_size')} data-parallel "
                    f"ranks, but {n} ranks' files are here: files of two saves are mixed, or "
                    f"some are missing")
            # (ds_config: a bf16 run's file among an fp32 run's has all the same shapes)
            for key in ("global_steps", "param_shapes", "frozen_param_shapes", "ds_version",
                        "ds_config"):
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
            steps = [step_value(s.get("step", 0))
                     for s in osd["optimizer_state_dict"]["state"].values()]
            steps0 = [step_value(s.get("step", 0)) for s in
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
        first = self.model_states[0].get("frozen_param_fragments") or {}
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
                if t.dtype != first[name].dtype:
                    raise DeepSpeedCheckpointError(
                        f"{path}: frozen parameter {name!r} is {t.dtype} here, "
                        f"{first[name].dtype} in rank 0's file: files of two runs (of "
                        f"different dtypes) are mixed; copy the directory again")

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
