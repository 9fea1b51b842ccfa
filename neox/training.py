"""The fine-tuning run of one rank: prepare the data, build the sharded model, train, finish.

Called by ``neox.launch`` in every process once the process group exists. Rank 0 prints and
writes the shared files (metrics, results); every rank takes part in every collective. Problems
a user can cause (a bad file, a corrupt checkpoint, a full disk, a diverging run) are agreed on
by every rank (``zerocore.run_agreed``) so that all stop together and the problem is reported
once, in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerocore
from zerocore.consolidate import save_trainable
from zerocore.checkpoint.deepspeed import load_deepspeed_checkpoint
from neox import data as nd
from neox import from_deepspeed as nds
from neox.cli import DTYPES, preset_config, resolve_dtype
from neox.config import NeoXConfig, filtered_config
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.lora import merge_lora
from neox.model import LayerSpec, layer_specs
from neox.progress import Progress
from neox.sampling import sample_sharded
from neox.plan import plan_run, request_from_recipe
from neox.step import micro_batch_loss, recompute_policy
from neox.trained import find_tokenizer, trained_layers
from neox.recipe import DataConfig, LoopConfig, ModelRecipe, OptimConfig, Recipe
from neox.run_dir import (CHECKPOINTS, DATA_SHA256, HF_EXPORT, METRICS, TOKENIZER,
                          TOKENIZER_SHA256, TRAINABLE, MetricsFile, OutputDirError,
                          tokenizer_bytes, write_tokenizer)
from neox.weights import (RandomInit, WeightsReader, materialize, meta_layer, open_weights,
                          save_hf)

Log = Callable[..., None]


class RunFailed(Exception):
    """The run stops for a reason every rank knows at once (a diverged loss, a failed save);
    rank 0's exception carries the message, the others' carry None."""

    def __init__(self, message: str | None):
        super().__init__(message or "stopped; rank 0 reports why")
        self.message = message


# -- data -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class RunData:
    tokenizer: Any
    dataset: nd.TokenDataset
    corpus: nd.Corpus
    changed: bool = False      # a resumed run's text changed, as --data-changed accepts


@dataclasses.dataclass(frozen=True)
class ResumedData:
    """What the checkpoint a run resumes from says about the text it trained on."""

    checkpoint: Path
    sha256: str | None            # Corpus.sha256; None: saved before neox recorded it
    tokenizer_copy: Path | None   # the run's tokenizer.json (its checksum matches), if found
    accept_change: bool           # --data-changed


def resumed_data(checkpoint: Path, recipe: Recipe, *, allow_unverified: bool,
                 accept_change: bool) -> ResumedData:
    """``ResumedData`` of a checkpoint that neox.finetune verified before the launch."""
    extra = zerocore.read_manifest(checkpoint, allow_unverified=allow_unverified)["extra"]
    sha, tok_sha = extra.get(DATA_SHA256), extra.get(TOKENIZER_SHA256)
    copy = (find_tokenizer(checkpoint, recipe, tok_sha)[0] if isinstance(tok_sha, str)
            else None)
    return ResumedData(checkpoint, sha if isinstance(sha, str) else None, copy, accept_change)


def check_data(corpus: nd.Corpus, resumed: ResumedData | None, log: Log) -> bool:
    """Whether a resumed run's text is the one its checkpoint trained on: refused when it
    changed (the sampler's position would point into other text, and samples be trained twice
    or never), unless ``--data-changed``; then True."""
    if resumed is None:
        return False
    if resumed.sha256 is None:
        log(f"note: {resumed.checkpoint} records no digest of its training data (saved before "
            f"neox recorded one): {corpus.source} is used unchecked")
        return False
    old, new = resumed.sha256[:12], corpus.sha256[:12]
    if corpus.sha256 == resumed.sha256:
        if resumed.accept_change:
            log(f"data: --data-changed, but {corpus.source} is the text the run trained on "
                f"(sha256 {new}...): the run continues at its sampler's position")
        return False
    if not resumed.accept_change:
        raise nd.DataError(
            f"--resume: the training data changed: {corpus.source} (sha256 {new}...) is not the "
            f"text the run of {resumed.checkpoint} trained on (sha256 {old}...); restore it, or "
            f"pass --data-changed to continue the run on the new text")
    log(f"data: --data-changed: {corpus.source} differs from the text the run trained on "
        f"(sha256 {old}... -> {new}...): the weights, optimizer state and schedule continue from "
        f"the checkpoint; the data order restarts at the beginning of the current epoch, over "
        f"the new text's windows")
    return True


def prepare_data(data: DataConfig, model: ModelRecipe, *, rank: int, log: Log,
                 resumed: ResumedData | None = None) -> RunData:
    """Rank 0 prepares (downloads, trains the tokenizer, tokenises) into the cache first; the
    others then read the cache instead of repeating the work. A resumed run's text is checked
    against its checkpoint's (``check_data``) before anything is derived from it."""
    cache_dir = Path(data.cache_dir) if data.cache_dir else nd.default_cache_dir()

    def load() -> RunData:
        data_dir = Path(data.data_dir) if data.data_dir else nd.default_data_dir()
        corpus = nd.load_corpus(data.data, cache_dir=cache_dir, data_dir=data_dir, log=log)
        changed = check_data(corpus, resumed, log)
        tok_path = Path(data.tokenizer) if data.tokenizer else None
        if tok_path is None and model.checkpoint is not None and (
                Path(model.checkpoint) / TOKENIZER).is_file():
            tok_path = Path(model.checkpoint) / TOKENIZER
        if tok_path is None and changed:
            # The run's tokenizer was trained on the earlier text: a new one would not match
            # the embeddings. The run keeps a copy of it.
            if resumed.tokenizer_copy is None:
                raise nd.DataError(
                    f"--data-changed: the run of {resumed.checkpoint} trained its tokenizer on "
                    f"the earlier text, and its copy (tokenizer.json beside the checkpoints, "
                    f"matching the checkpoint's checksum) was not found; restore it")
            tok_path = resumed.tokenizer_copy
        tokenizer = nd.load_tokenizer(tok_path, corpus=corpus, cache_dir=cache_dir, log=log)
        dataset = nd.TokenDataset.from_corpus(corpus, tokenizer, seq_len=data.seq_len,
                                              cache_dir=cache_dir,
                                              val_fraction=data.val_fraction, log=log)
        return RunData(tokenizer, dataset, corpus, changed)

    first = zerocore.run_agreed(load if rank == 0 else (lambda: None))
    return zerocore.run_agreed(lambda: first if first is not None else load())


