"""The training loop of one rank: the optimizer steps until the epochs or ``max_steps`` are
done, the metrics of each, evaluation of a split, and stopping a diverging run."""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerocore
from neox import data as nd
from neox.run.recipe import Recipe, TrainingConfig
from neox.run.run_dir import MetricsFile, OutputDirError
from neox.run.progress import Log, Progress
from neox.run.step import micro_batch_loss
from neox.run.build import TrainState
from neox.run.failed import RunFailed
from neox.run.memory import MeasuredPeak, MemoryProbe
from neox.run.run_data import RunData
from neox.run.save import save


@torch.no_grad()
def evaluate(model: nn.Module, split: nd.WindowSplit, *, rank: int, world_size: int,
             batch_size: int, device: torch.device) -> tuple[float, float]:
    """Mean token loss and accuracy over a whole split, every sample counted once across ranks.
    Collective when the model is sharded."""
    batches = nd.eval_batches(len(split), rank=rank, world_size=world_size,
                              batch_size=batch_size)
    # Every rank must run the same number of forwards (each forward is collective).
    n = torch.tensor([len(batches)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, tokens
    for i in range(int(n)):
        if i < len(batches):
            idx = batches[i]
        else:  # this rank is out of samples: a dummy forward, not counted, keeps step with others
            idx = batches[0][:1] if batches else torch.zeros(1, dtype=torch.long)
        x, y = nd.batch(split, idx, device=device)
        logits = model(x).float()
        if i < len(batches):
            totals[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            totals[1] += (logits.argmax(-1) == y).sum()
            totals[2] += y.numel()
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def total_steps(state: TrainState, loop: TrainingConfig) -> int:
    total = state.sampler.steps_until(loop.epochs) // loop.grad_accum + state.step
    return min(total, loop.max_steps) if loop.max_steps is not None else total


@dataclasses.dataclass
class StepsDone:
    first_step: int
    memory: zerocore.MemoryReport | None   # taken at the last step, gradients included
    comm: zerocore.CommReport
    measured: MeasuredPeak | None = None
    # (loss, accuracy) on the validation split after the last step, in its metrics line;
    # None when this run trained no step
    validation: tuple[float, float] | None = None


def train(state: TrainState, recipe: Recipe, data: RunData, metrics: MetricsFile | None,
          run_id: str, *, device: torch.device, rank: int, world_size: int,
          log: Log, probe: MemoryProbe | None = None) -> StepsDone:
    """The optimizer steps, until the epochs or ``max_steps`` are done."""
    loop, total = recipe.training, total_steps(state, recipe.training)
    ds, model = data.dataset, state.model
    log(f"training {total - state.step} steps: {world_size} rank{'s' if world_size > 1 else ''} "
        f"x {loop.batch_size} sequences x {loop.grad_accum} micro-batch"
        f"{'es' if loop.grad_accum > 1 else ''} per step, lr {recipe.optim.lr}, warm-up "
        f"{recipe.optim.warmup}")
    progress = Progress(total, enabled=rank == 0)
    model.comm_report(reset=True)
    steps_comm: zerocore.CommReport | None = None  # of the steps before the last validation
    first_step, memory, validation = state.step, None, None
    nonfinite = 0               # consecutive steps with a non-finite loss or gradient
    metrics_error: OutputDirError | None = None    # rank 0's, reported at the next step
    while state.step < total:
        start = time.perf_counter()
        # loss sum, correct, tokens, and whether rank 0 failed to write the last metrics line
        totals = torch.zeros(4, dtype=torch.float64, device=device)
        totals[3] = 1.0 if metrics_error is not None else 0.0
        for micro in range(loop.grad_accum):
            # HSDP: the replicas' all-reduce once per step, with the last micro-batch's backward
            # (the earlier ones' sums wait in fp32); a flat layout ignores it.
            model.set_requires_all_reduce(micro == loop.grad_accum - 1)
            x, y = nd.batch(ds.train, state.sampler.next_batch(), device=device)
            loss, correct = micro_batch_loss(model(x), y)
            state.scaler.scale(loss / loop.grad_accum).backward()
            with torch.no_grad():
                totals[0] += loss.detach() * y.numel()
                totals[1] += correct
                totals[2] += y.numel()
            del loss, correct  # not held through the next micro-batch's forward
        result = state.scaler.step(state.optimizer, max_norm=recipe.optim.clip or None)
        if not result.skipped:
            state.scheduler.step()
        if state.step == total - 1:
            memory = model.memory_report(state.optimizer)  # before zero_grad: with gradients
        state.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(totals)
        if totals[3] > 0:
            raise RunFailed(str(metrics_error) if rank == 0 else None)
        state.step += 1
        record = {"step": state.step, "loss": (totals[0] / totals[2]).item(),
                  "acc": (totals[1] / totals[2]).item(),
                  "lr": state.optimizer.param_groups[0]["lr"],
                  "loss_scale": result.loss_scale, "grad_norm": result.grad_norm,
                  "skipped": result.skipped,
                  "tokens_per_s": totals[2].item() / (time.perf_counter() - start),
                  "epoch": state.sampler.epoch}
        # A skipped step is routine while fp16's dynamic loss scale searches; in fp32/bf16 it
        # means a NaN or infinite gradient, as bad as a non-finite loss.
        bad = not math.isfinite(record["loss"]) or (result.skipped and not state.scaler.dynamic)
        nonfinite = nonfinite + 1 if bad else 0
        # The end of the run is validated too, in the last step's line (one line per step).
        if state.step == total or (loop.eval_every and state.step % loop.eval_every == 0):
            # The communication report is of the training steps (its expectation is per step):
            # the validation's gathers are left out of it.
            steps_comm = _plus(steps_comm, model.comm_report(reset=True))
            validation = evaluate(model, ds.val, rank=rank, world_size=world_size,
                                  batch_size=loop.batch_size, device=device)
            model.comm_report(reset=True)
            record["val_loss"], record["val_acc"] = validation
        if metrics is not None:
            try:
                metrics.write(record)
            except OutputDirError as e:
                metrics_error = e
        progress.update(state.step, f"loss {record['loss']:.4f} acc {record['acc']:.3f} "
                                    f"lr {record['lr']:.2e} scale {record['loss_scale']:g} "
                                    f"{record['tokens_per_s']:,.0f} tok/s"
                        + (" (skipped: overflow)" if result.skipped else ""))
        if nonfinite >= loop.max_nonfinite_steps:
            progress.close()
            raise RunFailed(f"training diverged: the loss or the gradients have been NaN or "
                            f"infinite for {nonfinite} steps in a row (up to step {state.step}); "
                            f"the run stops without saving; lower --lr, or check the data"
                            if rank == 0 else None)
        if recipe.output.save_every and state.step % recipe.output.save_every == 0 \
                and state.step < total:
            save(state, recipe, data, run_id, rank=rank)
        if probe is not None and state.step < total:
            probe.after_step(state)
    progress.close()
    measured = probe.finish(state.step) if probe is not None else None
    zerocore.run_agreed(lambda: _raise(metrics_error))
    return StepsDone(first_step, memory, _plus(steps_comm, model.comm_report()), measured,
                     validation)


def _plus(a: zerocore.CommReport | None, b: zerocore.CommReport) -> zerocore.CommReport:
    """The traffic of ``a``'s steps and ``b``'s together: every count of bytes moved summed
    (HSDP's replica all-reduces too), the per-step expectations and the rest as ``b``'s."""
    if a is None:
        return b
    moved = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(b)
             if f.name.endswith("_bytes") and not f.name.startswith("expected_")}
    return dataclasses.replace(b, **moved)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
