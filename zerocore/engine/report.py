"""Memory and communication accounting of a sharded model, measured from the real tensors and
set next to what ZeRO-3 predicts: (2+2+K)·Ψ/N_d bytes of model state per rank and 3Ψ of traffic
per step."""

from __future__ import annotations

import dataclasses

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state held by one rank."""

    rank: int
    world_size: int
    trainable_numel: int         # Ψ_trainable, real parameters (padding excluded), whole model
    frozen_numel: int            # Ψ_frozen
    param_bytes: int             # shards the layers compute from, wherever they live: model
                                 # copies, frozen shards, fp32 masters when computing in fp32,
                                 # offload mirrors
    master_bytes: int            # fp32 master shards kept beside a 16-bit model copy
    grad_bytes: int              # gradient shards (fp32) currently allocated
    optimizer_bytes: int         # optimizer state of the shards (Adam moments), if known
    gather_bytes: int            # gathered (unsharded) buffers allocated right now
    predicted_bytes: int         # (p + p + K)·Ψ_t/N + p·Ψ_f/N, the ZeRO-3 formula
    device_allocated: int | None = None  # torch.cuda.memory_allocated on GPU
    device_peak: int | None = None       # torch.cuda.max_memory_allocated on GPU
    # Offload: the host arena's bytes (masters, model copies, gradient staging, frozen shards
    # with Offload(params=True)), and how many
    # of them are pinned (all, on a GPU machine, once the layers are built; none on the CPU).
    host_arena_bytes: int = 0
    pinned_bytes: int = 0
    # Parameter-shard bytes on the compute device now (what the gathers read there): shards
    # kept there, offload mirrors, and with Offload(params=True) only the windows of the
    # gathers in flight (none between steps).
    device_shard_bytes: int = 0
    # hpZ: the secondary shards held now (each layer's 1/N_shard, kept from its forward until
    # its backward gathers from it: all of them, Ψ/N_shard in the param dtype, between the
    # passes); transient, as the gather buffers, so not model state.
    secondary_bytes: int = 0
    hpz: bool = False
    # NVMe offload: the bytes of this rank's scratch file (fp32 masters and Adam moments, each
    # array rounded up to 4 KiB blocks), and of the host pool they move through (part of the
    # host arena); whether the pool's size was chosen from the hosts' memory
    # (Offload(pool_bytes=None), the default) rather than given.
    nvme_bytes: int = 0
    nvme_pool_bytes: int = 0
    nvme_pool_chosen: bool = False

    @property
    def model_state_bytes(self) -> int:
        """Model state in memory (host or device); NVMe offload's scratch is ``nvme_bytes``."""
        return self.param_bytes + self.master_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def ratio_to_prediction(self) -> float:
        return self.model_state_bytes / self.predicted_bytes if self.predicted_bytes else 1.0

    def table(self) -> str:
        rows = [("parameter shards", self.param_bytes), ("fp32 master shards", self.master_bytes),
                ("gradient shards", self.grad_bytes), ("optimizer state", self.optimizer_bytes),
                ("model state (sum)", self.model_state_bytes)]
        if self.nvme_bytes:
            rows += [("  and on NVMe (scratch)", self.nvme_bytes)]
        rows += [("predicted (2+2+K)Ψ/N", self.predicted_bytes),
                 ("gather buffers now", self.gather_bytes),
                 ("shards on the device now", self.device_shard_bytes)]
        if self.hpz:
            rows.append(("secondary shards now", self.secondary_bytes))
        if self.host_arena_bytes:
            rows += [("host arena (offload)", self.host_arena_bytes),
                     ("pinned host memory", self.pinned_bytes)]
        if self.nvme_pool_bytes:
            rows += [("  of which NVMe pool" + (", auto" if self.nvme_pool_chosen else ""),
                      self.nvme_pool_bytes)]
        if self.device_allocated is not None:
            rows += [("device allocated", self.device_allocated),
                     ("device peak", self.device_peak or 0)]
        lines = [f"rank {self.rank}/{self.world_size}: Ψ_trainable={self.trainable_numel:,} "
                 f"Ψ_frozen={self.frozen_numel:,}"]
        lines += [f"  {name:<24}{value / MiB:12.3f} MiB" for name, value in rows]
        lines.append(f"  measured / predicted      {self.ratio_to_prediction:12.3f}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Bytes moved by each kind of collective since the counter was last reset, and the ZeRO-3
    expectation for one step: every layer's parameters all-gathered twice (forward and backward,
    2Ψ) and the trainable gradients reduce-scattered once (Ψ_t) — 3Ψ when everything trains.
    Those travel in the shard group; with HSDP each rank's gradient shards (Ψ_t/N_shard) are
    also all-reduced across the replicas once per optimizer step, between the nodes; with hpZ
    each forward gathers 1/N_shard of every layer across the nodes, and each micro-batch
    reduce-scatters 1/N_shard of the trainable gradients across them."""

    all_gather_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    expected_all_gather_bytes: int      # per step (one forward and backward)
    expected_reduce_scatter_bytes: int  # per step
    # How the groups' gathers and reductions travel (zerocore/comm/transport.py), e.g. "gather:
    # read; reduce: exchange"; several ways when the groups differ.
    ways: str = ""
    # HSDP: gradient shards all-reduced across the replicas, and the expectation per optimizer
    # step (the last micro-batch of an accumulation alone all-reduces).
    replica_all_reduce_bytes: int = 0
    expected_replica_all_reduce_bytes: int = 0
    layout: str = ""       # ``Mesh.line()``: flat, or HSDP's / hpZ's replicas x shards
    # A 2-D mesh (HSDP, hpZ): the shard group is a node, the replicate group spans the nodes.
    hybrid: bool = False
    nodes: int = 1         # the nodes a flat layout spans (torchrun's environment), else 1
    # hpZ: the replicate group's gathers (each forward's secondary shards) and reduce-scatters
    # (each micro-batch's secondary gradient slices), and their expectation per step (one
    # forward and backward); the all-gather and reduce-scatter above are then the shard
    # group's alone.
    across_all_gather_bytes: int = 0
    across_reduce_scatter_bytes: int = 0
    expected_across_all_gather_bytes: int = 0
    expected_across_reduce_scatter_bytes: int = 0
    hpz: bool = False

    @property
    def shard_group_bytes(self) -> int:
        """Parameter gathers and gradient reductions: the shard group's traffic."""
        return self.all_gather_bytes + self.reduce_scatter_bytes

    @property
    def inter_node_bytes(self) -> int:
        """Bytes of collectives whose group spans nodes: the replicate group's with a 2-D mesh
        (HSDP's all-reduces; hpZ's gathers and reduce-scatters across the nodes); everything
        when a flat layout spans several nodes; none on one node."""
        if self.hybrid:
            return (self.replica_all_reduce_bytes + self.across_all_gather_bytes
                    + self.across_reduce_scatter_bytes)
        return self.shard_group_bytes if self.nodes > 1 else 0

    @property
    def intra_node_bytes(self) -> int:
        """Bytes of collectives whose group is one node's ranks."""
        if self.hybrid:
            return self.shard_group_bytes
        return 0 if self.nodes > 1 else self.shard_group_bytes

    def table(self, steps: int = 1, micro_batches: int = 1) -> str:
        """The bytes by collective against the expectation of ``steps`` optimizer steps of
        ``micro_batches`` forward and backward passes each (gathers and reduce-scatters run
        every pass; HSDP's all-reduce across the replicas once per optimizer step), and, when
        the ranks span nodes, the split intra-node / inter-node."""
        passes = steps * micro_batches
        rows = [("all-gather", self.all_gather_bytes, self.expected_all_gather_bytes * passes),
                ("reduce-scatter", self.reduce_scatter_bytes,
                 self.expected_reduce_scatter_bytes * passes)]
        if self.hpz:
            rows += [("gather, nodes", self.across_all_gather_bytes,
                      self.expected_across_all_gather_bytes * passes),
                     ("reduce, nodes", self.across_reduce_scatter_bytes,
                      self.expected_across_reduce_scatter_bytes * passes)]
        elif self.hybrid:
            rows.append(("across replicas", self.replica_all_reduce_bytes,
                         self.expected_replica_all_reduce_bytes * steps))
        rows.append(("all-reduce", self.all_reduce_bytes, None))
        lines = [f"  {'collective':<16}{'measured MiB':>14}{'expected MiB':>14}"]
        for name, got, want in rows:
            w = f"{want / MiB:14.3f}" if want is not None else f"{'-':>14}"
            lines.append(f"  {name:<16}{got / MiB:14.3f}{w}")
        if self.hybrid or self.nodes > 1:
            lines.append(f"  intra-node {self.intra_node_bytes / MiB:.3f} MiB, inter-node "
                         f"{self.inter_node_bytes / MiB:.3f} MiB")
            lines.append(f"  ({self.layout})")
        if self.ways:
            lines.append(f"  ({self.ways})")
        return "\n".join(lines)