# -- the model ------------------------------------------------------------------------------------

def weights_source(model: ModelRecipe, tokenizer: Any) -> tuple[NeoXConfig, WeightsReader]:
    """The configuration and the reader the layers come from (pretrained weights, or the
    preset's seeded random initialisation)."""
    if model.checkpoint is not None:
        reader = open_weights(model.checkpoint, allow_outside=model.allow_outside_weights)
        config = reader.config
    else:
        config = preset_config(model.preset, tokenizer_rows=nd.tokenizer_rows(tokenizer))
        reader = RandomInit(config, seed=model.seed)
    nd.check_vocab(tokenizer, config.vocab_size)
    return config, reader


def source_layer(reader: WeightsReader, spec: LayerSpec, position: int,
                 mode: FinetuneMode) -> nn.Module | zerocore.MetaLayer:
    """One layer as the engine takes it, prepared for the fine-tuning mode: built on the meta
    device with a range reader when the weights' format allows (each rank then reads only its
    shard of it), materialised whole otherwise (random initialisation, old pickles)."""
    layer = meta_layer(reader, spec)
    if layer is None:
        return prepare_layer(materialize(reader, spec), position, mode)
    return zerocore.MetaLayer(prepare_layer(layer, position, mode),
                              functools.partial(reader.read_range, spec.kind, spec.source))


def stream_layers(reader: WeightsReader, config: NeoXConfig, model: ModelRecipe, *, log: Log,
                  ) -> Iterator[nn.Module | zerocore.MetaLayer]:
    """One layer at a time (the engine keeps only this rank's shard of it), saying so, so a
    large model's build shows progress. A layer that cannot be opened (missing file, wrong
    shape) is agreed on by all ranks before the engine's next collective."""
    specs = layer_specs(config, model.filter_layers)
    for i, spec in enumerate(specs):
        layer = zerocore.run_agreed(lambda: source_layer(reader, spec, i, model.finetune))
        module = layer.module if isinstance(layer, zerocore.MetaLayer) else layer
        n = sum(p.numel() for p in module.parameters())
        t = sum(p.numel() for p in module.parameters() if p.requires_grad)
        where = f" (checkpoint block {spec.source})" if spec.kind == "block" else ""
        log(f"  layer {i + 1}/{len(specs)}: {spec.kind}{where}, {n:,} parameters, "
            f"{t:,} trainable" + (", this rank's part read" if module is not layer else ""))
        yield layer
        del layer, module  # before the next one is read


