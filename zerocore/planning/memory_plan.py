"""What ``zerocore.plan`` reports: ``MemoryPlan`` (one rank's memory at the step's peak, by
category, and its traffic per step) and ``ModelState`` (the bytes of model state, from the flat
layouts the engine built)."""

from __future__ import annotations

import dataclasses

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
# Offload(params=True): the device copies of host shards that the gathers in flight read.
WINDOWS = "parameter windows"
# hpZ: each layer's secondary shard (1/N_shard of it), kept from its forward to its backward.
SECONDARY = "secondary shards"
# NVMe offload: the host buffers the scratch is read and written through (Offload.pool_bytes).
NVME_POOL = "NVMe pool"
CATEGORIES = (TRAINABLE, FROZEN, MASTERS, OPTIMIZER, GRADIENTS, MIRRORS, WINDOWS, NVME_POOL,
              GATHERED, SECONDARY, GRAD_BUFFERS, ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Bytes of model state one rank holds (every rank holds the same: shards are equal)."""

    trainable_numel: int            # Ψ_trainable, whole model, padding excluded
    frozen_numel: int               # Ψ_frozen
    trainable_params: int           # model copies (param dtype), or fp32 masters in fp32 (none
                                    # in 16 bit with Offload(params=True) alone: rounded from
                                    # the masters per gather)
    frozen_params: int              # frozen shards (param dtype)
    masters: int                    # fp32 masters beside 16-bit model copies
    optimizer: int                  # Adam's two fp32 moments
    gradients: int                  # fp32 gradient shards, from backward to zero_grad
    mirrors: int                    # device mirrors of offloaded model copies
    on_host: frozenset[str]         # categories that live in host memory (CPU offload, GPUs)
    # NVMe offload: bytes of one rank's scratch file (what it needs free on its disk: the two
    # moments and, with ``nvme_masters``, the fp32 masters, each array in whole 4 KiB blocks),
    # and the host pool they move through; 0 without.
    nvme: int = 0
    pool: int = 0
    # Whether the pool was chosen from the planned hosts' memory (``Offload(pool_bytes=None)``:
    # ``zerocore.plan``'s ``host_memory``), as a run's ``MemoryReport.nvme_pool_chosen`` says.
    pool_chosen: bool = False
    # Whether the scratch holds the fp32 masters (False: in fp32 with the parameters in memory
    # the masters are the model copies there; the scratch holds the moments alone).
    nvme_masters: bool = True
    # How the frozen weights are held (FrozenWeights): "" in the compute dtype, sharded; else
    # the format and the placement ("nf4, replicated": every rank holds the whole quantized
    # base, ``frozen_params`` is all of it, and nothing frozen is gathered).
    frozen_layout: str = ""

    def bytes_of(self) -> dict[str, int]:
        return {TRAINABLE: self.trainable_params, FROZEN: self.frozen_params,
                MASTERS: self.masters, OPTIMIZER: self.optimizer, GRADIENTS: self.gradients,
                MIRRORS: self.mirrors, NVME_POOL: self.pool}


@dataclasses.dataclass(frozen=True)
class Loading:
    """One rank's memory while a model built on the meta device is loaded by range
    (``shard_model(read=)``, ``zerocore.MetaLayer``: ``zerocore.hf_pretrained``, neox's
    checkpoints), host and device together: the sharding's build, rehearsed with a reader that
    holds what ``zerocore.hf_pretrained``'s holds at most (a piece of at most
    ``READ_PIECE_NUMEL`` elements stored in fp32, and its conversion to the parameter's dtype).

    held: what the rank holds when the loading returns: its shards (model copies, fp32 masters,
        offload mirrors) and the model's buffers, before the optimizer's moments exist.
    peak: the most at once during the loading: ``held`` as it grows, plus ``staging``.
    """
    peak: int
    held: int

    @property
    def staging(self) -> int:
        """Beyond ``held`` at the peak: the group being built (its rank slice before it is
        placed; on a GPU the group's unsharded buffer, made and let go as its views are set)
        and one read piece with its conversion. On a GPU this part, less that buffer, is host
        memory; on the CPU, all of it."""
        return self.peak - self.held


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
    windows_peak: int = 0              # most parameter-window bytes held at any point
    # HSDP: gradient shards all-reduced across the replicas per optimizer step (between the
    # nodes), and the mesh's (replicas, shards); flat: 0 and None.
    replica_all_reduce_bytes: int = 0
    mesh: tuple[int, int] | None = None
    nodes: int = 1                     # the nodes the ranks span (HSDP: one per replica)
    # hpZ: per optimizer step, the forwards' gathers of secondary shards and the micro-batches'
    # reduce-scatters of secondary gradient slices across the nodes (the all-gather and
    # reduce-scatter above are then within the node); the layout's name for the table.
    across_all_gather_bytes: int = 0
    across_reduce_scatter_bytes: int = 0
    layout: str = ""                   # "HSDP", "hpZ", or "" (flat)
    secondary_peak: int = 0            # most secondary-shard bytes held at any point (hpZ)
    # Loading the model by range before the first step (see ``Loading``); None: not planned.
    loading: Loading | None = None
    # Floating-point operations of one rank per optimizer step (all micro-batches), as torch's
    # ``FlopCounterMode`` counts the rehearsed step's kernels: matmuls and attention, in
    # forward, backward and recomputation; elementwise work and zerocore's own kernels
    # (dequantization, Adam) are not counted. None: not counted (``plan(count_flops=True)``
    # counts them).
    flops: int | None = None

    @property
    def inter_node_bytes(self) -> int:
        """Bytes per optimizer step of collectives whose group spans nodes: a 2-D mesh's
        replicate group's (HSDP's replica all-reduces; hpZ's gathers and reduce-scatters
        across the nodes; each replica a node); a flat layout's whole traffic on several
        nodes."""
        if self.mesh is not None:
            return (self.replica_all_reduce_bytes + self.across_all_gather_bytes
                    + self.across_reduce_scatter_bytes)
        return self.all_gather_bytes + self.reduce_scatter_bytes if self.nodes > 1 else 0

    @property
    def intra_node_bytes(self) -> int:
        """Bytes per optimizer step of collectives within one node."""
        shard_group = self.all_gather_bytes + self.reduce_scatter_bytes
        return shard_group if self.mesh is not None or self.nodes == 1 else 0

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
            (f"{_frozen_row(s.frozen_layout)}{host if FROZEN in s.on_host else ''}",
             s.frozen_params),
            (f"fp32 master shards{host if MASTERS in s.on_host else ''}", s.masters),
            (f"gradient shards (fp32){host if GRADIENTS in s.on_host else ''}", s.gradients),
            (f"optimizer state (Adam){host if OPTIMIZER in s.on_host else ''}", s.optimizer),
            ("offload mirrors", s.mirrors),
            ("parameter windows at the peak", self.peak.get(WINDOWS, 0)),
        ]
        if s.nvme:
            rows.append((f"NVMe pool{', auto' if s.pool_chosen else ''}"
                         f"{host if NVME_POOL in s.on_host else ''}", s.pool))
        rows += [
            ("gathered layers at the peak", self.peak[GATHERED]),
            ("secondary shards at the peak (hpZ)", self.peak.get(SECONDARY, 0)),
            ("gradient buffers at the peak", self.peak[GRAD_BUFFERS]),
            ("activations at the peak", self.peak[ACTIVATIONS]),
            ("(activations, most at any point)", self.activations_peak),
            ("(gathered layers, most at any point)", self.gathered_peak),
            ("(parameter windows, most at any point)", self.windows_peak),
            ("(secondary shards, most at any point)", self.secondary_peak),
        ]
        if self.layout != "hpZ":
            rows = [row for row in rows if "secondary" not in row[0]]
        if self.device == "cuda":
            rows.append(("CUDA context and allocator headroom", self.headroom))
        layout = (f"{self.layout or 'HSDP'} {self.mesh[0]}x{self.mesh[1]}, "
                  if self.mesh is not None else "")
        lines = [f"per rank ({layout}{self.world_size} ranks, each the same), Ψ_trainable="
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
        if s.nvme:
            lines.append(f"  {'on NVMe (masters, moments; scratch)':<42}"
                         f"{s.nvme / GiB:10.2f} GiB")
        lines.append(f"  peak: {self.peak_phase}")
        if self.loading is not None:
            lines.append(f"  {'loading by range, peak':<42}{self.loading.peak / GiB:10.2f} GiB"
                         f"  (held after it {self.loading.held / GiB:.2f} GiB, staging "
                         f"{self.loading.staging / GiB:.2f} GiB)")
        lines.append(f"  per step: all-gathered {self.all_gather_bytes / GiB:.2f} GiB, "
                     f"reduce-scattered {self.reduce_scatter_bytes / GiB:.2f} GiB")
        if s.frozen_layout.endswith("replicated"):
            lines.append(f"  frozen base {s.frozen_layout}: the whole quantized base on every "
                         f"rank ({s.frozen_params / GiB:.2f} GiB), dequantized a layer at a "
                         f"time; none of it all-gathered")
        if self.layout == "hpZ":
            lines.append(f"  per step across the nodes: secondary shards gathered "
                         f"{self.across_all_gather_bytes / GiB:.2f} GiB, gradient slices "
                         f"reduce-scattered {self.across_reduce_scatter_bytes / GiB:.2f} GiB")
        if self.nodes > 1:
            lines.append(f"  per step on {self.nodes} nodes: within a node "
                         f"{self.intra_node_bytes / GiB:.2f} GiB, across nodes "
                         f"{self.inter_node_bytes / GiB:.2f} GiB")
        return "\n".join(lines)


def _frozen_row(frozen_layout: str) -> str:
    """The table's row name for the frozen weights held."""
    if frozen_layout.endswith("replicated"):
        return f"frozen base, whole ({frozen_layout})"
    return f"parameter shards, frozen{f' ({frozen_layout})' if frozen_layout else ''}"
