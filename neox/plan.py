"""python -m neox.plan: what a neox.finetune run needs per GPU, and what it moves, before the
machines are rented.

It takes neox.finetune's own model, fine-tuning and step flags (the same names, defaults and
meanings: they are defined once, in neox.cli) plus the machines (--gpus per node, --nodes,
--gpu-memory) and prints, per rank: the shards of parameters, gradients, fp32 masters and Adam
state (trainable and frozen apart), the layers gathered at the peak, the activations with and
without recomputation (of the attention kernel that runs: fused, no T x T weights), the CUDA
allocator's headroom, the total against the GPU's memory, and the bytes all-gathered and
reduce-scattered per optimizer step. A --checkpoint is opened for its configuration and tensor
shapes only; no weights are read. The numbers come from ``zerocore.plan``, which runs the
step's schedule on fake tensors; on the CPU it agrees with measured runs
(tests/engine/test_plan.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import torch

import zerocore
from neox.cli import (DTYPES, HelpFormatter, Parser, UsageError, add_mode_arguments,
                      add_model_arguments, add_step_arguments, auto_mode, finite_float,
                      parse_layers, positive_int, preset_config, recompute_blocks, ALL_BLOCKS)
from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import build_layer, layer_specs
from neox.recipe import LoopConfig, Recipe
from neox.step import micro_batch_loss, recompute_policy
from neox.weights import WeightsError, open_weights

__all__ = ["PlanRequest", "plan_run", "request_from_recipe", "build_parser", "main"]

GiB = 2**30
# The tiny preset takes its vocabulary from the tokenizer a run trains (neox.data's byte-level
# BPE, 8192 tokens unless told otherwise); every other preset and checkpoint has its own.
DEFAULT_BPE_TOKENS = 8192


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One run to plan: the model (all blocks), which are kept and trained, and the step."""

    config: NeoXConfig
    filter_layers: tuple[int, ...] | None
    mode: FinetuneMode
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    batch_size: int
    seq_len: int
    grad_accum: int
    offload: bool
    recompute: tuple[int, ...]            # blocks recomputed (checkpoint indices)
    recompute_every: int
    world_size: int
    device: str                           # "cuda" or "cpu"
    keep_gathered: int | str = 0          # zerocore.Prefetch.keep_gathered
    frozen_weights: str = "compute"       # "compute" or "int8" (zerocore.FrozenWeights)


def request_from_recipe(recipe: Recipe, config: NeoXConfig, *, world_size: int,
                        device: str, dtype: torch.dtype) -> PlanRequest:
    """The plan of a run of ``recipe`` on ``world_size`` ranks computing in ``dtype``."""
    loop = recipe.loop
    return PlanRequest(
        config=config, filter_layers=recipe.model.filter_layers, mode=recipe.model.finetune,
        dtype=dtype, reduce_dtype=DTYPES[recipe.model.reduce_dtype],
        batch_size=loop.batch_size, seq_len=recipe.data.seq_len, grad_accum=loop.grad_accum,
        offload=loop.offload_optimizer, recompute=loop.activation_checkpointing,
        recompute_every=loop.activation_checkpointing_every, world_size=world_size,
        device=device, keep_gathered=loop.keep_gathered,
        frozen_weights=recipe.model.frozen_weights)