def warmup_factor(warmup: int) -> Callable[[int], float]:
    """The learning rate's multiplier at scheduler step ``step``: linear warm-up, then 1."""
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


@dataclasses.dataclass
class TrainState:
    """Everything that changes as the run trains, and what it needs to save itself."""

    model: zerocore.ShardedSequential
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: zerocore.LossScaler
    sampler: nd.WindowSampler
    config: NeoXConfig                 # of the model the weights describe (all blocks)
    dtype: torch.dtype
    step: int = 0


def frozen_weights(model: ModelRecipe) -> zerocore.FrozenWeights:
    """The engine's policy for ``--frozen-weights``."""
    return zerocore.FrozenWeights("int8" if model.frozen_weights == "int8" else None)


def build(recipe: Recipe, data: RunData, *, device: torch.device, rank: int, world_size: int,
          log: Log, comm: zerocore.Comm = zerocore.Comm()) -> TrainState:
    """The sharded model, its optimizer, schedule, loss scaler and data sampler. comm: how the
    ranks exchange data, and the timeout of every wait (the launcher's --timeout)."""
    config, reader = zerocore.run_agreed(lambda: weights_source(recipe.model, data.tokenizer))
    dtype = resolve_dtype(recipe.model.dtype, device)
    mode = recipe.model.finetune
    kept = filtered_config(config, recipe.model.filter_layers).num_hidden_layers
    recompute = recompute_policy(layer_specs(config, recipe.model.filter_layers), recipe.loop)
    recomputed = ("" if recompute is None else
                  f"; activations of {sum(map(recompute.selects, range(kept + 3)))} block(s) "
                  f"recomputed in backward")
    int8 = ("; frozen weights held and gathered in int8"
            if recipe.model.frozen_weights == "int8" else "")
    log(f"model: {recipe.model.checkpoint or recipe.model.preset}, {config.num_hidden_layers} "
        f"blocks in the checkpoint, keeping {kept}; fine-tuning {mode.mode}; compute dtype "
        f"{str(dtype).removeprefix('torch.')}, gradients summed in {recipe.model.reduce_dtype}"
        f"{recomputed}{int8}; building layer by layer:")
    start = time.perf_counter()
    with reader:
        model = zerocore.shard(stream_layers(reader, config, recipe.model, log=log),
                               device=device,
                               mixed_precision=zerocore.MixedPrecision(
                                   param_dtype=dtype,
                                   reduce_dtype=DTYPES[recipe.model.reduce_dtype]),
                               offload=zerocore.Offload(optimizer=recipe.loop.offload_optimizer),
                               prefetch=zerocore.Prefetch(
                                   keep_gathered=recipe.loop.keep_gathered),
                               frozen_weights=frozen_weights(recipe.model),
                               recompute=recompute, comm=comm)
    log(f"built in {time.perf_counter() - start:.1f} s")
    if model.kept_layers:
        held = sum(model.layers[i].gathered_size for i in model.kept_layers)
        log(f"--keep-gathered {recipe.loop.keep_gathered}: {len(model.kept_layers)} of "
            f"{len(model.layers)} layers stay gathered ({held / 2**20:,.1f} MiB per rank; their "
            f"frozen weights are gathered once, their backward all-gathers skipped)")
    shards = model.trainable_shards()

    def check_trainable() -> None:
        if not shards:
            raise ValueError("nothing to train: the chosen layers and --finetune mode leave no "
                             "trainable parameter")
    zerocore.run_agreed(check_trainable)
    optim = recipe.optim
    optimizer = zerocore.optim.AdamW(shards, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                     weight_decay=optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_factor(optim.warmup))
    scaler = zerocore.LossScaler(model.group, dynamic=dtype == torch.float16,
                                 counter=model.counter)
    loop = recipe.loop
    sampler = zerocore.run_agreed(lambda: nd.WindowSampler(
        len(data.dataset.train), rank=rank, world_size=world_size, batch_size=loop.batch_size,
        seed=loop.seed))
    return TrainState(model, optimizer, scheduler, scaler, sampler, config, dtype)


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
    if recipe.model.frozen_weights == "int8":
        log("note: --frozen-weights int8: the frozen weights are held quantized, so they were "
            "not compared with the DeepSpeed run's; --checkpoint must be the base it trained on")
    log(f"resumed the DeepSpeed run of {checkpoint} at step {state.step} (DeepSpeed "
        f"{run['ds_version']}, {run['world_size']} ranks, {run['global_samples']} samples seen): "
        f"trained weights, Adam moments and step, loss scale; DeepSpeed saves no data order, so "
        f"the sampler starts at the beginning of epoch 0 (--seed {recipe.loop.seed}'s order): "
        f"samples the DeepSpeed run trained on may come again before the others")


