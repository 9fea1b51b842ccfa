"""Sharded checkpoints: every rank writes its own shards, one manifest describes them all.

A checkpoint is a directory::

    step-00000100/
        rank-00000.pt ... rank-0000{N-1}.pt   each rank's trainable master shards, Adam moments,
                                              step counts, RNG states (and frozen shards if asked)
        manifest.json                         world size, every layer's flat layout, dtypes,
                                              optimizer hyper-parameters, loss-scaler state, the
                                              caller's extra state (data position...), and the
                                              SHA-256 and size of every rank file

Saving never gathers the model: each rank writes what it holds. It is atomic: everything is
written into ``step-XXXX.tmp-<nonce>/`` (files flushed and fsynced), the manifest last, and the
directory is renamed to its final name as the single commit point; a crash or kill at any moment
leaves earlier checkpoints intact and no half-written directory under a final name. Directories
are deleted (pruning, or replacing a step saved again) by first renaming them out of the
``step-XXXX`` namespace, so a kill during a deletion never leaves a partial checkpoint under a
final name either. The last ``keep_last`` checkpoints are kept; leftovers of killed saves are
removed by the next save (one run writes to a root at a time).

Because the manifest carries the layout, a checkpoint written by N ranks loads into M ranks: the
parameter offsets inside a flat group do not depend on the world size (only the tail padding
does), so each new rank reads the byte ranges it needs from the old rank files (memory-mapped).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerocore.flat_layout import FlatLayout
from zerocore.loss_scale import LossScaler
from zerocore.sharded_param import ShardParameter
from zerocore.sharded_sequential import ShardedSequential

FORMAT = "zerocore-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Leftovers of a save that was killed (``step-X.tmp-<nonce>``) or of a deletion that was
# (``step-X.deleting-<nonce>``): never loaded, removed by the next save.
_LEFTOVER_DIR = re.compile(r"^step-\d+\.(tmp|deleting)-[0-9a-f]+$")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model: nothing was loaded."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _layouts(model: ShardedSequential) -> list[dict[str, Any]]:
    return [{"trainable": l.trainable.layout.to_dict() if l.trainable else None,
             "frozen": l.frozen.layout.to_dict() if l.frozen else None} for l in model.layers]


def model_fingerprint(layouts: list[dict[str, Any]]) -> str:
    """Names and shapes of every parameter of every layer, independent of the world size."""
    desc = json.dumps([[None if g is None else [s[:2] for s in g["slots"]]
                        for g in (l["trainable"], l["frozen"])] for l in layouts])
    return hashlib.sha256(desc.encode()).hexdigest()


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(Path(root))
    return found[-1] if found else None


def _remove_dir(path: Path) -> None:
    """Deletes a checkpoint directory without ever leaving a partial one under its name: it is
    renamed out of the ``step-XXXX`` namespace first (atomic), then deleted."""
    trash = path.with_name(f"{path.name}.deleting-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(root: str | Path, step: int, model: ShardedSequential,
                    optimizer: torch.optim.Optimizer, *, scaler: LossScaler | None = None,
                    extra: dict[str, Any] | None = None, keep_last: int = 3,
                    include_frozen: bool = False) -> Path:
    """Collective: every rank calls it. Writes ``root/step-<step>/`` and returns its path.

    extra: JSON-serialisable state of the caller (data sampler position, scheduler, config),
    stored in the manifest and returned by ``load_checkpoint``.
    """
    root = Path(root)
    group, rank, world = model.group, model.rank, model.world_size
    final = root / f"step-{step:08d}"
    # Everything the manifest stores is checked for JSON on every rank before anything is
    # written: a bad ``extra`` raises here on every rank instead of on rank 0 alone, after the
    # others went on to wait in a collective.
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        json.dumps([extra or {}, groups, scaler.state_dict() if scaler is not None else None])
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: extra state, optimizer hyper-parameters and "
                        f"loss-scaler state must be JSON-serialisable: {e}") from None
    # Rank 0 picks the temporary name and tells the others.
    names = [f"{final.name}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=0, group=group)
    tmp = root / names[0]
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    dist.barrier(group=group)

    layers: dict[int, dict[str, Any]] = {}
    for layer in model.layers:
        entry: dict[str, Any] = {}
        if layer.trainable is not None:
            shard = layer.trainable.shard
            entry["master"] = shard.detach().cpu()
            state = optimizer.state.get(shard, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    entry[key] = state[key].detach().cpu()
            entry["step"] = float(state["step"]) if "step" in state else 0.0
        if include_frozen and layer.frozen is not None:
            entry["frozen"] = layer.frozen.shard.detach().cpu()
        layers[layer.index] = entry
    path = tmp / rank_file(rank)
    # A rank that cannot write (disk full, permissions) must not leave the others waiting in
    # the next collective: the outcome is gathered, and every rank raises the same error.
    try:
        with open(path, "wb") as f:
            torch.save({"layers": layers, "rng": _rng_state(model.device)}, f)
            f.flush()
            os.fsync(f.fileno())
        info: dict[str, Any] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    except OSError as e:
        info = {"error": f"rank {rank}: cannot write {path}: {e}"}
    infos: list[Any] = [None] * world
    dist.all_gather_object(infos, info, group=group)
    failed = [i["error"] for i in infos if "error" in i]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=group)
        raise OSError(f"save_checkpoint: nothing was saved; {failed[0]}")

    if rank == 0:
        layouts = _layouts(model)
        manifest = {
            "format": FORMAT, "step": step, "world_size": world,
            "param_dtype": str(model.mixed_precision.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(model.mixed_precision.grad_reduce_dtype).removeprefix("torch."),
            "include_frozen": include_frozen,
            "model_fingerprint": model_fingerprint(layouts),
            "layers": layouts,
            "optimizer": {"class": type(optimizer).__name__, "param_groups": groups},
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "extra": extra or {},
            "files": {rank_file(r): infos[r] for r in range(world)},
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again: replace it
            _remove_dir(final)
        os.rename(tmp, final)  # the commit point
        _fsync_dir(root)
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            _remove_dir(old)
        for left in root.iterdir():
            if _LEFTOVER_DIR.match(left.name) and left != tmp:
                shutil.rmtree(left, ignore_errors=True)
    dist.barrier(group=group)
    return final


# -- loading -------------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, Any]:
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not mf.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; the checkpoint is incomplete (a save that "
                              f"did not finish leaves only a .tmp directory) — use an earlier one")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:  # ValueError: invalid JSON or UTF-8
        raise CheckpointError(f"{mf}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{mf}: format {found!r}, expected {FORMAT!r}")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], ranks: list[int] | None = None) -> None:
    """Checks presence, size and SHA-256 of the rank files (all, or the listed ranks)."""
    for r in ranks if ranks is not None else range(manifest["world_size"]):
        name = rank_file(r)
        f = Path(path) / name
        want = manifest["files"][name]
        if not f.is_file():
            raise CheckpointError(f"{f}: rank file missing (the checkpoint was written by "
                                  f"{manifest['world_size']} ranks)")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes, the manifest says {want['bytes']}: the "
                                  f"file is truncated or was replaced")
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch: the file is corrupt")


def _layer_difference(mine: dict[str, Any], saved: dict[str, Any]) -> str:
    """What differs between a layer's layouts in the model and in a manifest, in words."""
    for group in ("trainable", "frozen"):
        a, b = mine[group], saved[group]
        if (a is None) != (b is None):
            return (f"the model has {'no' if a is None else 'some'} {group} parameters, the "
                    f"checkpoint {'none' if b is None else 'some'}")
        if a is None:
            continue
        names_a = [s[0] for s in a["slots"]]
        names_b = [s[0] for s in b["slots"]]
        if names_a != names_b:
            return (f"{group} parameters {names_a} in the model, {names_b} in the checkpoint")
        for (name, shape_a, _), (_, shape_b, _) in zip(a["slots"], b["slots"]):
            if list(shape_a) != list(shape_b):
                return (f"parameter {name!r} has shape {tuple(shape_a)} in the model, "
                        f"{tuple(shape_b)} in the checkpoint")
    return "the parameters differ"


