"""Sharded checkpoints: every rank writes its own shards, one manifest describes them all.

A checkpoint is a directory::

    step-00000100/
        rank-00000.pt ... rank-0000{N-1}.pt   each rank's trainable master shards, Adam moments,
                                              step counts, RNG states (and frozen shards if asked),
                                              and its identity: the save id, its rank, the world
                                              size, step, run id, and digests of the layouts and
                                              of the manifest (but its files table)
        manifest.json                         world size, every layer's flat layout, dtypes,
                                              optimizer hyper-parameters, loss-scaler state, the
                                              caller's extra state (data position...), the run id,
                                              the save id (random, one per save), and the SHA-256
                                              and size of every rank file
        COMMIT                                the SHA-256 and size of manifest.json, and the format

Saving never gathers the model: each rank writes what it holds. It is atomic: everything is
written into ``step-XXXX.tmp-<nonce>/`` (files flushed and fsynced), the manifest, then COMMIT,
and the directory is renamed to its final name as the single commit point; a crash or kill at any
moment leaves earlier checkpoints intact and no half-written directory under a final name.

Loading trusts nothing it has not checked, and checks everything before it modifies anything:
COMMIT against the manifest, every field of the manifest against the schema (layouts recomputed
from the parameter names and shapes; checkpoint_manifest.py), every rank file's size and SHA-256,
and each rank file's contents against the layouts (checkpoint_reader.py). Every failure is one
``CheckpointError`` line naming the file (and the field or layer), raised on every rank. Each rank
file's identity is checked against the manifest before any of its tensors is used: a file of
another rank (swapped), of another save (another run of the same shape, another step) or under a
manifest edited after the save (checksums recomputed or not) is refused; so is a rank file that
is a symbolic link. Checkpoints of older formats (1: no COMMIT; 2: rank files without identity)
cannot be verified so: they load only with ``allow_unverified=True``, with the other checks.

Writing errors (disk full, permissions, I/O) of any file, rename or fsync are one
``CheckpointWriteError`` line naming the path and the errno, raised on every rank; the save's
temporary directory is removed and the earlier checkpoints stay loadable.

The root directory (checkpoint_dirs.py):
- Only a ``step-XXXXXXXX`` directory with a manifest and a COMMIT record (format 1: a manifest)
  is a checkpoint; ``list_checkpoints``/``latest_checkpoint`` never return anything else, and
  ``incomplete_checkpoints`` reports the others.
- Cleanup rule: an incomplete ``step-XXXXXXXX`` directory whose every entry is a file zerocore
  writes (``rank-NNNNN.pt``, ``manifest.json``, ``COMMIT``) is a leftover: the next save removes
  it, as it removes the ``.tmp-``/``.deleting-`` directories of killed saves and deletions. One
  holding anything else is not zerocore's: it is left alone (and reported). Deletions first
  rename a directory out of the ``step-XXXXXXXX`` namespace, then delete it.
- Runs: ``save_checkpoint(..., run_id=...)`` tags a checkpoint with its run. Pruning to
  ``keep_last`` counts and removes only the checkpoints of the same run (those without a run id
  are one run, None) and never the one just written; a step directory of another run is never
  replaced (the save is refused); ``checkpoint_runs`` says which runs a root holds. One process
  group writes to a root at a time.

Because the manifest carries the layout, a checkpoint written by N ranks loads into M ranks: the
parameter offsets inside a flat group do not depend on the world size (only the tail padding
does), so each new rank reads the byte ranges it needs from the old rank files (memory-mapped).

An HSDP model (R replicas x S shards) is saved once, by replica 0's shard group, as a flat world
of S ranks would save it (the other replicas write nothing but agree on every step): its
checkpoint is a flat one, and loads under any layout; loading into HSDP, every replica's shard
group reads the same shards, as a flat world of S ranks would. An hpZ model's state is flat over
all R·S ranks: each rank writes its slice as the flat rank holding it, a flat checkpoint of R·S
ranks, and loads its slice the same way.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from zerocore.checkpoint.agreed import agreed, sharded_of
from zerocore.checkpoint.dirs import (LEFTOVER_DIR, UNKNOWN_RUN, aside_name, holds_only_our_files,
                                      is_complete, leftovers, remove_tree, run_of,
                                      same_run_checkpoints, step_dir_name)
from zerocore.checkpoint.errors import CheckpointError, CheckpointWriteError
from zerocore.checkpoint.manifest import (COMMIT, FORMAT, MANIFEST, commit_record,
                                          manifest_digest, model_fingerprint, rank_file,
                                          read_manifest)
from zerocore.checkpoint.reader import (ShardReader, identity_record, verify_files)
from zerocore.checkpoint.durable_io import fsync_dir, make_dir, rename, write_file
from zerocore.checkpoint.deepspeed import is_deepspeed_checkpoint, load_deepspeed_checkpoint
from zerocore.comm.device import comm_device
from zerocore.comm.objects import all_gather_objects, broadcast_objects
from zerocore.loss_scale import LossScaler
from zerocore.optim import overrides_mismatch
from zerocore.engine.nvme_store import ADAM_KEYS
from zerocore.engine.optimizer_pass import settle_updates
from zerocore.engine.sharded_param import ShardParameter, is_nvme, set_master
from zerocore.comm.lockstep import LOAD, SAVE
from zerocore.engine.sharding import Sharding

__all__ = ["save_checkpoint", "load_checkpoint"]

T = TypeVar("T")

def _noting(fn: Callable[[], T], note: str) -> Callable[[], T]:
    """``fn``, whose write errors end with ``note`` (what became of the save)."""
    def run() -> T:
        try:
            return fn()
        except CheckpointWriteError as e:
            raise CheckpointWriteError(f"{e}; {note}", errno=e.errno,
                                       filename=e.filename) from None
    return run


def _layouts(model: Sharding) -> list[dict[str, Any]]:
    return [{"trainable": l.trainable.layout.to_dict() if l.trainable else None,
             "frozen": l.frozen.layout.to_dict() if l.frozen else None} for l in model.layers]


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


# -- saving --------------------------------------------------------------------------------------


def _check_save_args(step: Any, run_id: Any, keep_last: Any, json_state: list[Any],
                     finite_state: list[Any]) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an integer >= 0, got {step!r}")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise ValueError(f"save_checkpoint: run_id must be a non-empty string or None, got "
                         f"{run_id!r}")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool):
        raise ValueError(f"save_checkpoint: keep_last must be an integer (0: keep all), got "
                         f"{keep_last!r}")
    # Everything the manifest stores is checked for JSON on every rank before anything is
    # written.
    try:
        json.dumps(json_state)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: extra state, optimizer hyper-parameters and "
                        f"loss-scaler state must be JSON-serialisable: {e}") from None
    # Loading refuses a NaN or infinite learning rate or loss scale: refuse to save one.
    try:
        json.dumps(finite_state, allow_nan=False)
    except ValueError:
        raise ValueError(f"save_checkpoint: the optimizer hyper-parameters and loss-scaler "
                         f"state hold a NaN or infinite number ({finite_state}); a checkpoint "
                         f"of them could not be resumed") from None


def _run_name(run: Any) -> str:
    if run is UNKNOWN_RUN:
        return "an unknown run (its manifest cannot be read)"
    return "no named run (saved without a run_id)" if run is None else f"run {run!r}"


def _check_replaceable(final: Path, run_id: str | None) -> None:
    """Refuses to replace a step directory that is not this run's: another run's checkpoint,
    or a directory holding files zerocore did not write."""
    if not final.exists() and not final.is_symlink():
        return
    if final.is_symlink() or not final.is_dir():
        raise CheckpointError(f"{final} exists and is not a checkpoint directory; it is left "
                              f"alone: move it away, or save into another root")
    if is_complete(final):
        other = run_of(final)
        if other != run_id:
            raise CheckpointError(f"{final} holds a checkpoint of {_run_name(other)}, and this "
                                  f"save is of {_run_name(run_id)}: it is not replaced; save "
                                  f"into another root, or remove it if it is not needed")
    elif not holds_only_our_files(final):
        raise CheckpointError(f"{final} exists and holds files zerocore did not write; it is "
                              f"left alone: move them away, or save into another root")


def _alone(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in a storage of exactly its own bytes. torch.save writes the whole
    storage of every tensor it saves, and an offloaded master shard lives in its sharding's host
    arena (engine/host_arena.py: one mapping reserved at the host's memory size), so saving it
    as it is would write the arena, not the shard."""
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _rank_payload(model: Sharding, optimizer: torch.optim.Optimizer,
                  include_frozen: bool, identity: dict[str, Any]) -> dict[str, Any]:
    layers: dict[int, dict[str, Any]] = {}
    for layer in model.layers:
        entry: dict[str, Any] = {}
        if layer.trainable is not None:
            shard = layer.trainable.shard
            state = optimizer.state.get(shard, {})
            if is_nvme(shard):
                # On NVMe: mapped from the scratch, so that torch.save reads each array from
                # the disk as it writes it, and the process never holds the state.
                for key in ADAM_KEYS:
                    entry[key] = shard.nvme.mapped(key)
            else:
                entry["master"] = _alone(shard)  # 1D, fp32, shard_numel
                for key in ("exp_avg", "exp_avg_sq"):
                    # torch.optim creates Adam's moments at the first step, as zeros: before
                    # it, zeros are what the next step starts from.
                    entry[key] = (_alone(state[key]) if key in state
                                  else torch.zeros_like(entry["master"]))
            entry["step"] = float(state["step"]) if "step" in state else 0.0
        if include_frozen and layer.frozen is not None:
            # 1D, param_dtype, shard_numel; on NVMe, mapped from the scratch
            entry["frozen"] = _alone(layer.frozen.saved_values())
        layers[layer.index] = entry
    return {"identity": identity, "layers": layers, "rng": _rng_state(model.device)}