def plan_run(request: PlanRequest, *, recompute: tuple[int, ...] | None = None
             ) -> zerocore.plan.MemoryPlan:
    """``zerocore.plan`` of the stack neox.finetune would build for ``request`` (blocks
    recomputed: ``recompute`` when given, else the request's)."""
    r = request
    specs = layer_specs(r.config, r.filter_layers)
    loop = LoopConfig(activation_checkpointing=r.recompute if recompute is None else recompute,
                      activation_checkpointing_every=r.recompute_every)
    # The layers as the run gives them to the engine: on the meta device, prepared for the
    # mode (LoRA adapters are created for real: they are small).
    layers = [prepare_layer(build_layer(s.kind, r.config, device="meta"), i, r.mode)
              for i, s in enumerate(specs)]
    ids = torch.empty(r.batch_size, r.seq_len, dtype=torch.long, device="meta")

    def loss(logits: torch.Tensor) -> torch.Tensor:
        # Called on fake tensors: the targets are made there too.
        return micro_batch_loss(logits, torch.zeros(r.batch_size, r.seq_len,
                                                    dtype=torch.long))[0]

    return zerocore.plan.plan(
        layers, ids, world_size=r.world_size, loss=loss, device=r.device,
        mixed_precision=zerocore.MixedPrecision(param_dtype=r.dtype, reduce_dtype=r.reduce_dtype),
        offload=zerocore.Offload(optimizer=r.offload),
        prefetch=zerocore.Prefetch(keep_gathered=r.keep_gathered),
        frozen_weights=zerocore.FrozenWeights("int8" if r.frozen_weights == "int8" else None),
        recompute=recompute_policy(specs, loop), micro_batches=r.grad_accum)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m neox.plan", description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    add_model_arguments(p, for_training=True)
    add_mode_arguments(p)
    add_step_arguments(p)
    m = p.add_argument_group("the machines")
    m.add_argument("--gpus", type=positive_int, default=8,
                   help="GPUs per node (one rank each)")
    m.add_argument("--nodes", type=positive_int, default=1, help="nodes")
    m.add_argument("--gpu-memory", type=finite_float, default=80.0, metavar="GIB",
                   help="memory of one GPU in GiB (80: A100/H100 80GB; 141: H200)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="plan GPU ranks (NCCL) or CPU processes (gloo, as neox.finetune --cpu "
                        "runs them; --gpus is then the process count)")
    m.add_argument("--vocab-size", type=positive_int, default=DEFAULT_BPE_TOKENS,
                   help="the tiny preset's vocabulary: its run takes the tokenizer's (the BPE "
                        "a run trains by default has 8192 tokens)")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    return p


def _request(args: argparse.Namespace) -> PlanRequest:
    """The run the flags describe, checked; ``UsageError`` with the flag's name otherwise."""
    if args.checkpoint is not None:
        try:
            with open_weights(args.checkpoint,
                              allow_outside=args.allow_outside_weights) as reader:
                config = reader.config
        except WeightsError as e:
            raise UsageError(f"--checkpoint: {e}") from None
    else:
        config = preset_config(args.model, tokenizer_rows=args.vocab_size)
    ranges = parse_layers(args.filter_layers)
    kept = ranges.blocks(config.num_hidden_layers) if ranges is not None else None
    all_kept = kept if kept is not None else tuple(range(config.num_hidden_layers))
    choice = args.activation_checkpointing
    if choice is not None and choice != ALL_BLOCKS:
        choice = parse_layers(choice, flag="--activation-checkpointing").blocks(
            config.num_hidden_layers)
    mode_name = (auto_mode(has_weights=args.checkpoint is not None)
                 if args.finetune == "auto" else args.finetune)
    try:
        mode = FinetuneMode(mode_name, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                            lora_targets=tuple(t.strip() for t in args.lora_targets.split(",")
                                               if t.strip()), seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.gpu_memory <= 0:
        raise UsageError(f"--gpu-memory {args.gpu_memory:g}: must be a number of GiB above 0")
    default_dtype = "bf16" if args.device == "cuda" else "fp32"  # neox.finetune's defaults
    return PlanRequest(
        config=config, filter_layers=kept, mode=mode,
        dtype=DTYPES[args.dtype or default_dtype], reduce_dtype=DTYPES[args.reduce_dtype],
        batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        offload=args.offload_optimizer, recompute=recompute_blocks(choice, all_kept),
        recompute_every=args.activation_checkpointing_every, keep_gathered=args.keep_gathered,
        frozen_weights=args.frozen_weights,
        world_size=args.gpus * args.nodes, device=args.device)


def _as_dict(plan: zerocore.plan.MemoryPlan) -> dict[str, Any]:
    s = plan.state
    return {"trainable_numel": s.trainable_numel, "frozen_numel": s.frozen_numel,
            "state": s.bytes_of(), "on_host": sorted(s.on_host), "peak": plan.peak,
            "peak_phase": plan.peak_phase, "device_peak": plan.device_peak,
            "headroom": plan.headroom, "peak_bytes": plan.peak_bytes,
            "host_peak": plan.host_peak, "activations_peak": plan.activations_peak,
            "gathered_peak": plan.gathered_peak, "all_gather_bytes": plan.all_gather_bytes,
            "reduce_scatter_bytes": plan.reduce_scatter_bytes,
            "recomputed_layers": list(plan.recomputed_layers)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        request = _request(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chosen = plan_run(request)
    # The other side of the trade: without recomputation when it is on, with it on every
    # kept block when it is off.
    kept = request.filter_layers or tuple(range(request.config.num_hidden_layers))
    other = plan_run(request, recompute=() if request.recompute else kept)
    memory = int(args.gpu_memory * GiB)
    if args.json:
        print(json.dumps({"plan": _as_dict(chosen), "other_recompute": _as_dict(other),
                          "device_memory": memory}))
        return 0
    r = request
    blocks = len(kept)
    what = args.checkpoint or args.model
    recomputed = (f"{len(chosen.recomputed_layers)} of {blocks} blocks recomputed"
                  if r.recompute else "no recomputation")
    print(f"{what}: {blocks} of {r.config.num_hidden_layers} blocks, fine-tuning "
          f"{r.mode.mode}, {str(r.dtype).removeprefix('torch.')} compute, gradients reduced "
          f"in {str(r.reduce_dtype).removeprefix('torch.')}; {r.batch_size} x {r.seq_len} "
          f"tokens per rank and micro-batch, {r.grad_accum} micro-batch(es) per step; "
          f"{recomputed}; optimizer {'offloaded to the host' if r.offload else 'on the device'}"
          + (f"; --keep-gathered {r.keep_gathered}" if r.keep_gathered else "")
          + ("; frozen weights in int8" if r.frozen_weights == "int8" else ""))
    print(f"{r.world_size} ranks ({args.gpus} {'GPUs' if r.device == 'cuda' else 'processes'} "
          f"x {args.nodes} node(s)), {args.gpu_memory:g} GiB each")
    print(chosen.table(memory if r.device == "cuda" else None))
    label = "without recomputation" if r.recompute else "recomputing every kept block"
    print(f"{label}: activations at the peak {other.peak['activations'] / GiB:.2f} GiB, total "
          f"{other.peak_bytes / GiB:.2f} GiB"
          + (f" ({'fits' if other.peak_bytes <= memory else 'does NOT fit'})"
             if r.device == "cuda" else ""))
    if chosen.host_peak:
        print(f"host memory per node for the offloaded state: "
              f"{chosen.host_peak * args.gpus / GiB:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
