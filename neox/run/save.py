"""Saving a run: its sharded checkpoints (never of non-finite weights) and the file of its
trained parameters alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

import zerocore
from zerocore.consolidate import save_trainable
from neox.run.recipe import Recipe
from neox.run.run_dir import CHECKPOINTS, DATA_SHA256, TOKENIZER_SHA256, tokenizer_bytes
from neox.run.build import TrainState
from neox.run.failed import RunFailed
from neox.run.run_data import RunData


def check_finite_weights(state: TrainState, *, rank: int) -> None:
    """Refuses to go on (and so to save) when any trainable weight is NaN or infinite on any
    rank: a diverged run must never overwrite good checkpoints. Collective."""
    ok = state.model.trainable_finite()
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=state.model.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not int(flag):
        raise RunFailed(f"training diverged: trainable weights are NaN or infinite at step "
                        f"{state.step}; nothing was saved over the run's checkpoints; lower "
                        f"--lr or --clip, or check the data" if rank == 0 else None)


def save(state: TrainState, recipe: Recipe, data: RunData, run_id: str, *, rank: int) -> Path:
    """A checkpoint of the run at ``state.step``, tagged with the run and its recipe."""
    check_finite_weights(state, rank=rank)
    extra = {"step": state.step, "sampler": state.sampler.state_dict(),
             "scheduler": state.scheduler.state_dict(), "recipe": recipe.to_dict(),
             "config": state.config.to_hf_dict(),  # what neox.export needs to rebuild the model
             TOKENIZER_SHA256: hashlib.sha256(tokenizer_bytes(data.tokenizer)).hexdigest(),
             DATA_SHA256: data.corpus.sha256}  # what a resume checks its text against
    try:
        return zerocore.save_checkpoint(Path(recipe.output.output_dir) / CHECKPOINTS,
                                        state.step, state.model, state.optimizer,
                                        scaler=state.scaler, extra=extra,
                                        keep_last=recipe.output.keep_last, run_id=run_id)
    except (zerocore.CheckpointError, OSError) as e:  # the same on every rank
        raise RunFailed(str(e) if rank == 0 else None) from None


def write_trainable(state: TrainState, path: Path, *, rank: int) -> Path:
    """The trained parameters only (full tensors, fp32), in the file ``python -m
    zerocore.consolidate --trainable-only`` writes: small (proportional to what was trained).
    Only rank 0 gathers and holds them. Collective."""
    layers = list(state.model.iter_full_states(trainable_only=True, to_rank=0))
    zerocore.run_agreed(lambda: save_trainable(path, layers) if rank == 0 else None)
    return path