def _commit(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """The leader (replica 0's rank 0): writes the manifest and its COMMIT record into ``tmp``
    and renames ``tmp`` to ``final`` (the commit point). A step saved again by the same run is
    renamed aside first (the next ``_tidy`` deletes it) and put back if the commit fails."""
    raw = json.dumps(manifest, indent=1).encode()
    write_file(tmp / MANIFEST, lambda f: f.write(raw))
    write_file(tmp / COMMIT, lambda f: f.write(commit_record(raw)))
    fsync_dir(tmp)
    _check_replaceable(final, manifest.get("run_id"))
    aside = aside_name(final) if final.exists() else None
    if aside is not None:
        rename(final, aside)
    try:
        rename(tmp, final)
        try:
            fsync_dir(final.parent)
        except CheckpointWriteError:
            rename(final, tmp)  # not durable, so not committed: undone
            raise
    except CheckpointWriteError as e:
        if aside is not None:
            try:
                rename(aside, final)
            except CheckpointWriteError as again:
                raise CheckpointWriteError(f"{e}; and the checkpoint it replaced could not be "
                                           f"put back ({again}): move {aside} to {final} "
                                           f"before the next save", errno=e.errno,
                                           filename=e.filename) from None
        raise


def _tidy(root: Path, final: Path, run_id: str | None, keep_last: int) -> None:
    """The leader, after the commit: deletes the run's checkpoints beyond ``keep_last`` (never
    ``final``), the directory ``final`` replaced, and the leftovers of killed saves."""
    doomed = []
    if keep_last > 0:
        others = [p for p in same_run_checkpoints(root, run_id) if p != final]
        doomed += others[:max(0, len(others) - (keep_last - 1))]
    for path in doomed + leftovers(root):
        if not LEFTOVER_DIR.match(path.name):  # still under a final name: move it out first
            moved = aside_name(path)
            rename(path, moved)
            path = moved
        remove_tree(path)


def save_checkpoint(root: str | Path, step: int, model: Any,
                    optimizer: torch.optim.Optimizer, *, scaler: LossScaler | None = None,
                    extra: dict[str, Any] | None = None, keep_last: int = 3,
                    include_frozen: bool = False, run_id: str | None = None) -> Path:
    """Collective: every rank calls it, with the same arguments. Writes ``root/step-<step>/``
    and returns its path.

    model: a ``zerocore.shard`` model, or a model sharded by ``zerocore.shard_model`` (or its
        ``ShardedModel``): its units are the checkpoint's layers (the root last).

    extra: JSON-serialisable state of the caller (data sampler position, scheduler, config),
        stored in the manifest and returned by ``load_checkpoint``.
    keep_last: after the save, keep this many checkpoints of the run (the new one included);
        0 keeps all.
    include_frozen: save the frozen shards too (needed to consolidate the full model).
    run_id: the run the checkpoint belongs to (see the module docstring); a step directory of
        another run is never replaced: ``CheckpointError``.
    Raises ``CheckpointWriteError`` (a ``CheckpointError`` and an ``OSError``) on every rank when
    anything cannot be written; nothing is then committed and earlier checkpoints are intact.
    """
    model = sharded_of(model)
    model.lockstep.collective(SAVE)  # every rank saves here, or every rank says where it is
    # An overlapped optimizer pass in flight ends first; a failure of it is agreed here, on
    # every rank, before anything is written (the state it left is not saved).
    settle_updates(model.trainable_shards(), together=True)
    frozen_dtype = model.frozen_weights.dtype
    if include_frozen and frozen_dtype is not None:
        # The same answer on every rank (the policy is the model's), so no rank waits.
        raise ValueError(f"save_checkpoint: include_frozen=True with FrozenWeights("
                         f"{frozen_dtype!r}): the frozen shards are {frozen_dtype} copies of the "
                         f"base weights, not the weights; save without include_frozen and "
                         f"consolidate or export from the base checkpoint (neox.export does)")
    root = Path(root)
    # ``group``, ``rank``, ``world``: the ranks the state is sharded over and this rank's slice.
    # With HSDP every replica holds the same shards, so replica 0's shard group alone writes
    # its rank files, as a flat world of the shard group's size would (the checkpoint is a
    # flat one: it loads under any layout); the other replicas write nothing, but every rank
    # of the mesh agrees on each step (``whole``), so that a failure anywhere is raised
    # everywhere. Flat: ``whole`` is ``group``. hpZ: the state is flat over every rank, each
    # rank writing its slice as the flat rank that holds it (``rank``, not its rank in
    # ``group``: ``Mesh.in_state_order``).
    group, rank, world = model.group, model.rank, model.world_size
    mesh = model.mesh
    whole = mesh.whole
    writes = not mesh.replicated or mesh.replicate.rank() == 0
    leader = writes and rank == 0  # names the directory, writes the manifest, commits, tidies
    # The leader's rank in ``whole``: replica 0's first rank (the mesh's first row).
    src = dist.get_group_rank(whole, mesh.ranks[0][0])
    # Where the small values below travel (comm/objects.py): the CPU on a group with a CPU
    # backend, else the model's device.
    device = model.device
    channel = comm_device(group, torch.device("cpu"), device)
    whole_channel = comm_device(whole, torch.device("cpu"), device)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    scaler_state = scaler.state_dict() if scaler is not None else None
    # The leader names the temporary directory and says what it was asked to save, so that
    # every rank can check it was asked the same.
    # It also draws the save's id, which every rank file records: a file of another save (of
    # another run of the same shape, saved without a run id too) is then told apart.
    plan: list[Any] = [(uuid.uuid4().hex[:8], uuid.uuid4().hex, step, run_id, include_frozen)
                       if leader else None]
    broadcast_objects(plan, src, whole, whole_channel)
    nonce, save_id, *asked = plan[0]

    def prepare() -> None:
        _check_save_args(step, run_id, keep_last, [extra or {}, groups, scaler_state],
                         [groups, scaler_state])
        if [step, run_id, include_frozen] != asked:
            # Ranks of ``whole`` (flat: of the group).
            raise ValueError(f"save_checkpoint: rank {whole.rank()} was asked to save step "
                             f"{step}, run_id {run_id!r}, include_frozen {include_frozen}, "
                             f"rank {src} step {asked[0]}, run_id {asked[1]!r}, include_frozen "
                             f"{asked[2]}; every rank must pass the same")
        if leader:
            _check_replaceable(root / step_dir_name(step), run_id)
            make_dir(root, parents=True)
            make_dir(root / f"{step_dir_name(step)}.tmp-{nonce}")

    not_saved = f"step {step} was not saved; the earlier checkpoints are unchanged"
    agreed(_noting(prepare, not_saved), whole, device)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp-{nonce}"
    try:
        layouts = _layouts(model)
        # The manifest but for its files table, written before the rank files so that each
        # can record it (rank 0's is the one written, so its digest is the one recorded).
        manifest = {
            "format": FORMAT, "save_id": save_id, "step": step, "world_size": world,
            "param_dtype": str(model.mixed_precision.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(model.mixed_precision.grad_reduce_dtype).removeprefix("torch."),
            "include_frozen": include_frozen,
            "model_fingerprint": model_fingerprint(layouts),
            "layers": layouts,
            "optimizer": {"class": type(optimizer).__name__, "param_groups": groups},
            "loss_scaler": scaler_state,
            "extra": extra or {},
        }
        if run_id is not None:
            manifest["run_id"] = run_id
        digest: list[Any] = [manifest_digest(manifest) if leader else None]
        broadcast_objects(digest, src, whole, whole_channel)
        identity = {**identity_record(manifest, rank), "manifest_sha256": digest[0]}
        info = agreed(_noting(lambda: write_file(
            tmp / rank_file(rank),
            lambda f: torch.save(_rank_payload(model, optimizer, include_frozen, identity), f))
            if writes else None, not_saved), whole, device)
        # Within each shard group: replica 0's gathers its files' records (the others, Nones);
        # hpZ's, every rank's, put in the order of the slices they hold.
        infos = mesh.in_state_order(all_gather_objects(info, group, channel))
        manifest["files"] = {rank_file(r): infos[r] for r in range(world)}
        agreed(_noting(lambda: _commit(tmp, final, manifest) if leader else None,
                        not_saved), whole, device)
    except BaseException:
        if leader:
            remove_tree(tmp)
        raise
    saved_note = f"{final} was saved, but older directories could not all be removed"
    agreed(_noting(lambda: _tidy(root, final, run_id, keep_last) if leader else None,
                    saved_note), whole, device)
    return final


# -- loading -------------------------------------------------------------------------------------


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


def _check_matches(path: Path, manifest: dict[str, Any], model: Sharding,
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
    for mine, saved in zip(optimizer.param_groups, saved_groups):
        problem = overrides_mismatch(mine, saved)
        if problem:
            raise CheckpointError(f"{mf}: {problem}")


def _restore(reader: ShardReader, model: Sharding,
             optimizer: torch.optim.Optimizer, scaler: LossScaler | None) -> None:
    """Copies a verified checkpoint into this rank's shards, optimizer and RNG."""
    manifest, rank = reader.manifest, model.rank
    model.release_gathered()  # gathered copies of the values about to change
    with torch.no_grad():
        for layer in model.layers:
            if layer.trainable is not None:
                lo, hi = layer.trainable.layout.shard_range(rank)
                shard: ShardParameter = layer.trainable.shard  # type: ignore[assignment]
                state = optimizer.state.setdefault(shard, {})
                values = {key: reader.read(layer.index, key, lo, hi) for key in ADAM_KEYS}
                set_master(shard, values["master"])
                if is_nvme(shard):
                    for key in ("exp_avg", "exp_avg_sq"):  # into the scratch, chunk by chunk
                        shard.nvme.write(key, values[key])
                for key in ("exp_avg", "exp_avg_sq") if not is_nvme(shard) else ():
                    value = values[key].to(shard.device)
                    if key in state:
                        state[key].copy_(value)
                    else:
                        state[key] = value
                step = reader.rank_data(0)["layers"][layer.index]["step"]
                if "step" in state and isinstance(state["step"], torch.Tensor):
                    state["step"].fill_(step)
                else:
                    state["step"] = torch.tensor(float(step))
            if manifest["include_frozen"] and layer.frozen is not None:
                lo, hi = layer.frozen.held_range  # a replicated base: every part
                layer.frozen.load_frozen(reader.read_as(layer.index, "frozen",
                                                        layer.frozen.layout, lo, hi))
    for mine, saved in zip(optimizer.param_groups, manifest["optimizer"]["param_groups"]):
        for key, value in saved.items():
            mine[key] = tuple(value) if key == "betas" else value
    if scaler is not None and manifest["loss_scaler"] is not None:
        scaler.load_state_dict(manifest["loss_scaler"])
    rng = reader.rank_data(min(rank, reader.world_size - 1))["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and model.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], model.device)


def load_checkpoint(path: str | Path, model: Any,
                    optimizer: torch.optim.Optimizer, *,
                    scaler: LossScaler | None = None,
                    allow_unverified: bool = False) -> dict[str, Any]:
    """Collective: restores master shards, Adam moments, step counts, RNG states and loss-scaler
    state into a model sharded over any number of ranks; returns the caller's ``extra`` state.
    Everything is verified (what ``open_checkpoint`` checks: COMMIT, manifest fields, every rank
    file's size, checksum, identity and contents; and the model match) before anything is
    modified; a failure on any rank raises ``CheckpointError`` on every rank.
    allow_unverified: load a checkpoint of a format whose rank files do not record whose they
    are (format 1 or 2, written by an older zerocore); refused otherwise.

    ``path`` may also be a DeepSpeed ZeRO-3 checkpoint directory (the one holding ``latest``, or
    a ``global_stepN`` directory): its weights, Adam moments and step, optimizer settings and
    loss-scaler state are loaded (``zerocore.checkpoint.deepspeed.load_deepspeed_checkpoint``) and
    ``{"deepspeed": {...}}`` is returned."""
    path = Path(path)
    if is_deepspeed_checkpoint(path):
        return load_deepspeed_checkpoint(path, model, optimizer, scaler=scaler)
    model = sharded_of(model)
    model.lockstep.collective(LOAD)  # every rank loads here, or every rank says where it is

    def verify() -> ShardReader:
        settle_updates(model.trainable_shards())  # (a pass in flight: its state is replaced)
        # open_checkpoint's checks, with the model match before the files': a manifest of
        # another model is reported as that, not as rank files that do not match it.
        manifest = read_manifest(path, allow_unverified=allow_unverified)
        _check_matches(path, manifest, model, optimizer)
        verify_files(path, manifest)
        reader = ShardReader(path, manifest)
        reader.check_all()
        return reader

    # With HSDP each replica's shard group reads the same shards, as a flat world of the shard
    # group's size would: the replicas end bitwise equal. Every rank of the mesh agrees.
    reader = agreed(verify, model.mesh.whole, model.device)
    agreed(lambda: _restore(reader, model, optimizer, scaler), model.mesh.whole, model.device)
    return reader.manifest["extra"]
