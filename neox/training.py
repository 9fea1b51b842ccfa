"""The fine-tuning run of one rank: data, the sharded model, the loop, checkpoints, results.

Called by ``neox.finetune`` in every process once the process group exists. Rank 0 prints and
writes the shared files (metrics JSONL, results); every rank takes part in every collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerocore
from neox import data as nd
from neox.weights import RandomInit, iter_layers, open_weights
from neox.config import PRESETS, NeoXConfig
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.weights import save_hf
from neox.lora import merge_lora
from neox.model import layer_specs
from neox.progress import Progress

# The tiny preset's vocabulary is the tokenizer's, rounded up as GPT-NeoX pads its embedding.
VOCAB_MULTIPLE = 128

# What a user can cause (a bad file, flag or checkpoint): reported as one line, no traceback.
# DataError and CheckpointError are ValueErrors.
USER_ERRORS = (ValueError, FileNotFoundError)

T = TypeVar("T")


class PeerFailed(Exception):
    """Another rank hit a user error during set-up and reports it; this rank stops quietly."""


def agree(fn: Callable[[], T], *, rank: int) -> T:
    """Runs ``fn`` on every rank, then lets the ranks agree on the outcome. Collective.

    Without this, a user error on one rank (rank 0 prepares the data alone) leaves the others
    waiting in their next collective until the failed process disappears, and then they fail
    with a gloo/NCCL traceback that buries the real message. Here every rank learns of the error:
    the lowest rank with each distinct message raises it (so identical errors on every rank are
    reported once), the others raise ``PeerFailed``.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except USER_ERRORS as e:
        error = e
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    if any(m is not None for m in messages):
        if error is not None and messages.index(str(error)) == rank:
            raise error
        failed = [r for r, m in enumerate(messages) if m is not None]
        raise PeerFailed(f"rank(s) {failed} failed")
    return result  # type: ignore[return-value]


@dataclasses.dataclass
class RunData:
    tokenizer: Any
    dataset: nd.TokenDataset
    corpus: nd.Corpus


def prepare_data(args: argparse.Namespace, rank: int, log: Callable[..., None]) -> RunData:
    """Rank 0 prepares (downloads, trains the tokenizer, tokenises) into the cache first; the
    others then read the cache instead of repeating the work."""
    def load() -> RunData:
        data_dir = args.data_dir or nd.default_data_dir()
        corpus = nd.load_corpus(args.data, cache_dir=args.cache_dir, data_dir=data_dir, log=log)
        tok_path = args.tokenizer
        if tok_path is None and args.checkpoint is not None and (
                Path(args.checkpoint) / "tokenizer.json").is_file():
            tok_path = Path(args.checkpoint) / "tokenizer.json"
        tokenizer = nd.load_tokenizer(tok_path, corpus=corpus, cache_dir=args.cache_dir, log=log)
        dataset = nd.TokenDataset.from_corpus(corpus, tokenizer, seq_len=args.seq_len,
                                              cache_dir=args.cache_dir,
                                              val_fraction=args.val_fraction, log=log)
        return RunData(tokenizer, dataset, corpus)

    first = agree(load if rank == 0 else (lambda: None), rank=rank)
    return agree(lambda: first if first is not None else load(), rank=rank)


