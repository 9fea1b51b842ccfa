"""``FlatGroup``: one flat group (trainable or frozen) of one layer — its shard, the buffer it is
all-gathered into, the per-parameter views of that buffer, and its gradient reduce-scatter.

Tensor roles (docs/glossary.md):
- shard: this rank's ``[shard_numel]`` slice. Trainable: a ``ShardParameter`` (fp32 master, with
  ``model_copy`` in param_dtype unless param_dtype is fp32). Frozen: a plain Parameter in
  param_dtype with requires_grad=False, or quantized (``FrozenWeights(dtype=...)``) its packed
  bytes (engine/quantized.py); a replicated base's home holds every rank's packed part
  (``held_range``: the whole group) and gathers nothing (homes/replicated.py).
- gather input: what this rank contributes to the all-gather, which the group's home produces
  (zerocore/engine/homes/): the param_dtype shard itself (model_copy, the master itself in fp32,
  the frozen shard) on the device, a device mirror of a host model copy (the optimizer
  offloaded), or a window: a device copy of a host or NVMe shard made for one gather
  (parameters offloaded).
- gathered buffer: ``[padded_numel]`` in param_dtype, every rank's shard. Its storage is allocated
  (``resize_``) only while the group is gathered and released right after use, so between forward
  and backward the layer costs no parameter memory; autograd keeps views of the storage and sees
  the same values again once backward re-gathers into it.
- unsharded views: one view of the gathered buffer per parameter, installed on the module.
- secondary shard (hpZ): this rank's slice s of S of the gathered buffer (in ``_comm``'s dtype:
  param_dtype, or int8 values and scales), which the replicate group gathers from the primary
  shards across the nodes; copied out when the forward frees the group with backward still to
  come, and gathered from, within the node, by that backward (then dropped).

Two tensors alias the gathered storage: ``_comm`` is what collectives write into, ``_compute`` is
what the views are cut from. They have separate version counters, so re-gathering before backward
does not count as an in-place change of the tensors autograd saved.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist

from zerocore.comm import collectives, peer_memory, transport
from zerocore.comm.lockstep import Lockstep
from zerocore.comm.mesh import Mesh
from zerocore.kernels import ops
from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.homes import Homes
from zerocore.engine.host_arena import HostArena
from zerocore.engine.nvme_store import NvmeStore, Region
from zerocore.engine.offload import OffloadStreams
from zerocore.engine.optimizer_pass import gather_ready, wait_for_gather
from zerocore.engine.quantized import Quantized
from zerocore.engine.rehearsal import StorageWatch
from zerocore.policies import Comm
from zerocore.engine.sharded_param import set_layout, shard_stamp


class GroupState(enum.Enum):
    SHARDED = "sharded"      # only the shard exists; the gathered storage has size 0
    GATHERING = "gathering"  # an all-gather into the gathered storage is in flight
    GATHERED = "gathered"    # the gathered buffer holds every rank's shard


@dataclasses.dataclass
class PendingGrad:
    """A gradient reduction in flight and where its result goes."""

    group: "FlatGroup"
    reduction: transport.Reduction
    packed: torch.Tensor   # 1D, reduce dtype, padded_numel: kept alive until the reduction ends
    # False when the result is a view of ``packed`` (the gloo ways reduce in place), which is
    # then to be used before that buffer is reused.
    owned: bool
    # The reusable buffer ``packed`` was cut from (see ``start_reduce_scatter``), if any: free
    # for the next layer once this gradient is delivered.
    scratch: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class GroupContext:
    """What every group of one sharded model shares."""

    process_group: dist.ProcessGroup
    rank: int
    device: torch.device           # where layers compute and collectives run
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    counter: collectives.CommCounter
    # Where the groups' shards live (zerocore/engine/homes/), chosen once for the sharding
    # (``homes.choose``), with what the homes share (offload's streams, host arena, NVMe store).
    homes: Homes
    # How frozen groups are packed when quantized (FrozenWeights(dtype=...): codes and fp32
    # scales per block, engine/quantized.py); None: held and gathered in param_dtype.
    quantized: Quantized | None = None
    # Reading each other's memory (gloo ranks on one host, probed when the ways were chosen:
    # ``transport.choose``), with the waits bounded by zerocore.Comm's timeout; None: not
    # tried (Comm(peer_read="off")) or not possible.
    peers: peer_memory.PeerMemory | None = None
    comm: Comm = Comm()  # how gathers and reductions travel (zerocore/comm/transport.py)
    # The ways every group gathers and reduces, chosen once for the sharding
    # (``transport.choose``).
    ways: transport.Ways | None = None
    # The kind of device whose decisions the step takes ("cuda": CUDA's caching allocator
    # reuses freed memory, so no spare buffers are kept): ``device.type``, except in a plan
    # for CUDA, which runs on fake CPU tensors (engine/rehearsal.py).
    device_kind: str = "cpu"
    # Told of every resize of a gathered storage (a plan's memory count); None when training.
    watch: StorageWatch | None = None
    # HSDP: the replicas gradient shards are all-reduced across (``process_group`` being the
    # shard group); None: flat.
    replicas: transport.Replicas | None = None
    # hpZ: the nodes primary shards are gathered across into secondary shards, and secondary
    # gradient slices reduce-scattered across (``rank`` is then this rank's slice s·R + r of
    # every layout over all the ranks, ``process_group`` the shard group); None otherwise.
    across: transport.AcrossNodes | None = None
    # The ranks the model spans (comm/mesh.py): the group and order full states are gathered
    # in (``gather_full``); None: ``process_group`` in its rank order.
    mesh: Mesh | None = None
    # Every gather and reduction says first where this rank is (comm/lockstep.py); None: no
    # exchange (a group built outside a sharding).
    lockstep: Lockstep | None = None

    @property
    def streams(self) -> OffloadStreams | None:
        """Offload's side streams on CUDA; None otherwise (the homes')."""
        return self.homes.streams

    @property
    def arena(self) -> HostArena | None:
        """Where offloaded shards live on the host (the homes')."""
        return self.homes.arena

    @property
    def store(self) -> NvmeStore | None:
        """NVMe offload's scratch and pool (the homes')."""
        return self.homes.store


class FlatGroup:
    def __init__(self, layout: FlatLayout, values: torch.Tensor, trainable: bool,
                 ctx: GroupContext):
        """values: the padded flat values of the elements this rank holds (``held_range``: its
        shard, or a replicated base's every part; 1D, any float dtype, any device), the
        caller's to give: the shard is made from it (taken as it is where its device and dtype
        are the shard's)."""
        self.layout = layout
        self.trainable = trainable
        self.ctx = ctx
        # The elements this rank holds: its shard, or (a replicated frozen base) all of them.
        self.held_range = ctx.homes.held_range(trainable, layout, ctx.rank)
        lo, hi = self.held_range
        if values.shape != (hi - lo,):
            raise ValueError(f"FlatGroup: values of shape {tuple(values.shape)}; this rank "
                             f"holds {hi - lo} elements")
        dev, dt = ctx.device, ctx.param_dtype
        self.quantized: Quantized | None = None
        if not trainable:
            # Quantized frozen weights (FrozenWeights): each rank's part is its codes and their
            # fp32 scales, one byte buffer, so one collective gathers both; blocks never
            # straddle shards (the layout pads to whole blocks per rank), so every rank's part
            # is quantized exactly as the whole tensor would be.
            self.quantized = ctx.quantized
            values = values.to(device=dev)
            values = self._packed(values) if self.quantized is not None else values.to(dt)
        # Where the shard lives, and how the gathers' input is made from it.
        self.home = ctx.homes.place(values, trainable)
        del values
        self.shard: torch.nn.Parameter = self.home.shard
        if trainable:
            # The optimizer's step says where this rank is too (``lockstep_of``).
            self.shard.lockstep = ctx.lockstep
            set_layout(self.shard, [(sl.name, sl.offset, sl.numel) for sl in layout.slots], lo)
        storage = torch.empty(layout.padded_numel, dtype=dt, device=dev).untyped_storage()
        self._storage_nbytes = storage.nbytes()
        self._comm = torch.empty(0, dtype=dt, device=dev).set_(storage, 0, (layout.padded_numel,))
        self._compute = torch.empty(0, dtype=dt, device=dev).set_(storage, 0,
                                                                  (layout.padded_numel,))
        storage.resize_(0)
        self._storage = storage
        self._watch = ctx.watch
        self._resized(storage)
        if not trainable and self.quantized is not None:
            # Quantized: every rank's codes and scales arrive in a byte buffer of their own,
            # which is dequantized into the gathered buffer; it lives while the group is
            # gathered (other ranks may read it) and is given back by ``free`` (resident groups
            # too). A replicated base never gathers into it.
            self._comm_numel = layout.world_size * self.quantized.part_nbytes(layout.shard_numel)
            q8 = torch.empty(self._comm_numel, dtype=torch.uint8, device=dev).untyped_storage()
            self._comm = torch.empty(0, dtype=torch.uint8, device=dev).set_(
                q8, 0, (self._comm_numel,))
            q8.resize_(0)
            self._q8_storage = q8
            self._resized(q8)
        self.state = GroupState.SHARDED
        self._late = False  # the gathered buffer waits for the gather's wait (``start_gather``)
        # How this group's gathers and reductions travel (zerocore/comm/transport.py): the ways
        # chosen once for its sharding, strategies of its own (each keeps its own sequence).
        route = transport.Route.of(ctx.process_group, ctx.counter, ctx.ways.gloo, ctx.peers,
                                   ctx.replicas, ctx.across)
        self.gather, self.reduce = transport.strategies(ctx.ways, route)
        # hpZ: the gather across the nodes in flight (its handles: the first of a forward
        # gather's two steps), and the secondary shard kept for backward (1D, ``_comm``'s
        # dtype, 1/S of it) with the shard's version when it was kept (a shard changed since,
        # by the optimizer or a load, makes it stale: gathered afresh).
        self._across_handles: list[dist.Work | None] | None = None
        self._secondary: torch.Tensor | None = None
        self._secondary_version: tuple[int, int] | None = None
        # The unit it belongs to (its layer's index, set by it), for the lockstep's messages.
        self.unit_index = -1
        # A frozen group chosen by Prefetch.keep_gathered: once gathered it stays so (``free``
        # leaves it) until ``free(release=True)``; its values never change.
        self.resident = False

    # -- all-gather ------------------------------------------------------------------------------

    @property
    def full(self) -> torch.Tensor:
        """The gathered buffer the views are cut from (1D, param_dtype, padded_numel)."""
        return self._compute

    def upload(self) -> None:
        """Brings the device copy of the shard up to date, if its home keeps one between steps
        (``Home.uploads_before_forward``: a mirror of a host model copy). Called for those
        layers at the start of forward, so the uploads overlap the first layers' work. A shard
        the optimizer's overlapped pass has not updated yet is left to its gather, which
        uploads it once the update is written (``start_gather``); a delayed pass's published
        copy is always ready."""
        if gather_ready(self.shard):
            self.home.upload()

    @property
    def disk_region(self) -> Region | None:
        """Where the shard the gathers read lives on NVMe (``params="nvme"``); None: not there."""
        return self.home.disk_region

    def start_gather(self) -> None:
        # The optimizer's overlapped pass may still be updating this shard: its gather waits
        # for that layer's update alone (engine/optimizer_pass.py); with the pass delayed,
        # the gather reads the published copy and waits for nothing.
        wait_for_gather(self.shard)
        if self.state is not GroupState.SHARDED:
            return
        t0 = collectives.now()
        # A gather whose parts arrive in rows of its own (the lockstep's, comm/carried.py)
        # takes the buffer they are copied into when it is waited for: the rows stand in for
        # it while in flight, never beside it (what the plan counts).
        self._late = self.gather.stages_parts()
        if not (self._late and self.quantized is None):
            self._storage.resize_(self._storage_nbytes)  # allocated for the compute stream
            self._resized(self._storage)
        if self.quantized is not None and self.home.gathers and not self._late:
            self._q8_storage.resize_(self._comm_numel)
            self._resized(self._q8_storage)
        if self._secondary is not None and self._secondary_version != shard_stamp(self.shard):
            self.drop_secondary()  # stale: the shard changed since the forward that kept it
        if self._secondary is not None:
            # hpZ's backward: within the node alone, from the secondary shards (no upload:
            # the secondary shard is on the device, written on the compute stream).
            self.gather.start(self._comm, self._secondary)
        else:
            # The home makes the gather input and calls gather_from; a replicated base starts
            # nothing (``complete`` dequantizes it, just before the unit runs).
            self.home.start(self)
        self.state = GroupState.GATHERING
        self.ctx.counter.group_gathers += 1
        self.ctx.counter.gather_issue_s += collectives.now() - t0

    def gather_from(self, source: torch.Tensor) -> None:
        """Starts gathering from this rank's shard: over the shard group; with hpZ over the
        replicate group first, into this rank's secondary shard of the gathered buffer (the
        shard group's gather from it is issued by ``wait_gather``)."""
        across = self.ctx.across
        if across is None:
            self.gather.start(self._comm, source)
        else:
            self._across_handles = across.start_gather(self._secondary_region(), source)

    def _secondary_region(self) -> torch.Tensor:
        """This rank's secondary shard within the gathered buffer (``_comm``): slice s of S,
        where the cross-node gather writes and the shard group's gather reads."""
        route = self.gather.route
        return self._comm.chunk(route.world_size)[route.rank]

    def wait_gather(self) -> None:
        self.start_gather()
        if self.state is GroupState.GATHERING:
            t0 = collectives.now()
            self.home.complete(self)  # ``receive``, or a replicated base dequantized
            self.ctx.counter.gather_wait_s += collectives.now() - t0
            self.state = GroupState.GATHERED
            self.home.finish()

    def receive(self) -> None:
        """Waits for the group's gather (hpZ: issuing its second step first) and dequantizes
        every rank's part of a quantized group into the gathered buffer."""
        if self._across_handles is not None:
            # hpZ's forward: the secondary shard is in; the layer is gathered from the
            # secondary shards within the node. (Not overlapped yet: issued here.)
            transport.AcrossNodes.wait_gather(self._across_handles)
            self._across_handles = None
            if self.ctx.lockstep is not None:
                self.ctx.lockstep.gather(self.unit_index, in_node=True)
            self.gather.start(self._comm, self._secondary_region())
        if self._late:
            self._late = False
            storage = self._q8_storage if self.quantized is not None else self._storage
            storage.resize_(self._comm_numel if self.quantized is not None
                            else self._storage_nbytes)
            self._resized(storage)
        self.gather.wait(self._comm)
        # A gather from the secondary shard keeps it: a unit gathered again within the same
        # backward (its forward recomputed by a checkpoint around it) gathers from it
        # once more, inside the node; ``free`` gives it back once the backward is done.
        if self.quantized is not None:
            self.unpack(self._comm)

    def unpack(self, packed: torch.Tensor) -> None:
        """The gathered buffer <- every rank's packed part of a quantized group (``packed``:
        as gathered, or as a replicated home holds them), dequantized part by part."""
        self.quantized.unpack(packed, self._compute, self.layout.shard_numel)

    def free(self, release: bool = False, keep_secondary: bool = False) -> None:
        """Gives the gathered buffer back, unless the group is resident (``release`` frees
        it anyway). ``release`` also waits for the last upload that read a host shard: the
        host may write the shard next (``zerocore.load_checkpoint``, ``load_frozen``).
        ``keep_secondary`` (hpZ; the runtime's, after a forward whose backward will gather
        the group again): the secondary shard is copied out of the gathered buffer first and
        kept for that gather; otherwise one kept is dropped."""
        if self.state is GroupState.GATHERING:
            self.wait_gather()
        if release:
            self.home.wait_host_reads()
        if (keep_secondary and self.ctx.across is not None and not self.resident
                and self.home.gathers and self.state is GroupState.GATHERED
                and self._secondary is None):
            self._secondary = self._secondary_region().clone()
            self._secondary_version = shard_stamp(self.shard)
        elif not keep_secondary:
            self.drop_secondary()
        self.gather.before_free()  # the other ranks may still be reading this buffer
        if self.quantized is not None:
            self._q8_storage.resize_(0)  # the packed bytes: dequantized already
            self._resized(self._q8_storage)
        if self.resident and not release:
            return
        self._storage.resize_(0)
        self._resized(self._storage)
        self.state = GroupState.SHARDED

    def drop_secondary(self) -> None:
        """Gives back the secondary shard kept for backward (hpZ), if any."""
        self._secondary = None
        self._secondary_version = None

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if self._watch is not None:
            self._watch.resized(storage)

    def gather_full(self, to_rank: int | None = None) -> dict[str, torch.Tensor]:
        """Collective: the group's unsharded parameters by name, in the shard's dtype (fp32
        masters for a trainable group), on the CPU. For export; not a hot path.

        to_rank: None, every rank receives them (an all-gather); r, only rank r of the group
        does (a gather) and the others get an empty dict, so they never hold the full group."""
        shard = self.values().to(self.ctx.device)
        mesh = self.ctx.mesh
        # The ranks the state is sharded over (hpZ: every rank of the mesh, whose rank order
        # is not the slices' order: ``Mesh.in_state_order``).
        group = self.ctx.process_group if mesh is None else mesh.state_group
        if not self.home.gathers:  # a replicated base: every part is here, in layout order
            full = shard
            if to_rank is not None and group.rank() != to_rank:
                return {}
        elif to_rank is None:
            full = torch.empty(self.layout.world_size * shard.numel(), dtype=shard.dtype,
                               device=shard.device)
            collectives.all_gather_sync(full, shard, group)
        else:
            full = collectives.gather_to(shard, to_rank, group)
            if full is None:
                return {}
        if mesh is not None and mesh.hpz and self.home.gathers:
            full = torch.cat(mesh.in_state_order(list(full.chunk(self.layout.world_size))))
        if self.quantized is not None:  # every rank's codes and scales -> the values
            values = torch.empty(self.layout.padded_numel, dtype=self.ctx.param_dtype,
                                 device=full.device)
            self.quantized.unpack(full, values, self.layout.shard_numel)
            full = values
        full = full.cpu()
        return {s.name: full[s.offset:s.offset + s.numel].view(s.shape).clone()
                for s in self.layout.slots}

    # -- quantized frozen weights (FrozenWeights) -------------------------------------------------

    def _packed(self, values: torch.Tensor) -> torch.Tensor:
        """The held values (any float dtype, one or every rank's part) as packed bytes: each
        part's codes, then their fp32 scales."""
        return self.quantized.pack(values, self.layout.shard_numel)

    def load_frozen(self, values: torch.Tensor) -> None:
        """Sets this frozen group's held values (``held_range``'s elements, any float dtype):
        quantized for quantized groups. Frees a gathered copy of the old values."""
        assert not self.trainable
        lo, hi = self.held_range
        assert values.numel() == hi - lo, "load_frozen takes the held range's values"
        self.free(release=True)
        with torch.no_grad():
            if self.quantized is not None:  # quantized on the device, as when sharded
                data = self._packed(values.to(self.ctx.device))
            else:
                data = values
            self.home.write(data)

    def values(self) -> torch.Tensor:
        """The shard's values, wherever they live: a trainable group's fp32 master, a frozen
        group's shard (int8 bytes as they are); read from NVMe into a new tensor when there."""
        return self.home.values()

    def saved_values(self) -> torch.Tensor:
        """A frozen group's shard for a checkpoint: the tensor, or on NVMe its region mapped
        (what torch.save then reads from the disk as it writes)."""
        return self.home.saved_values()

    @property
    def gather_bytes(self) -> int:
        """Bytes one all-gather of this group moves (the unsharded buffer, as counted)."""
        if not self.home.gathers:
            return 0   # a replicated base: every part is held
        if self.quantized is not None:
            return self._comm_numel
        return self.layout.padded_numel * self.ctx.param_dtype.itemsize

    @property
    def mirror_bytes(self) -> int:
        """Bytes of the device mirror of a host model copy (the gather input with
        ``Offload(optimizer=True)`` alone); 0 otherwise."""
        return self.home.mirror_bytes

    @property
    def window_bytes(self) -> int:
        """Bytes of the window in flight (``Offload(params=True)``: the device copy of the
        shard one gather reads, from its start to its wait); 0 otherwise."""
        return self.home.window_bytes

    @property
    def memory_shard_bytes(self) -> int:
        """Bytes of the shard the gathers read, held in memory (host or device): none when it
        is on NVMe."""
        return self.home.memory_shard_bytes

    @property
    def device_shard_bytes(self) -> int:
        """Bytes of this group's parameter shard on the compute device now, what its gathers
        read there: the shard itself when it is kept there (a model copy, an fp32 master
        computed with, a frozen shard), the mirror, or the window in flight."""
        return self.home.device_shard_bytes

    @property
    def secondary_bytes(self) -> int:
        """Bytes of the secondary shard kept for backward now (hpZ; 0 otherwise)."""
        return _nbytes(self._secondary)

    @property
    def gathered_bytes(self) -> int:
        """Bytes the gathered buffers hold right now (0 when sharded): the values, and for an
        quantized group while gathered its packed parts too."""
        extra = self._q8_storage.nbytes() if self.quantized is not None else 0
        return self._storage.nbytes() + extra

    def views(self, requires_grad: bool) -> list[torch.Tensor]:
        """One tensor per parameter slot, viewing the gathered buffer. With requires_grad, each
        is a separate autograd leaf, so backward yields one gradient per parameter (None for a
        parameter the layer did not use)."""
        assert self.state is GroupState.GATHERED, "views of a group that is not gathered"
        out = []
        for s in self.layout.slots:
            v = self._compute[s.offset:s.offset + s.numel].view(s.shape)
            out.append(v.detach().requires_grad_() if requires_grad else v)
        return out

    # -- gradients -------------------------------------------------------------------------------

    def start_reduce_scatter(self, grads: list[torch.Tensor | None],
                             scratch: torch.Tensor | None = None) -> PendingGrad:
        """Packs the parameters' gradients (None = no gradient = zeros) into one flat buffer and
        starts averaging it across ranks into this rank's slice. scratch: a 1-D buffer of the
        reduce dtype on the device with at least padded_numel elements to pack into (reused
        from layer to layer), or None to allocate one."""
        assert self.trainable
        t0 = collectives.now()
        pending = self._start_reduce(grads, scratch)
        self.ctx.counter.reduce_issue_s += collectives.now() - t0
        return pending

    def _start_reduce(self, grads: list[torch.Tensor | None],
                      scratch: torch.Tensor | None) -> PendingGrad:
        numel, dtype, dev = self.layout.padded_numel, self.ctx.reduce_dtype, self.ctx.device
        if self.ctx.lockstep is not None:
            replicas = self.ctx.replicas
            self.ctx.lockstep.reduce(self.shard.layer_index, kept=replicas is not None
                                     and not replicas.requires_all_reduce)
        self.reduce.before_pack()
        if scratch is not None:
            assert scratch.numel() >= numel and scratch.dtype == dtype and scratch.device == dev
            packed = scratch[:numel]
        else:
            packed = torch.empty(numel, dtype=dtype, device=dev)
        present = [(g, s.offset) for g, s in zip(grads, self.layout.slots) if g is not None]
        ops.pack([g for g, _ in present], [o for _, o in present], packed)
        lo, hi = self.layout.shard_range(self.ctx.rank)
        return PendingGrad(self, self.reduce.start(packed, lo, hi), packed, self.reduce.owned,
                           scratch=scratch)

    @staticmethod
    def finish_reduce_scatter(pending: PendingGrad) -> torch.Tensor | None:
        """Waits for the reduction (on CUDA: makes the current stream wait) and returns this
        rank's averaged gradient shard (1D, reduce dtype, on the compute device); a view of
        ``pending.packed`` unless ``pending.owned``, so to be used before that buffer is
        reused. None: HSDP kept this micro-batch's sum for the all-reduce of a later one
        (``transport.ReduceAcrossReplicas``)."""
        t0 = collectives.now()
        out = pending.reduction.finish()
        pending.group.ctx.counter.reduce_wait_s += collectives.now() - t0
        return out


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
