"""The plan of a run before it runs: ``zerocore.plan`` of the very stack ``neox.run.build``
would build (the layers on the meta device, prepared for the fine-tuning mode; the step's loss
of ``neox.run.step``), for a recipe on a number of ranks. ``python -m neox.plan`` prints it;
``--measure-memory`` compares a run's measured peak with it."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

import zerocore
from neox.config import NeoXConfig
from neox.dtypes import DTYPES
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import build_layer, layer_specs
from neox.run.recipe import HYBRIDS, Recipe, ShardingConfig
from neox.run.step import micro_batch_loss

__all__ = ["PlanRequest", "plan_run", "request_from_recipe", "GiB", "DEFAULT_BPE_TOKENS",
           "Layout", "LAYOUTS", "on_layout", "LayoutRow", "compare_layouts", "layouts_table",
           "offload_of", "HOST_SPARE", "needs", "fits"]

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
    frozen_weights: str | None = None     # zerocore.FrozenWeights.dtype: None, "int8", ...
    frozen_placement: str = "sharded"     # zerocore.FrozenWeights.placement
    offload_params: bool = False          # the parameter shards in CPU memory
    # Where the offloaded halves live ("cpu" or "nvme": zerocore.Offload's devices), and the
    # host pool NVMe offload moves its chunks through (None: chosen from ``host_memory`` and
    # the ranks of a node, as the run chooses it: zerocore.auto_pool_bytes).
    offload_device: str = "cpu"
    offload_pool: int | None = None
    offload_overlap: str = "exact"        # zerocore.Offload.overlap: whether the pass overlaps
    # The ranks' layout (zerocore.plan's): a 2-D mesh's (nodes, ranks per node), or None
    # (flat, over ``nodes`` nodes); the cross-node gradients in int8 (zerocore.Comm); and how
    # the mesh shares the model (zerocore.Hybrid's layout: None or "hsdp", or "hpz").
    mesh: tuple[int, int] | None = None
    nodes: int = 1
    quantize_gradients: str | None = None
    hybrid: str | None = None
    # Whether the plan counts the step's FLOPs (zerocore.plan's count_flops): only the layout
    # choice's step time (neox.plan --link) reads them, and counting slows every plan.
    count_flops: bool = False
    # The physical memory of a node's host in bytes (neox.plan --host-memory), which the NVMe
    # pool is chosen from; None: this machine's.
    host_memory: int | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the ranks share the model across nodes, as a run's --hybrid and
    --quantize-gradients say it."""

    hybrid: str | None = None              # neox.run.recipe.HYBRIDS, or None: flat
    quantize_gradients: str | None = None  # "int8" (qgZ), with a hybrid layout only

    @property
    def name(self) -> str:
        name = "flat" if self.hybrid is None else {"hsdp": "HSDP", "hpz": "hpZ"}[self.hybrid]
        return name + (f" + qgZ {self.quantize_gradients}" if self.quantize_gradients else "")


# The layouts ``compare_layouts`` plans: flat, and each hybrid one exact and with qgZ.
LAYOUTS = (Layout(),) + tuple(Layout(h, q) for h in HYBRIDS for q in (None, "int8"))