# -- training -------------------------------------------------------------------------------------

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


def total_steps(state: TrainState, loop: LoopConfig) -> int:
    total = state.sampler.steps_until(loop.epochs) // loop.grad_accum + state.step
    return min(total, loop.max_steps) if loop.max_steps is not None else total


def check_finite_weights(state: TrainState, *, rank: int) -> None:
    """Refuses to go on (and so to save) when any trainable weight is NaN or infinite on any
    rank: a diverged run must never overwrite good checkpoints. Collective."""
    ok = all(bool(torch.isfinite(s).all()) for s in state.model.trainable_shards())
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


@dataclasses.dataclass
class StepsDone:
    first_step: int
    memory: zerocore.MemoryReport | None   # taken at the last step, gradients included
    comm: zerocore.CommReport
    measured: "MeasuredPeak | None" = None


@dataclasses.dataclass
class MeasuredPeak:
    """This rank's memory over the training steps after the first (``--measure-memory``)."""

    steps: int                   # steps measured
    state_bytes: int             # model state when the window opened (tensors)
    peak_bytes: int              # the most bytes of tensors at once beyond that
    rss_peak: int | None         # peak resident set over those steps
    rss_run_peak: int | None     # over the whole process (the build too)

    @property
    def total(self) -> int:
        return self.state_bytes + self.peak_bytes


class MemoryProbe:
    """``--measure-memory``: counts every tensor from before the model is built (so buffers the
    engine keeps count too); the window opens after the first step (nothing is created lazily
    any more) and closes with the last one."""

    def __init__(self, device: torch.device):
        self.peak = zerocore.PeakMemory(device)
        self.peak.__enter__()
        self.first_step: int | None = None
        self.state_bytes = 0
        self.rss_run_peak: int | None = None

    def after_step(self, state: "TrainState") -> None:
        if self.first_step is None:
            self.first_step = state.step
            self.state_bytes = state.model.memory_report(state.optimizer).model_state_bytes
            self.rss_run_peak = zerocore.peak_rss()
            zerocore.reset_peak_rss()
            self.peak.mark()

    def finish(self, step: int) -> MeasuredPeak | None:
        self.peak.__exit__(None, None, None)
        if self.first_step is None:
            return None
        rss = zerocore.peak_rss()
        return MeasuredPeak(step - self.first_step, self.state_bytes,
                            self.peak.peak_bytes - self.state_bytes, rss,
                            max(rss or 0, self.rss_run_peak or 0) or None)


