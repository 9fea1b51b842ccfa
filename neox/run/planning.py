"""The plan of a run before it runs: ``zerocore.plan`` of the very stack ``neox.run.build``
would build (the layers on the meta device, prepared for the fine-tuning mode; the step's loss
of ``neox.run.step``), for a recipe on a number of ranks. ``python -m neox.plan`` prints it;
``--measure-memory`` compares a run's measured peak with it."""

from __future__ import annotations

import dataclasses

import torch

import zerocore
from neox.config import NeoXConfig
from neox.dtypes import DTYPES
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import build_layer, layer_specs
from neox.run.recipe import LoopConfig, Recipe
from zerocore.policies import DEFAULT_POOL_BYTES
from neox.run.step import micro_batch_loss, recompute_policy

__all__ = ["PlanRequest", "plan_run", "request_from_recipe", "GiB", "DEFAULT_BPE_TOKENS"]

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
    offload: bool                         # the optimizer state in CPU memory
    recompute: tuple[int, ...]            # blocks recomputed (checkpoint indices)
    recompute_every: int
    world_size: int
    device: str                           # "cuda" or "cpu"
    keep_gathered: int | str = 0          # zerocore.Prefetch.keep_gathered
    frozen_weights: str | None = None     # zerocore.FrozenWeights.dtype: None or "int8"
    offload_params: bool = False          # the parameter shards in CPU memory
    # Where the offloaded halves live ("cpu" or "nvme": zerocore.Offload's devices), and the
    # host pool NVMe offload moves its chunks through.
    offload_device: str = "cpu"
    offload_pool: int = DEFAULT_POOL_BYTES
    # The ranks' layout (zerocore.plan's): HSDP's (nodes, ranks per node), or None (flat,
    # over ``nodes`` nodes); and HSDP's cross-node gradients in int8 (zerocore.Comm).
    mesh: tuple[int, int] | None = None
    nodes: int = 1
    quantize_gradients: str | None = None


def request_from_recipe(recipe: Recipe, config: NeoXConfig, *, world_size: int,
                        device: str, dtype: torch.dtype) -> PlanRequest:
    """The plan of a run of ``recipe`` on ``world_size`` ranks computing in ``dtype``."""
    loop = recipe.loop
    return PlanRequest(
        config=config, filter_layers=recipe.model.filter_layers, mode=recipe.model.finetune,
        dtype=dtype, reduce_dtype=DTYPES[recipe.model.reduce_dtype],
        batch_size=loop.batch_size, seq_len=recipe.data.seq_len, grad_accum=loop.grad_accum,
        offload=loop.offloaded_optimizer, offload_params=loop.offloaded_params,
        offload_device=loop.offload_device, offload_pool=loop.offload_pool,
        recompute=loop.activation_checkpointing,
        recompute_every=loop.activation_checkpointing_every, world_size=world_size,
        device=device, keep_gathered=loop.keep_gathered,
        frozen_weights=recipe.model.frozen_weights)


# Where a plan says NVMe offload's scratch would be: it writes nothing, so any path will do.
PLANNED_PATH = "(planned)"


def offload_of(r: PlanRequest) -> zerocore.Offload:
    """The request's ``zerocore.Offload``: each half it offloads, on its device."""
    device = r.offload_device
    return zerocore.Offload(optimizer=device if r.offload else False,
                            params=device if r.offload_params else False,
                            path=PLANNED_PATH if device == "nvme" else None,
                            pool_bytes=r.offload_pool)


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
        offload=offload_of(r),
        prefetch=zerocore.Prefetch(keep_gathered=r.keep_gathered),
        frozen_weights=zerocore.FrozenWeights(r.frozen_weights),
        recompute=recompute_policy(specs, loop), micro_batches=r.grad_accum, mesh=r.mesh,
        nodes=r.nodes, comm=zerocore.Comm(quantize_gradients=r.quantize_gradients))
