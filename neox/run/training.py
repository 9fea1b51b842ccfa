"""The fine-tuning run of one rank: prepare the data, build the sharded model, train, finish.

Called by ``neox.run.launch`` in every process once the process group exists. Rank 0 prints and
writes the shared files (metrics, results); every rank takes part in every collective. Problems
a user can cause (a bad file, a corrupt checkpoint, a full disk, a diverging run) are agreed on
by every rank (``zerocore.run_agreed``) so that all stop together and the problem is reported
once, in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

import zerocore
from neox.run.recipe import Recipe
from neox.run.run_dir import METRICS, MetricsFile, write_tokenizer
from neox.run.progress import Log, say
from neox.run.build import build
from neox.run.finish import finish
from neox.run.loop import train
from neox.run.memory import MemoryProbe
from neox.run.restore import restore, restore_deepspeed
from neox.run.run_data import prepare_data, resumed_data


def run_training(recipe: Recipe, *, resume: Path | None, run_id: str, rank: int,
                 world_size: int, device: torch.device, allow_unverified: bool = False,
                 data_changed: bool = False, deepspeed: Path | None = None,
                 comm: zerocore.Comm = zerocore.Comm(), nodes: int = 1) -> None:
    """The whole run of one rank: from ``resume`` (a checkpoint directory, verified by
    neox.finetune before the launch, and again as it is loaded) when given, or continuing the
    DeepSpeed checkpoint ``deepspeed``. comm: as for ``build`` (give it the process group's
    timeout). nodes: the run's (torchrun's, or --nodes)."""
    log: Log = say if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(recipe.training.seed)
    resumed = None if resume is None else zerocore.run_agreed(lambda: resumed_data(
        resume, recipe, allow_unverified=allow_unverified, accept_change=data_changed))
    data = prepare_data(recipe.data, recipe.model, rank=rank, log=log, resumed=resumed)
    probe = MemoryProbe(device) if recipe.output.measure_memory else None
    state = build(recipe, data, device=device, rank=rank, world_size=world_size, log=log,
                  comm=comm, nodes=nodes)
    if resume is not None:
        restore(state, resume, recipe.optim, rank=rank, log=log,
                allow_unverified=allow_unverified, data_changed=data.changed)
    elif deepspeed is not None:
        restore_deepspeed(state, deepspeed, recipe, rank=rank, log=log)
    out = Path(recipe.output.output_dir)
    zerocore.run_agreed(lambda: write_tokenizer(out, data.tokenizer) if rank == 0 else None)
    metrics = zerocore.run_agreed(lambda: MetricsFile(
        out / METRICS, resume_step=state.step if resume is not None else None)
        if rank == 0 else None)
    done = train(state, recipe, data, metrics, run_id, device=device, rank=rank,
                 world_size=world_size, log=log, probe=probe)
    finish(state, recipe, data, done, metrics, run_id, device=device, rank=rank,
           world_size=world_size, log=log)