def train(state: TrainState, recipe: Recipe, data: RunData, metrics: MetricsFile | None,
          run_id: str, *, device: torch.device, rank: int, world_size: int,
          log: Log, probe: MemoryProbe | None = None) -> StepsDone:
    """The optimizer steps, until the epochs or ``max_steps`` are done."""
    loop, total = recipe.loop, total_steps(state, recipe.loop)
    ds, model = data.dataset, state.model
    log(f"training {total - state.step} steps: {world_size} rank{'s' if world_size > 1 else ''} "
        f"x {loop.batch_size} sequences x {loop.grad_accum} micro-batch"
        f"{'es' if loop.grad_accum > 1 else ''} per step, lr {recipe.optim.lr}, warm-up "
        f"{recipe.optim.warmup}")
    progress = Progress(total, enabled=rank == 0)
    model.comm_report(reset=True)
    first_step, memory = state.step, None
    nonfinite = 0               # consecutive steps with a non-finite loss or gradient
    metrics_error: OutputDirError | None = None    # rank 0's, reported at the next step
    while state.step < total:
        start = time.perf_counter()
        # loss sum, correct, tokens, and whether rank 0 failed to write the last metrics line
        totals = torch.zeros(4, dtype=torch.float64, device=device)
        totals[3] = 1.0 if metrics_error is not None else 0.0
        for _ in range(loop.grad_accum):
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
        if loop.eval_every and state.step % loop.eval_every == 0 and state.step < total:
            record["val_loss"], record["val_acc"] = evaluate(
                model, ds.val, rank=rank, world_size=world_size, batch_size=loop.batch_size,
                device=device)
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
    return StepsDone(first_step, memory, model.comm_report(), measured)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


# -- finishing ------------------------------------------------------------------------------------

def write_trainable(state: TrainState, path: Path, *, rank: int) -> Path:
    """The trained parameters only (full tensors, fp32), in the file ``python -m
    zerocore.consolidate --trainable-only`` writes: small (proportional to what was trained).
    Only rank 0 gathers and holds them. Collective."""
    layers = list(state.model.iter_full_states(trainable_only=True, to_rank=0))
    zerocore.run_agreed(lambda: save_trainable(path, layers) if rank == 0 else None)
    return path


def export_hf(state: TrainState, recipe: Recipe, data: RunData, checkpoint: Path, *,
              rank: int) -> Path:
    """The fine-tuned model (kept layers only, LoRA merged) as a Hugging Face directory with the
    run's tokenizer, gathered one layer at a time to rank 0, which alone writes. Collective.
    With int8 frozen weights the engine holds quantized copies of them: rank 0 then takes the
    base weights and the trained tensors of ``checkpoint`` instead, as ``neox.export`` does."""
    model = recipe.model
    specs = layer_specs(state.config, model.filter_layers)
    built = filtered_config(state.config, model.filter_layers)
    out = Path(recipe.output.output_dir) / HF_EXPORT
    scaling = model.finetune.lora_scaling
    if model.frozen_weights == "int8":
        states = (((s.kind, s.index, merge_lora(full, scaling))
                   for s, full in trained_layers(checkpoint, log=lambda *_: None))
                  if rank == 0 else iter(()))
    else:
        states = ((s.kind, s.index, merge_lora(full, scaling)) for s, (_, full) in
                  zip(specs, state.model.iter_full_states(to_rank=0)))

    def write() -> None:
        if rank != 0:
            for _ in states:  # take part in every layer's gather
                pass
            return
        tok = Path(recipe.output.output_dir) / TOKENIZER  # written when the run started
        # A failed write is one CheckpointWriteError line naming the file (checkpoint.durable_io)
        save_hf(out, built, states, overwrite=True, extra_files={TOKENIZER: tok})
    zerocore.run_agreed(write)
    return out


def finish(state: TrainState, recipe: Recipe, data: RunData, done: StepsDone,
           metrics: MetricsFile | None, run_id: str, *, device: torch.device, rank: int,
           world_size: int, log: Log) -> None:
    """Validation, the reports, the final checkpoint and the results."""
    val_loss, val_acc = evaluate(state.model, data.dataset.val, rank=rank,
                                 world_size=world_size, batch_size=recipe.loop.batch_size,
                                 device=device)
    log(f"validation: loss {val_loss:.4f}, perplexity {math.exp(min(val_loss, 50)):.2f}, "
        f"accuracy {val_acc:.3f}")

    def close_metrics() -> None:
        if metrics is not None:
            metrics.write({"step": state.step, "val_loss": val_loss, "val_acc": val_acc})
            metrics.close()
    zerocore.run_agreed(close_metrics)
    if done.memory is not None:
        tables: list[Any] = [None] * world_size
        dist.all_gather_object(tables, done.memory.table())
        log("memory per rank (model state, measured vs (2+2+K)·Ψ/N_d):")
        for t in tables:
            log(t)
        log("communication this run:\n" + done.comm.table(steps=state.step - done.first_step))
    if recipe.output.measure_memory:
        report_measured(state, recipe, done.measured, device=device, world_size=world_size,
                        log=log)
    ckpt = save(state, recipe, data, run_id, rank=rank)
    trained = write_trainable(state, Path(recipe.output.output_dir) / TRAINABLE, rank=rank)
    log(f"saved: checkpoint {ckpt}")
    log(f"saved: trained parameters only {trained}")
    if recipe.output.export_hf:
        log(f"saved: Hugging Face export {export_hf(state, recipe, data, ckpt, rank=rank)}")
    if recipe.output.sample_tokens:
        log(sample_text(state, recipe, data, rank=rank))


