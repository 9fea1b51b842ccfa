"""Building a run's sharded model layer by layer, with its optimizer, schedule, loss scaler and
data sampler (``TrainState``): the weights it starts from (pretrained, or a preset's seeded
random initialisation), each layer read as this rank's part where the format allows."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

import zerocore
from neox import data as nd
from neox.config import NeoXConfig, filtered_config, preset_config
from neox.dtypes import resolve_dtype
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import LayerSpec, layer_specs
from neox.weights import RandomInit, WeightsReader, materialize, meta_layer, open_weights
from neox.run.layout import layout_line
from neox.run.recipe import ModelRecipe, Recipe
from neox.run.progress import Log
from neox.run.run_data import RunData


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
    nodes: int = 1                     # the run's nodes (torchrun's, or --nodes)


def build(recipe: Recipe, data: RunData, *, device: torch.device, rank: int, world_size: int,
          log: Log, comm: zerocore.Comm = zerocore.Comm(), nodes: int = 1) -> TrainState:
    """The sharded model, its optimizer, schedule, loss scaler and data sampler. comm: how the
    ranks exchange data, and the timeout of every wait (the launcher's --timeout). nodes: the
    run's (torchrun's, or --nodes), which --hybrid shards within."""
    config, reader = zerocore.run_agreed(lambda: weights_source(recipe.model, data.tokenizer))
    dtype = resolve_dtype(recipe.model.dtype, device)
    mode = recipe.model.finetune
    specs = layer_specs(config, recipe.model.filter_layers)
    sharding = recipe.sharding.policies(dtype=dtype, specs=specs)
    recompute, kept = sharding["recompute"], filtered_config(config, recipe.model.filter_layers)
    recomputed = ("" if recompute is None else
                  f"; activations of {sum(map(recompute.selects, range(len(specs))))} block(s) "
                  f"recomputed in backward")
    log(f"model: {recipe.model.checkpoint or recipe.model.preset}, {config.num_hidden_layers} "
        f"blocks in the checkpoint, keeping {kept.num_hidden_layers}; fine-tuning {mode.mode}; "
        f"compute dtype {str(dtype).removeprefix('torch.')}, gradients summed in "
        f"{recipe.sharding.reduce_dtype}{recomputed}{recipe.sharding.words()}"
        f"{recipe.offload.words()}{recipe.layout.words()}; building layer by layer:")
    start = time.perf_counter()
    with reader:
        model = zerocore.shard(stream_layers(reader, config, recipe.model, log=log),
                               device=device, **sharding, **recipe.offload.policies(),
                               **recipe.layout.policies(nodes=nodes, device_type=device.type,
                                                        comm=comm))
    log(f"built in {time.perf_counter() - start:.1f} s")
    if recipe.layout.hybrid is not None or nodes > 1:
        log(layout_line(recipe.layout, model.ways.line(), nodes=nodes, world_size=world_size))
    if model.kept_layers:
        held = sum(model.layers[i].gathered_size for i in model.kept_layers)
        log(f"--keep-gathered {recipe.sharding.keep_gathered}: {len(model.kept_layers)} of "
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
    training = recipe.training
    sampler = zerocore.run_agreed(lambda: nd.WindowSampler(
        len(data.dataset.train), rank=rank, world_size=world_size, batch_size=training.batch_size,
        seed=training.seed))
    return TrainState(model, optimizer, scheduler, scaler, sampler, config, dtype, nodes=nodes)
