"""What ``zerocore.plan`` reports (``MemoryPlan``, ``ModelState``, the categories of memory) and
the layers as its simulations see them: flat layouts built as the engine builds them, one fake
gathered buffer per group."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.sharded_layer import Params, collect_params
from zerocore.policies import FrozenWeights, Prefetch

GiB = 2**30

# What a CUDA process holds beyond its tensors, as the plan counts it (not measured here: no
# session had a GPU). The CUDA context with lazily loaded kernels, cuBLAS/cuDNN workspaces and
# NCCL's channel buffers take about 1 GiB on an H100/H200 process; the caching allocator,
# with expandable segments (neox sets them), rounds and fragments a few per cent of what it
# serves: 5% of the peak.
CUDA_FIXED_HEADROOM = 1 * GiB
CUDA_HEADROOM_FRACTION = 0.05

# Where each kind of memory is counted.
TRAINABLE, FROZEN, MASTERS, OPTIMIZER, GRADIENTS, MIRRORS = (
    "parameter shards, trainable", "parameter shards, frozen", "fp32 master shards",
    "optimizer state", "gradient shards", "offload mirrors")
GATHERED, GRAD_BUFFERS, ACTIVATIONS = ("gathered layers", "gradient buffers", "activations")
CATEGORIES = (TRAINABLE, FROZEN, MASTERS, OPTIMIZER, GRADIENTS, MIRRORS, GATHERED,
              GRAD_BUFFERS, ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Bytes of model state one rank holds (every rank holds the same: shards are equal)."""

    trainable_numel: int            # Ψ_trainable, whole model, padding excluded
    frozen_numel: int               # Ψ_frozen
    trainable_params: int           # model copies (param dtype), or fp32 masters in fp32
    frozen_params: int              # frozen shards (param dtype)
    masters: int                    # fp32 masters beside 16-bit model copies
    optimizer: int                  # Adam's two fp32 moments
    gradients: int                  # fp32 gradient shards, from backward to zero_grad
    mirrors: int                    # device mirrors of offloaded model copies
    on_host: frozenset[str]         # categories that live in host memory (CPU offload, GPUs)

    def bytes_of(self) -> dict[str, int]:
        return {TRAINABLE: self.trainable_params, FROZEN: self.frozen_params,
                MASTERS: self.masters, OPTIMIZER: self.optimizer, GRADIENTS: self.gradients,
                MIRRORS: self.mirrors}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one rank holds at the peak of a step, and what it moves per optimizer step."""

    world_size: int
    device: str                        # "cuda" or "cpu"
    state: ModelState
    peak: dict[str, int]               # bytes by category at the step's peak (all memories)
    peak_phase: str                    # where in the step the peak falls
    gathered_peak: int                 # most gathered-layer bytes held at any point
    activations_peak: int              # most activation bytes held at any point
    host_peak: int                     # host memory at the peak (offloaded state; CPU: 0)
    headroom: int                      # beyond tensors: CUDA context, allocator (CPU: 0)
    all_gather_bytes: int              # per optimizer step (all micro-batches)
    reduce_scatter_bytes: int
    recomputed_layers: tuple[int, ...]

    @property
    def device_peak(self) -> int:
        """Bytes of tensors on the compute device at the peak (the host's too on a CPU)."""
        return sum(v for k, v in self.peak.items()
                   if self.device == "cpu" or k not in self.state.on_host)

    @property
    def peak_bytes(self) -> int:
        """What the device needs: its tensors at the peak plus the headroom."""
        return self.device_peak + self.headroom

    def table(self, device_memory: int | None = None) -> str:
        s = self.state
        host = " (host)" if self.device == "cuda" else ""
        rows = [
            (f"parameter shards, trainable{host if TRAINABLE in s.on_host else ''}",
             s.trainable_params),
            ("parameter shards, frozen", s.frozen_params),
            (f"fp32 master shards{host if MASTERS in s.on_host else ''}", s.masters),
            (f"gradient shards (fp32){host if GRADIENTS in s.on_host else ''}", s.gradients),
            (f"optimizer state (Adam){host if OPTIMIZER in s.on_host else ''}", s.optimizer),
            ("offload mirrors", s.mirrors),
            ("gathered layers at the peak", self.peak[GATHERED]),
            ("gradient buffers at the peak", self.peak[GRAD_BUFFERS]),
            ("activations at the peak", self.peak[ACTIVATIONS]),
            ("(activations, most at any point)", self.activations_peak),
            ("(gathered layers, most at any point)", self.gathered_peak),
        ]
        if self.device == "cuda":
            rows.append(("CUDA context and allocator headroom", self.headroom))
        lines = [f"per rank ({self.world_size} ranks, each the same), Ψ_trainable="
                 f"{s.trainable_numel:,} Ψ_frozen={s.frozen_numel:,}"]
        lines += [f"  {name:<42}{value / GiB:10.2f} GiB" for name, value in rows]
        total = f"  {'total on the device at the peak':<42}{self.peak_bytes / GiB:10.2f} GiB"
        if device_memory:
            verdict = "fits" if self.peak_bytes <= device_memory else "does NOT fit"
            total += f"  of {device_memory / GiB:.0f} GiB: {verdict}"
        lines.append(total)
        if self.host_peak:
            lines.append(f"  {'host memory (offloaded state)':<42}"
                         f"{self.host_peak / GiB:10.2f} GiB")
        lines.append(f"  peak: {self.peak_phase}")
        lines.append(f"  per step: all-gathered {self.all_gather_bytes / GiB:.2f} GiB, "
                     f"reduce-scattered {self.reduce_scatter_bytes / GiB:.2f} GiB")
        return "\n".join(lines)


@dataclasses.dataclass
class Group:
    layout: FlatLayout
    trainable: bool
    owners: list[list[tuple[nn.Module, str]]]
    buffer: torch.Tensor | None = None      # fake gathered buffer, made once


@dataclasses.dataclass
class Layer:
    index: int
    module: nn.Module                        # a copy: parameters replaced by views when run
    groups: list[Group]
    recompute: bool

    @property
    def trainable(self) -> Group | None:
        return next((g for g in self.groups if g.trainable), None)

    def gathered_bytes(self, param_bytes: int) -> int:
        return sum(g.layout.padded_numel for g in self.groups) * param_bytes


def layer_of(module: nn.Module, index: int, world_size: int,
                int8_block: int | None) -> Layer:
    """A layer of a stack, as ``shard`` would split it into flat groups (on a copy: the caller's
    layer keeps its parameters)."""
    module = copy.deepcopy(module)
    return layer_from_params(module, collect_params(module), index, world_size, int8_block)


def layer_from_params(module: nn.Module, params: Params, index: int, world_size: int,
                      int8_block: int | None) -> Layer:
    """The flat groups of these parameters (trainable, then frozen), taken out of ``module``
    (their views are installed in their owners' places when the layer runs)."""
    groups = []
    for trainable in (True, False):
        chosen = [(n, p, o) for n, p, o in params if p.requires_grad == trainable]
        if chosen:
            multiple = int8_block if int8_block is not None and not trainable else 1
            groups.append(Group(FlatLayout.build([(n, tuple(p.shape)) for n, p, _ in chosen],
                                                  world_size, block=multiple),
                                 trainable, [o for _, _, o in chosen]))
    for _, _, owners in params:
        for mod, attr in owners:
            del mod._parameters[attr]
    return Layer(index, module, groups, False)


@dataclasses.dataclass(frozen=True)
class Options:
    world_size: int
    device: str
    param_bytes: int
    reduce_bytes: int
    param_dtype: torch.dtype
    prefetch: Prefetch
    offload: bool
    micro_batches: int
    frozen_weights: FrozenWeights = FrozenWeights()
    reduce_way: str = "collective"      # comm/transport.py's name of how gradients travel

    def gather_bytes(self, g: "Group") -> int:
        """What one all-gather of the group moves (FlatGroup.gather_bytes)."""
        if g.trainable:
            return g.layout.padded_numel * self.param_bytes
        return self.frozen_weights.frozen_nbytes(g.layout.padded_numel, self.param_bytes)


def model_state(layers: list[Layer], opt: Options) -> ModelState:
    t_numel = f_numel = t_shard = f_shard = 0
    for layer in layers:
        for g in layer.groups:
            if g.trainable:
                t_numel += g.layout.numel
                t_shard += g.layout.shard_numel
            else:
                f_numel += g.layout.numel
                f_shard += g.layout.shard_numel
    sixteen = opt.param_bytes != 4
    # Offload: the trainable model copies go to the host with everything the optimizer
    # touches; the device keeps a mirror of each copy, and the frozen shards.
    on_host = frozenset({TRAINABLE, MASTERS, OPTIMIZER, GRADIENTS} if opt.offload
                        else set())
    return ModelState(
        trainable_numel=t_numel, frozen_numel=f_numel,
        trainable_params=t_shard * (opt.param_bytes if sixteen else 4),
        frozen_params=opt.frozen_weights.frozen_nbytes(f_shard, opt.param_bytes),
        masters=t_shard * 4 if sixteen else 0, optimizer=t_shard * 8, gradients=t_shard * 4,
        mirrors=t_shard * opt.param_bytes if opt.offload else 0, on_host=on_host)