def model_config(args: argparse.Namespace, tokenizer: Any) -> tuple[NeoXConfig, Any]:
    """The configuration and the reader the layers come from (a checkpoint or a random init)."""
    if args.checkpoint is not None:
        reader = open_weights(args.checkpoint)
        config = reader.config
    else:
        if args.model not in PRESETS:
            raise ValueError(f"unknown --model {args.model!r}; presets: {sorted(PRESETS)}")
        config = PRESETS[args.model]
        if args.model == "tiny":
            rows = nd.tokenizer_rows(tokenizer)
            config = dataclasses.replace(
                config, vocab_size=-(-rows // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
        reader = RandomInit(config, seed=args.seed)
    nd.check_vocab(tokenizer, config.vocab_size)
    if args.filter_layers is not None and not isinstance(args.filter_layers, list):
        args.filter_layers = list(args.filter_layers.blocks(config.num_hidden_layers))
    return config, reader


def stream_layers(reader: Any, config: NeoXConfig, args: argparse.Namespace,
                  mode: FinetuneMode, log: Callable[..., None], rank: int,
                  ) -> Iterator[nn.Module]:
    """Materialises one layer at a time (the engine keeps only this rank's shard of it) and
    says so, so a large model's build shows progress. A layer that cannot be read (missing file,
    wrong shape) is agreed on by all ranks before the engine's next collective."""
    specs = layer_specs(config, args.filter_layers)
    layers = iter_layers(reader, filter_layers=args.filter_layers)
    for i, spec in enumerate(specs):
        layer = agree(lambda: prepare_layer(next(layers), i, mode), rank=rank)
        n = sum(p.numel() for p in layer.parameters())
        t = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        where = f" (checkpoint block {spec.source})" if spec.kind == "block" else ""
        log(f"  layer {i + 1}/{len(specs)}: {spec.kind}{where}, {n:,} parameters, "
            f"{t:,} trainable")
        yield layer


def lr_lambda(warmup: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


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


def run_training(args: argparse.Namespace, *, rank: int, world_size: int,
                 device: torch.device) -> None:
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    run = prepare_data(args, rank, log)
    ds = run.dataset
    config, reader = agree(lambda: model_config(args, run.tokenizer), rank=rank)
    dtype = _dtype(args, device)
    mode = FinetuneMode(args.finetune, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                        lora_targets=tuple(t.strip() for t in args.lora_targets.split(",")),
                        seed=args.seed)
    log(f"model: {args.checkpoint or args.model}, {config.num_hidden_layers} blocks in the "
        f"checkpoint, keeping {len(layer_specs(config, args.filter_layers)) - 3}; fine-tuning "
        f"{mode.mode}; compute dtype {str(dtype).removeprefix('torch.')}; building layer by layer:")
    layers = stream_layers(reader, config, args, mode, log, rank)
    model = zerocore.shard(layers, device=device,
                           mixed_precision=zerocore.MixedPrecision(param_dtype=dtype),
                           offload=zerocore.Offload(optimizer=args.offload_optimizer))
    shards = model.trainable_shards()

    def check_trainable() -> None:
        if not shards:
            raise ValueError("nothing to train: the chosen layers and --finetune mode leave no "
                             "trainable parameter")
    agree(check_trainable, rank=rank)
    optimizer = zerocore.optim.AdamW(shards, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup))
    scaler = zerocore.LossScaler(model.group, dynamic=dtype == torch.float16,
                                 counter=model.counter)
    sampler = agree(lambda: nd.WindowSampler(len(ds.train), rank=rank, world_size=world_size,
                                             batch_size=args.batch_size, seed=args.seed),
                    rank=rank)
    out_dir = Path(args.output_dir)
    ckpt_root = out_dir / "checkpoints"
    step = 0
    if args.resume is not None:
        path = agree(lambda: _resume_path(Path(args.resume)), rank=rank)
        extra = zerocore.load_checkpoint(path, model, optimizer, scaler=scaler)
        step = extra["step"]
        sampler.load_state_dict(extra["sampler"])
        scheduler.load_state_dict(extra["scheduler"])
        log(f"resumed from {path} at step {step} (epoch {sampler.epoch}, "
            f"batch {sampler.batches_done})")
    total = sampler.steps_until(args.epochs) // args.grad_accum + step
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    # A resumed run continues the file; a fresh run into an old output directory replaces it,
    # so the file always holds this run's steps and nothing else.
    metrics_file = (open(out_dir / "metrics.jsonl", "a" if args.resume is not None else "w")
                    if rank == 0 else None)
    log(f"training {total - step} steps: {world_size} ranks x {args.batch_size} sequences x "
        f"{args.grad_accum} micro-batches per step, lr {args.lr}, warm-up {args.warmup}")
    progress = Progress(total, enabled=rank == 0)
    model.comm_report(reset=True)
    first_step = step

    def save(at: int) -> Path:
        extra = {"step": at, "sampler": sampler.state_dict(),
                 "scheduler": scheduler.state_dict(), "args": _jsonable(vars(args)),
                 "config": config.to_hf_dict()}  # what neox.export needs to rebuild the model
        return zerocore.save_checkpoint(ckpt_root, at, model, optimizer, scaler=scaler,
                                        extra=extra, keep_last=args.keep_last)

    while step < total:
        start = time.perf_counter()
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        for _ in range(args.grad_accum):
            x, y = nd.batch(ds.train, sampler.next_batch(), device=device)
            logits = model(x).float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            scaler.scale(loss / args.grad_accum).backward()
            with torch.no_grad():
                totals[0] += loss.detach() * y.numel()
                totals[1] += (logits.argmax(-1) == y).sum()
                totals[2] += y.numel()
        result = scaler.step(optimizer, max_norm=args.clip or None)
        if not result.skipped:
            scheduler.step()
        if step == total - 1:
            memory = model.memory_report(optimizer)  # before zero_grad: gradients included
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(totals)
        step += 1
        elapsed = time.perf_counter() - start
        record = {"step": step, "loss": (totals[0] / totals[2]).item(),
                  "acc": (totals[1] / totals[2]).item(), "lr": scheduler.get_last_lr()[0],
                  "loss_scale": result.loss_scale, "grad_norm": result.grad_norm,
                  "skipped": result.skipped, "tokens_per_s": totals[2].item() / elapsed,
                  "epoch": sampler.epoch}
        if args.eval_every and step % args.eval_every == 0 and step < total:
            record["val_loss"], record["val_acc"] = evaluate(
                model, ds.val, rank=rank, world_size=world_size, batch_size=args.batch_size,
                device=device)
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        progress.update(step, f"loss {record['loss']:.4f} acc {record['acc']:.3f} "
                              f"lr {record['lr']:.2e} scale {record['loss_scale']:g} "
                              f"{record['tokens_per_s']:,.0f} tok/s"
                              + (" (skipped: overflow)" if result.skipped else ""))
        if args.save_every and step % args.save_every == 0 and step < total:
            save(step)
    progress.close()
    comm = model.comm_report()  # the training steps' traffic, before evaluation adds its own

    val_loss, val_acc = evaluate(model, ds.val, rank=rank, world_size=world_size,
                                 batch_size=args.batch_size, device=device)
    log(f"validation: loss {val_loss:.4f}, perplexity {math.exp(min(val_loss, 50)):.2f}, "
        f"accuracy {val_acc:.3f}")
    if metrics_file is not None:
        metrics_file.write(json.dumps({"step": step, "val_loss": val_loss,
                                       "val_acc": val_acc}) + "\n")
        metrics_file.close()
    if total > 0 and step == total and "memory" in locals():
        tables: list[Any] = [None] * world_size
        dist.all_gather_object(tables, memory.table())
        log("memory per rank (model state, measured vs (2+2+K)·Ψ/N_d):")
        for t in tables:
            log(t)
        log("communication this run:\n" + comm.table(steps=total - first_step))
    ckpt = save(step)
    trained = _save_trainable(model, out_dir / "trainable.safetensors", rank)
    log(f"saved: checkpoint {ckpt}")
    log(f"saved: trained parameters only {trained}")
    if args.export_hf:
        hf_dir = _export_hf(model, config, args, run, rank)
        log(f"saved: Hugging Face export {hf_dir}")


def _dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    from neox.cli import DTYPES
    if args.dtype is not None:
        return DTYPES[args.dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _resume_path(resume: Path) -> Path:
    """The checkpoint ``--resume`` names: a step directory itself, or the latest in a folder."""
    if (resume / zerocore.checkpoint.MANIFEST).is_file():
        return resume
    path = zerocore.latest_checkpoint(resume)
    if path is None:
        raise ValueError(f"--resume {resume}: no checkpoint there (expected a step-XXXXXXXX "
                         f"directory with a manifest.json, or a folder of them)")
    return path


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _save_trainable(model: zerocore.ShardedSequential, path: Path, rank: int) -> Path:
    """The trained parameters only (full tensors, fp32), named ``layers.<i>.<name>``: small
    (proportional to what was trained). Collective."""
    from safetensors.torch import save_file
    tensors: dict[str, torch.Tensor] = {}
    for layer in model.layers:
        for name, t in layer.full_state(trainable_only=True).items():
            tensors[f"layers.{layer.index}.{name}"] = t
    if rank == 0:
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
    dist.barrier()
    return path


def _export_hf(model: zerocore.ShardedSequential, config: NeoXConfig, args: argparse.Namespace,
               run: RunData, rank: int) -> Path:
    """The fine-tuned model (kept layers only, LoRA merged) as a Hugging Face directory, gathered
    one layer at a time. Collective."""
    specs = layer_specs(config, args.filter_layers)
    built = dataclasses.replace(config, num_hidden_layers=len(specs) - 3)
    scaling = args.lora_alpha / args.lora_rank
    states = ((s.kind, s.index, merge_lora(layer.full_state(), scaling))
              for s, layer in zip(specs, model.layers))
    out = Path(args.output_dir) / "hf"
    if rank == 0:
        tok = Path(args.output_dir) / "tokenizer.json"
        run.tokenizer.save(str(tok))
        save_hf(out, built, states, overwrite=True, extra_files={"tokenizer.json": tok})
    else:
        for _ in states:
            pass
    dist.barrier()
    return out
