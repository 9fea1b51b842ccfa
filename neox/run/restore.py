"""Continuing a run: from a neox checkpoint (shards, moments, loss scale, data position and
schedule), or from a DeepSpeed ZeRO-3 checkpoint of the same model; then the recipe's
optimisation settings at the schedule's position."""

from __future__ import annotations

from pathlib import Path


import zerocore
from zerocore.checkpoint import load_deepspeed_checkpoint
from neox.model import layer_specs
from neox.run import from_deepspeed as nds
from neox.run.recipe import OptimConfig, Recipe
from neox.run.progress import Log
from neox.run.build import TrainState, warmup_factor
from neox.run.failed import RunFailed


def restore(state: TrainState, checkpoint: Path, optim: OptimConfig, *, rank: int,
            log: Log, allow_unverified: bool = False, data_changed: bool = False) -> None:
    """Continues from ``checkpoint``: shards, moments, loss scale, RNG, data position and
    schedule; then the recipe's optimisation settings, which are the checkpoint's unless the
    command line overrode them (``neox.finetune.resume_recipe`` logged which). ``data_changed``
    (the text changed, as --data-changed accepts): the sampler starts its epoch again."""
    try:
        extra = zerocore.load_checkpoint(checkpoint, state.model, state.optimizer,
                                         scaler=state.scaler, allow_unverified=allow_unverified)
    except zerocore.CheckpointError as e:  # raised alike on every rank: reported once
        raise RunFailed(str(e) if rank == 0 else None) from None

    def restore_loop() -> None:
        try:
            state.step = int(extra["step"])
            saved = extra["sampler"]
            state.sampler.load_state_dict(
                {"epoch": saved["epoch"], "seed": saved["seed"], "samples_done": 0}
                if data_changed else saved)
            state.scheduler.load_state_dict(extra["scheduler"])
        except KeyError as e:
            raise zerocore.CheckpointError(f"{checkpoint}: the manifest's extra state lacks "
                                           f"{e.args[0]!r}; it is not a complete neox.finetune "
                                           f"checkpoint") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise zerocore.CheckpointError(f"{checkpoint}: the manifest's extra state is "
                                           f"invalid ({e})") from None
    zerocore.run_agreed(restore_loop)
    apply_optim(state, optim)
    log(f"resumed from {checkpoint} at step {state.step} (epoch {state.sampler.epoch}, "
        f"batch {state.sampler.batches_done})")


def apply_optim(state: TrainState, optim: OptimConfig) -> None:
    """The recipe's optimisation settings, at the schedule's current position."""
    # LambdaLR sets lr = base_lr * factor(step); the same product, so unchanged settings give
    # bitwise the same learning rate as the checkpoint's.
    factor = warmup_factor(optim.warmup)(state.scheduler.last_epoch)
    state.scheduler.base_lrs = [optim.lr] * len(state.optimizer.param_groups)
    for group in state.optimizer.param_groups:
        group.update(lr=optim.lr * factor, betas=optim.betas, eps=optim.eps,
                     weight_decay=optim.weight_decay)


def restore_deepspeed(state: TrainState, checkpoint: Path, recipe: Recipe, *, rank: int,
                      log: Log) -> None:
    """Continues the DeepSpeed run of ``checkpoint`` (checked by neox.finetune before the
    launch): its trained masters, Adam's moments and step, the loss-scale state and the step
    count; the frozen weights stay --checkpoint's, refused unless they are the run's. The
    schedule is placed at that step (a warm-up counts as done for the steps DeepSpeed ran); the
    data order cannot be: DeepSpeed does not save it, so the sampler starts at the beginning."""
    specs = layer_specs(state.config, recipe.model.filter_layers)
    try:
        name = zerocore.run_agreed(lambda: nds.namer(nds.DeepSpeedCheckpoint(checkpoint), specs,
                                                     recipe.model.finetune))
        run = load_deepspeed_checkpoint(checkpoint, state.model, state.optimizer,
                                        scaler=state.scaler, ds_name=name,
                                        frozen="check")["deepspeed"]
    except (zerocore.CheckpointError, ValueError) as e:  # raised alike on every rank
        raise RunFailed(f"--resume: {e}" if rank == 0 else None) from None
    state.step = int(run["global_steps"] or 0)
    state.scheduler.last_epoch = state.step
    apply_optim(state, recipe.optim)
    if recipe.sharding.frozen_quantized:
        log(f"note: --frozen-weights {recipe.sharding.frozen_weights}: the frozen weights are "
            f"held quantized, so they were not compared with the DeepSpeed run's; --checkpoint "
            f"must be the base it trained on")
    log(f"resumed the DeepSpeed run of {checkpoint} at step {state.step} (DeepSpeed "
        f"{run['ds_version']}, {run['world_size']} ranks, {run['global_samples']} samples seen): "
        f"trained weights, Adam moments and step, loss scale; DeepSpeed saves no data order, so "
        f"the sampler starts at the beginning of epoch 0 (--seed {recipe.training.seed}'s order): "
        f"samples the DeepSpeed run trained on may come again before the others")