def report_measured(state: TrainState, recipe: Recipe, measured: MeasuredPeak | None, *,
                    device: torch.device, world_size: int, log: Log) -> None:
    """Each rank's measured peak beside the plan of this run (neox.plan). Collective."""
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, measured)
    if every[0] is None:
        log("memory: not measured (the run had a single step; the first is not measured)")
        return
    plan = plan_run(request_from_recipe(recipe, state.config, world_size=world_size,
                                        device=device.type, dtype=state.dtype))
    planned = plan.device_peak
    mib = 2**20
    log(f"memory per rank over steps {state.step - every[0].steps + 1}-{state.step} (tensors, "
        f"{'torch.profiler allocation events' if device.type == 'cpu' else 'the CUDA allocator'}"
        f"; planned by neox.plan: {planned / mib:,.1f} MiB, peak at {plan.peak_phase}):")
    for rank, m in enumerate(every):
        rss = "" if m.rss_peak is None else (f"; peak RSS {m.rss_peak / mib:,.0f} MiB in these "
                                             f"steps, {m.rss_run_peak / mib:,.0f} MiB in the run")
        log(f"  rank {rank}: measured {m.total / mib:,.1f} MiB ({m.state_bytes / mib:,.1f} model "
            f"state + {m.peak_bytes / mib:,.1f} at the peak), planned / measured "
            f"{planned / m.total:.3f}{rss}")


# A short sample shows what the model learnt: continuing the first tokens of the validation
# text (held out, so not a memorised continuation), at a temperature that reads as text.
SAMPLE_PROMPT_TOKENS = 8
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40


def sample_text(state: TrainState, recipe: Recipe, data: RunData, *, rank: int) -> str:
    """A sample of ``recipe.output.sample_tokens`` tokens from the sharded model, as the lines
    to print. Collective."""
    prompt = data.dataset.val.windows[0][:SAMPLE_PROMPT_TOKENS].long()[None]   # (1, T)
    generator = torch.Generator().manual_seed(recipe.loop.seed)
    ids = sample_sharded(state.model, prompt.to(state.model.device),
                         new_tokens=recipe.output.sample_tokens,
                         temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K,
                         generator=generator, rank=rank, group=state.model.group)[0].tolist()
    start = data.tokenizer.decode(ids[:SAMPLE_PROMPT_TOKENS])
    text = data.tokenizer.decode(ids).lstrip(" ")
    body = "\n".join("  " + line for line in text.splitlines())
    return (f"sample ({recipe.output.sample_tokens} tokens, temperature {SAMPLE_TEMPERATURE}, "
            f"top-k {SAMPLE_TOP_K}) continuing {start!r} from the validation text:\n{body}")


def run_training(recipe: Recipe, *, resume: Path | None, run_id: str, rank: int,
                 world_size: int, device: torch.device, allow_unverified: bool = False,
                 data_changed: bool = False, deepspeed: Path | None = None,
                 comm: zerocore.Comm = zerocore.Comm()) -> None:
    """The whole run of one rank: from ``resume`` (a checkpoint directory, verified by
    neox.finetune before the launch, and again as it is loaded) when given, or continuing the
    DeepSpeed checkpoint ``deepspeed``. comm: as for ``build`` (give it the process group's
    timeout)."""
    log: Log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(recipe.loop.seed)
    resumed = None if resume is None else zerocore.run_agreed(lambda: resumed_data(
        resume, recipe, allow_unverified=allow_unverified, accept_change=data_changed))
    data = prepare_data(recipe.data, recipe.model, rank=rank, log=log, resumed=resumed)
    probe = MemoryProbe(device) if recipe.output.measure_memory else None
    state = build(recipe, data, device=device, rank=rank, world_size=world_size, log=log,
                  comm=comm)
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
