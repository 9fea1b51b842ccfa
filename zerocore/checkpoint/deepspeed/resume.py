"""``load_deepspeed_checkpoint``: a DeepSpeed ZeRO-3 run resumed on a zerocore-sharded model, at
any number of ranks: each rank reads from the DeepSpeed files only the pieces of its own shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from zerocore.checkpoint.agreed import agreed, sharded_of
from zerocore.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zerocore.checkpoint.errors import DeepSpeedCheckpointError
from zerocore.engine.sharded_param import is_nvme, set_master

__all__ = ["load_deepspeed_checkpoint"]


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

    # Every rank of the mesh agrees (HSDP: each replica reads the same pieces).
    ckpt = agreed(verify, sharded.mesh.whole, sharded.device)

    def restore() -> None:
        sharded.release_gathered()
        step = float(ckpt.steps[0]) if ckpt.steps else 0.0
        with torch.no_grad():
            for layer in sharded.layers:
                if layer.trainable is not None:
                    layout = layer.trainable.layout
                    shard = layer.trainable.shard
                    values = {what: _shard_of(ckpt, layout, layout.shard_range(rank),
                                              layer.index, ds_name, what)
                              for what in ("fp32", "exp_avg", "exp_avg_sq")}
                    set_master(shard, values["fp32"])
                    state = optimizer.state.setdefault(shard, {})
                    for key in ("exp_avg", "exp_avg_sq"):
                        if is_nvme(shard):  # into the scratch (Offload(optimizer="nvme"))
                            shard.nvme.write(key, values[key])
                            continue
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
                    group = layer.frozen
                    # What the group holds (a replicated base: every part), in its dtype, or
                    # in fp32 when it quantizes what it is given.
                    dtype = torch.float32 if group.quantized else group.shard.dtype
                    group.load_frozen(_shard_of(ckpt, group.layout, group.held_range,
                                                layer.index, ds_name, "fp32", dtype=dtype))
        saved = ckpt.param_groups[0] if ckpt.param_groups else {}
        for group in optimizer.param_groups:
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in saved and key in group:
                    group[key] = tuple(saved[key]) if key == "betas" else saved[key]
        if scaler is not None and ckpt.loss_scaler is not None:
            scaler.load_state_dict(_scaler_state(ckpt.loss_scaler, scaler))

    agreed(restore, sharded.mesh.whole, sharded.device)
    return {"deepspeed": {"tag": ckpt.tag_dir.name, "global_steps": ckpt.global_steps,
                          "global_samples": ckpt.global_samples,
                          "ds_version": ckpt.ds_version, "world_size": ckpt.world_size}}


def _shard_of(ckpt: DeepSpeedCheckpoint, layout: Any, held: tuple[int, int], index: int,
              ds_name: Callable[[int, str], str], what: str,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The elements ``held`` = ``[lo, hi)`` of a flat group this rank holds (its shard, or a
    replicated base's every part), filled from the checkpoint's full tensors (one parameter at
    a time; padding zero)."""
    lo, hi = held
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