def _check_matches(path: Path, manifest: dict[str, Any], model: ShardedSequential,
                   optimizer: torch.optim.Optimizer) -> None:
    mf = path / MANIFEST
    mine = _layouts(model)
    if len(mine) != len(manifest["layers"]):
        raise CheckpointError(f"{mf}: the checkpoint has {len(manifest['layers'])} layers, the "
                              f"model has {len(mine)}: it was written for another model")
    if model_fingerprint(mine) != manifest["model_fingerprint"]:
        for i, (a, b) in enumerate(zip(mine, manifest["layers"])):
            if model_fingerprint([a]) != model_fingerprint([b]):
                raise CheckpointError(f"{mf}: layer {i} does not match the model: "
                                      f"{_layer_difference(a, b)}; the checkpoint was written "
                                      f"for another model or fine-tuning mode")
        raise CheckpointError(f"{mf}: the checkpoint was written for another model")
    saved_groups = manifest["optimizer"]["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{mf}: the checkpoint's optimizer has {len(saved_groups)} param "
                              f"groups, this one has {len(optimizer.param_groups)}")


class _ShardReader:
    """Reads ranges of a group's unsharded flat vector out of the old rank files (memory-mapped,
    so only the needed bytes are read)."""

    def __init__(self, path: Path, world_size: int):
        self.path, self.world_size = path, world_size
        self._files: dict[int, Any] = {}

    def rank_data(self, r: int) -> dict[str, Any]:
        if r not in self._files:
            self._files[r] = torch.load(self.path / rank_file(r), map_location="cpu", mmap=True,
                                        weights_only=True)
        return self._files[r]

    def read(self, layer: int, key: str, old: FlatLayout, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the unsharded flat vector stored under ``key``; elements past
        the old padded size (new padding) are zeros."""
        parts = []
        n_old = old.shard_numel
        pos = lo
        while pos < hi:
            r = pos // n_old if n_old else self.world_size
            if r >= self.world_size:
                parts.append(torch.zeros(hi - pos))
                break
            end = min(hi, (r + 1) * n_old)
            t = self.rank_data(r)["layers"][layer].get(key)
            if t is None:
                raise CheckpointError(f"{self.path / rank_file(r)}: layer {layer} has no {key!r}")
            parts.append(t[pos - r * n_old:end - r * n_old].float())
            pos = end
        return torch.cat(parts) if parts else torch.zeros(0)


def load_checkpoint(path: str | Path, model: ShardedSequential,
                    optimizer: torch.optim.Optimizer, *,
                    scaler: LossScaler | None = None) -> dict[str, Any]:
    """Collective: restores master shards, Adam moments, step counts, RNG states and loss-scaler
    state into a model sharded over any number of ranks; returns the caller's ``extra`` state.
    Everything is verified (manifest, model match, presence/size/checksum of every file this rank
    reads) before anything is modified; a failure on any rank fails all ranks."""
    path = Path(path)
    rank, world = model.rank, model.world_size
    error = None
    try:
        manifest = read_manifest(path)
        _check_matches(path, manifest, model, optimizer)
        old_world = manifest["world_size"]
        verify_files(path, manifest)
    except CheckpointError as e:
        error = str(e)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # A manifest of the right format but with missing or mistyped fields: reported on every
        # rank like any other problem, rather than raised on one while the others wait.
        error = f"{path / MANIFEST}: malformed manifest ({type(e).__name__}: {e})"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=model.group)
    failed = [e for e in errors if e is not None]
    if failed:
        raise CheckpointError(failed[0])

    reader = _ShardReader(path, old_world)
    with torch.no_grad():
        for layer, saved in zip(model.layers, manifest["layers"]):
            if layer.trainable is not None:
                old = FlatLayout.from_dict(saved["trainable"])
                lo, hi = layer.trainable.layout.shard_range(rank)
                shard: ShardParameter = layer.trainable.shard  # type: ignore[assignment]
                shard.copy_(reader.read(layer.index, "master", old, lo, hi))
                state = optimizer.state.setdefault(shard, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    values = reader.read(layer.index, key, old, lo, hi).to(shard.device)
                    if key in state:
                        state[key].copy_(values)
                    else:
                        state[key] = values
                step = reader.rank_data(0)["layers"][layer.index].get("step", 0.0)
                if "step" in state and isinstance(state["step"], torch.Tensor):
                    state["step"].fill_(step)
                else:
                    state["step"] = torch.tensor(float(step))
            if manifest["include_frozen"] and layer.frozen is not None:
                old = FlatLayout.from_dict(saved["frozen"])
                lo, hi = layer.frozen.layout.shard_range(rank)
                layer.frozen.shard.copy_(reader.read(layer.index, "frozen", old, lo, hi))
    for mine, saved in zip(optimizer.param_groups, manifest["optimizer"]["param_groups"]):
        for key, value in saved.items():
            mine[key] = tuple(value) if key == "betas" else value
    if scaler is not None and manifest["loss_scaler"] is not None:
        scaler.load_state_dict(manifest["loss_scaler"])
    rng = reader.rank_data(min(rank, old_world - 1))["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and model.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], model.device)
    dist.barrier(group=model.group)
    return manifest["extra"]