def on_layout(request: PlanRequest, layout: Layout, nodes: int) -> PlanRequest:
    """``request`` on ``nodes`` nodes of ``request.world_size // nodes`` ranks, laid out so."""
    hybrid = layout.hybrid is not None
    return dataclasses.replace(
        request, mesh=(nodes, request.world_size // nodes) if hybrid else None,
        nodes=1 if hybrid else nodes, quantize_gradients=layout.quantize_gradients,
        hybrid=layout.hybrid)


def request_from_recipe(recipe: Recipe, config: NeoXConfig, *, world_size: int,
                        device: str, dtype: torch.dtype, nodes: int = 1,
                        host_memory: int | None = None) -> PlanRequest:
    """The plan of a run of ``recipe`` on ``world_size`` ranks computing in ``dtype``, on
    ``nodes`` nodes laid out as the recipe says (--hybrid, --quantize-gradients), each of
    ``host_memory`` bytes (None: this machine's)."""
    training, sharding, offload = recipe.training, recipe.sharding, recipe.offload
    request = PlanRequest(
        config=config, filter_layers=recipe.model.filter_layers, mode=recipe.model.finetune,
        dtype=dtype, reduce_dtype=DTYPES[sharding.reduce_dtype],
        batch_size=training.batch_size, seq_len=recipe.data.seq_len,
        grad_accum=training.grad_accum, offload=offload.offloaded_optimizer,
        offload_params=offload.offloaded_params, offload_device=offload.offload_device,
        offload_pool=offload.offload_pool, offload_overlap=offload.offload_overlap,
        recompute=sharding.activation_checkpointing,
        recompute_every=sharding.activation_checkpointing_every, world_size=world_size,
        device=device, keep_gathered=sharding.keep_gathered,
        frozen_weights=sharding.frozen_weights, frozen_placement=sharding.frozen_placement,
        host_memory=host_memory)
    return on_layout(request, Layout(recipe.layout.hybrid, recipe.layout.quantize_gradients),
                     nodes)


# Where a plan says NVMe offload's scratch would be: it writes nothing, so any path will do.
PLANNED_PATH = "(planned)"


def offload_of(r: PlanRequest) -> zerocore.Offload:
    """The request's ``zerocore.Offload``: each half it offloads, on its device."""
    device = r.offload_device
    return zerocore.Offload(optimizer=device if r.offload else False,
                            params=device if r.offload_params else False,
                            path=PLANNED_PATH if device == "nvme" else None,
                            pool_bytes=r.offload_pool, overlap=r.offload_overlap)


def plan_run(request: PlanRequest, *, recompute: tuple[int, ...] | None = None
             ) -> zerocore.plan.MemoryPlan:
    """``zerocore.plan`` of the stack neox.finetune would build for ``request`` (blocks
    recomputed: ``recompute`` when given, else the request's)."""
    r = request
    specs = layer_specs(r.config, r.filter_layers)
    sharding = ShardingConfig(
        activation_checkpointing=r.recompute if recompute is None else recompute,
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
        frozen_weights=zerocore.FrozenWeights(r.frozen_weights, placement=r.frozen_placement),
        recompute=sharding.recompute(specs), micro_batches=r.grad_accum, mesh=r.mesh,
        nodes=r.nodes, comm=zerocore.Comm(quantize_gradients=r.quantize_gradients),
        hybrid=zerocore.Hybrid(r.hybrid) if r.hybrid is not None else None,
        count_flops=r.count_flops, host_memory=r.host_memory)


@dataclasses.dataclass(frozen=True)
class LayoutRow:
    """One layout's plan, in the figures a comparison shows (bytes; traffic per step)."""

    layout: Layout
    model_state: int       # shards of parameters, gradients, masters and optimizer state
    peak: int              # the device's peak, with the allocator's headroom
    secondary: int         # hpZ's secondary shards held at most (0 otherwise)
    within_nodes: int      # moved within one node per optimizer step
    across_nodes: int      # moved across the nodes per optimizer step


def compare_layouts(request: PlanRequest, nodes: int,
                    layouts: tuple[Layout, ...] = LAYOUTS,
                    planned: Mapping[Layout, zerocore.plan.MemoryPlan] = {},
                    plan_of: Callable[[PlanRequest], zerocore.plan.MemoryPlan] = plan_run
                    ) -> list[LayoutRow]:
    """``request`` planned on ``nodes`` nodes in each layout (``plan_of``: ``plan_run``, the
    engine's own step on fake tensors, or a cache of it; ``planned``: plans made already, by
    layout)."""
    rows = []
    for layout in layouts:
        plan = planned.get(layout) or plan_of(on_layout(request, layout, nodes))
        rows.append(LayoutRow(layout, sum(plan.state.bytes_of().values()), plan.peak_bytes,
                              plan.secondary_peak, plan.intra_node_bytes,
                              plan.inter_node_bytes))
    return rows


def layouts_table(rows: list[LayoutRow]) -> str:
    """The rows as aligned text: memory per GPU, bytes per optimizer step within and across
    the nodes, in GiB (MiB when every figure is below one GiB)."""
    biggest = max(max(r.peak, r.within_nodes, r.across_nodes) for r in rows)
    unit, size = ("GiB", GiB) if biggest >= GiB else ("MiB", 2**20)
    head = (f"  {'layout':<18}{'model state':>13}{'secondary':>11}{'peak':>11}"
            f"{'within nodes':>15}{'across nodes':>15}   ({unit}; memory per GPU, bytes per "
            f"step; secondary: hpZ's node-local shards at most)")
    return "\n".join([head] + [
        f"  {r.layout.name:<18}{r.model_state / size:13.3f}{r.secondary / size:11.3f}"
        f"{r.peak / size:11.3f}{r.within_nodes / size:15.3f}{r.across_nodes / size:15.3f}"
        for r in rows])


# What a plan leaves of the host's memory for everything but the model state and the step (the
# system, the data, the CUDA driver's own pinned buffers).
HOST_SPARE = 0.1


def needs(plan: zerocore.plan.MemoryPlan, ranks_per_node: int) -> tuple[int, int, int]:
    """(bytes per GPU, host bytes per node, NVMe bytes per node). On the CPU, each process's
    peak is host memory."""
    host = plan.host_peak if plan.device == "cuda" else plan.device_peak
    return plan.peak_bytes, host * ranks_per_node, plan.state.nvme * ranks_per_node


def fits(need: tuple[int, int, int], device: str, gpu_memory: int,
         host_memory: int | None) -> bool:
    """Whether ``need`` (``needs``') fits GPUs of ``gpu_memory`` bytes (on the CPU there are
    none) and a node's ``host_memory`` bytes less ``HOST_SPARE`` (None: not limited)."""
    gpu, host, _ = need
    return ((device == "cpu" or gpu <= gpu_memory)
            and (host_memory is None or host <= (1 - HOST_SPARE) * host_memory))
