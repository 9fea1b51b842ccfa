"""The core both front doors share: a ``Sharding`` holds the process group, the policies, the
sharded layers (``zerocore.shard``'s layers, ``zerocore.shard_model``'s units) and what they
share (the group context: counter, transport, offload's streams), decides once for both which
layers stay gathered (``Prefetch.keep_gathered``, resident frozen groups) and which are
recomputed, and starts the one runtime that runs them (runtime.py). Its reports (memory,
communication), full-state iteration and release are written once. ``ShardedSequential``
(sharded_sequential.py) and ``ShardedModel`` (sharded_model.py) differ only in what they shard
(a stack of layers, or a model by named units); checkpoints read a ``Sharding``, whichever front
door made it. The ranks it spans and how they share the model (flat; HSDP's shards and
replicas; hpZ's shards over every rank, gathered across the nodes and within them) are its
``Mesh`` (comm/mesh.py): ``group`` is the group the state is sharded over, and every agreement
runs over the whole mesh.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
from typing import Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from zerocore.comm import collectives, transport
from zerocore.comm import mesh as meshes
from zerocore.comm.collectives import CommCounter
from zerocore.comm.peer_memory import PeerMemory
from zerocore.comm.agree import run_agreed
from zerocore.comm.carried import (CARRY_MAX_BYTES, CarriedGather, CarriedReduce,
                                   ReadCarriedGather, ReadCarriedReduce)
from zerocore.comm.lockstep import FINITE, FULL_STATE, REPLICAS, Lockstep
from zerocore.comm.device import Platform, agree_on_devices, comm_device, resolve_device
from zerocore.comm.fake import is_fake
from zerocore.comm.mesh import Mesh, device_refusal
from zerocore.comm.objects import all_gather_objects
from zerocore.comm.same_values import agree_values
from zerocore.engine.compiled import compile_forward
from zerocore.engine import homes
from zerocore.engine.flat_group import GroupContext
from zerocore.engine.host_arena import HostArena, host_memory_bytes
from zerocore.engine.nvme_store import NvmeStore
from zerocore.engine.quantized import Quantized
from zerocore.engine.offload import OffloadStreams, cpu_threads
from zerocore.engine.rehearsal import Rehearsal
from zerocore.engine.report import CommReport, MemoryReport
from zerocore.engine.schedule import Schedule
from zerocore.engine.runtime import Runtime, Unit
from zerocore.engine.sharded_layer import ShardedLayer
from zerocore.engine.scratch_file import BLOCK, ScratchFile, size_text
from zerocore.engine.optimizer_pass import settle_updates
from zerocore.engine.sharded_param import ShardParameter, master_values
from zerocore.kernels.ops import BUILD
from zerocore.policies import (AUTO_POOL_HOST_SHARE, DEFAULT_TIMEOUT_S, Comm, Compile,
                               FrozenWeights, Hybrid, MixedPrecision, Offload, Prefetch,
                               Recompute, agreed_pool_bytes)

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")
T = TypeVar("T")
# Every rank's host and the memory it gives the rank, in rank order (``Placement.hosts``).
Hosts = tuple[tuple[str, int | None], ...]


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """A 63-bit hash of parameters' names, shapes, dtypes and trainability."""
    desc = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in named)
    return int.from_bytes(hashlib.sha1(desc.encode()).digest()[:8], "little") >> 1


class BuildError(ValueError, RuntimeError):
    """A rank failed while the layers were being sharded (building a layer, reading its values,
    quantizing them, allocating its shards): raised on every rank of the group alike, naming
    the rank and the layer, instead of on that rank alone while the others wait for it in their
    next collective until the process group's timeout. ``rank``: the first rank that failed.
    A ValueError (most such failures are bad input: a layer, its values, a reader) and a
    RuntimeError (the others: memory, a device), so that callers catching either see it."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return BuildError, (str(self), self.rank)


def agree_on_structure(index: int, print_: int | None, group: dist.ProcessGroup,
                       device: torch.device, what: str = "zerocore.shard",
                       failed: str | None = None) -> bool:
    """Checks that every rank is at the same layer (or unit) with the same structure
    (``fingerprint``, None when this rank has none left); False when every rank has run out.
    Ranks given different stacks would otherwise issue mismatched collectives and hang; here
    each fails at once with a clear message. One tiny all-gather per layer, so layers can be
    materialised one at a time. ``failed``: why this rank could not build the previous layer
    (or get this one); then every rank raises ``BuildError`` with the first failed rank's
    reason (the reasons travel only then, in one more exchange)."""
    if is_fake(group):  # a planned world is this rank N times: it agrees
        if failed is not None:
            raise BuildError(f"{what}: {failed}", 0)
        return print_ is not None
    world = group.size()
    mine = torch.tensor([0 if print_ is None else 1, 0 if print_ is None else print_,
                         int(failed is not None)], dtype=torch.int64, device=device)
    every = torch.empty(world * 3, dtype=torch.int64, device=device)
    collectives.all_gather_sync(every, mine, group)
    present, prints, broken = every.view(world, 3).unbind(1)
    if broken.any():
        reasons = all_gather_objects(failed, group, comm_device(group, _CPU, device))
        rank = next(r for r, reason in enumerate(reasons) if reason is not None)
        raise BuildError(f"{what}: rank {rank} {reasons[rank]}", rank)
    if present.min() != present.max():
        raise ValueError(f"{what}: ranks were given different numbers of layers (ranks "
                         f"{present.eq(0).nonzero().flatten().tolist()} have no layer {index}); "
                         f"every rank must pass the same stack")
    if prints.min() != prints.max():
        raise ValueError(f"{what}: layer {index} differs between ranks (parameter names, "
                         f"shapes, dtypes or requires_grad); every rank must pass the same stack "
                         f"with the same trainable parameters")
    return bool(present[0])


def agree_on_policies(policies: dict[str, object], group: dist.ProcessGroup,
                      device: torch.device, what: str, noun: str = "policies",
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Checks that every rank was given the same policies (``agree_values``: one tiny
    all-gather of a hash of each policy's fields): a rank that chose another transport, budget
    or precision would otherwise refuse, or issue other collectives, while the others wait for
    it until the timeout. The refusal names only the fields that differ ("comm.gather").
    ``noun``: what the values are, for the advice (``"meshes"``); ``timeout_s``: how long
    to wait for a rank that does not come (the Comm's timeout)."""
    if is_fake(group):
        return  # a planned world is this rank N times: it agrees
    fields: dict[str, object] = {}
    for name, policy in sorted(policies.items()):
        if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
            for field in dataclasses.fields(policy):
                fields[f"{name}.{field.name}"] = getattr(policy, field.name)
        else:
            fields[name] = policy
    agree_values(fields, what=what, advice=f"every rank must pass the same {noun}",
                 group=group, device=device, timeout_s=timeout_s)


def build_context(mesh: Mesh, device: torch.device,
                  mixed_precision: MixedPrecision, offload: Offload,
                  frozen_weights: FrozenWeights, comm: Comm, host_threads: int | None = None,
                  rehearsal: Rehearsal | None = None, hosts: Hosts | None = None
                  ) -> GroupContext:
    """What every flat group of one sharded model shares (its counter, offload's streams, the
    transport: chosen here, once, by every rank together, see ``transport.choose``; HSDP's
    replicas, or hpZ's nodes). hosts: every rank's host and its memory, as the ranks agreed
    on them (``prepare_device``); NVMe offload's pool is chosen from them."""
    group = mesh.shard
    streams = OffloadStreams(device) if offload.any and device.type == "cuda" else None
    arena = store = None
    if rehearsal is not None:
        peers, ways, kind, watch = None, rehearsal.ways, rehearsal.device_kind, rehearsal.watch
        if offload.nvme:  # the pool, fake; no file (the plan chose its size: zerocore.plan)
            assert offload.pool_bytes is not None, "a rehearsal's pool is chosen by the plan"
            store = NvmeStore(None, torch.empty(offload.pool_bytes, dtype=torch.uint8),
                              group=mesh.whole, device=device,
                              **store_arrays(offload, mixed_precision.param_dtype))
    else:
        if offload.any:
            arena = HostArena(pin=device.type == "cuda")
        if offload.nvme:
            assert hosts is not None, "the ranks' hosts come from prepare_device"
            store = open_store(offload, arena, mesh, device, mixed_precision.param_dtype,
                               hosts)
        peers = PeerMemory(comm.timeout_s) if comm.peer_read == "auto" else None
        # Reading each other's memory is probed within the shard group alone: HSDP's replicas
        # talk through the backend, and a shard group reads only if its ranks share a host.
        ways = transport.choose(group, device, comm, peers, layout=mesh.line(),
                                nodes=None if mesh.hybrid else mesh.nodes)
        kind, watch = device.type, None
        if not peers or not peers.available:
            peers = None
    counter = CommCounter()
    block = comm.quantize_block if comm.quantize_gradients == "int8" else None
    replicas = across = None
    if mesh.hpz:
        across = transport.AcrossNodes(mesh.replicate, counter, shards=mesh.shape[1],
                                       gloo=ways.gloo, planned=ways.planned,
                                       quantize_block=block)
    elif mesh.replicate is not None:
        replicas = transport.Replicas(mesh.replicate, counter, block)
    # Where each rank is, exchanged over every rank of the mesh: through the pipes of peer
    # memory within the shard group when it reads, and by the backend when the mesh is wider.
    lockstep = Lockstep(mesh.whole, peers, group)
    # Where the shards live, chosen once for the sharding (zerocore/engine/homes/).
    where = homes.choose(offload, device=device, param_dtype=mixed_precision.param_dtype,
                         streams=streams, arena=arena, store=store, host_threads=host_threads,
                         frozen_weights=frozen_weights, rehearsal=rehearsal is not None)
    return GroupContext(group, mesh.state_rank, device, mixed_precision.param_dtype,
                        mixed_precision.grad_reduce_dtype, counter, where,
                        quantized=Quantized.of(frozen_weights), peers=peers, comm=comm,
                        ways=ways, device_kind=kind, watch=watch, replicas=replicas,
                        across=across, mesh=mesh, lockstep=lockstep)


def store_arrays(offload: Offload, param_dtype: torch.dtype) -> dict[str, bool]:
    """What the NVMe store's records hold besides the moments (``NvmeStore``): the model copy
    with the parameters on NVMe; the fp32 master unless it is the model copy in host memory
    (fp32, the parameters not on NVMe: one copy of those bits, not two)."""
    on_nvme = offload.params == "nvme"
    return {"copies": on_nvme, "masters": on_nvme or param_dtype != torch.float32}


def open_store(offload: Offload, arena: HostArena, mesh: Mesh, device: torch.device,
               param_dtype: torch.dtype, hosts: Hosts) -> NvmeStore:
    """NVMe offload: this rank's scratch file under ``offload.path`` and the pool it moves
    through (from the host arena: pinned with it), opened by every rank of the mesh together:
    a path that is missing, not a directory or not writable on any rank is raised on every
    rank (``run_agreed``). ``hosts``: every rank of the mesh's host and its memory, the same
    list on every rank (``Placement.hosts``), so a pool chosen from them
    (``Offload(pool_bytes=None)``) is the same on every rank. Rank 0 says where the scratch
    is, how it is read and how large the pool is."""
    chosen = offload.pool_bytes is None
    unknown = [r for r, (_, memory) in enumerate(hosts) if memory is None]
    if chosen and unknown:  # (the same list on every rank: raised on every rank)
        raise ValueError(f"Offload(pool_bytes=None) chooses the NVMe pool from the hosts' "
                         f"memory, and rank(s) {unknown} were given a Platform without "
                         f"host_memory: give it (Platform.detect reads it), or give "
                         f"Offload.pool_bytes")
    memory = hosts[mesh.whole.rank()][1]
    scratch = run_agreed(lambda: _open_scratch(offload, memory), group=mesh.whole,
                         device=device)
    pool_bytes = agreed_pool_bytes(hosts) if chosen else offload.pool_bytes
    pool = arena.take(pool_bytes, torch.uint8, align=BLOCK)
    store = NvmeStore(scratch, pool, group=mesh.whole, device=device, pool_chosen=chosen,
                      **store_arrays(offload, param_dtype))
    # Each rank's way of reading, for rank 0's line.
    direct = (all_gather_objects(scratch.direct, mesh.whole, comm_device(mesh.whole, _CPU,
                                                                         device))
              if mesh.whole.size() > 1 else [scratch.direct])
    if mesh.whole.rank() == 0:
        buffered = [r for r, d in enumerate(direct) if not d]
        how = ("direct I/O (O_DIRECT)" if not buffered else
               f"buffered I/O on rank(s) {buffered}: the file system refuses O_DIRECT there, "
               f"so what is moved passes through the page cache (dropped after use)")
        log.info("NVMe offload: each rank's scratch is an unnamed file in %s (freed when the "
                 "rank ends), moved through a pool of %.1f MiB%s in chunks of %d elements, %s",
                 offload.path, pool_bytes / 2**20, pool_words(chosen, hosts),
                 store.chunk_numel, how)
    return store


def pool_words(chosen: bool, hosts: Hosts) -> str:
    """How the pool was chosen, for the start-up line: "" when given (Offload.pool_bytes)."""
    if not chosen:
        return ""
    ranks = collections.Counter(host for host, _ in hosts)
    smallest = min(memory for _, memory in hosts)
    return (f" (chosen from the host's memory, Offload.pool_bytes=None: {max(ranks.values())} "
            f"rank(s) of this model on a host, {size_text(smallest)} the smallest host, "
            f"1/{AUTO_POOL_HOST_SHARE} of it for the pools)")


def _open_scratch(offload: Offload, memory: int | None) -> ScratchFile:
    """This rank's scratch file, once the pool is known to fit this host's ``memory``
    (``Platform.host_memory``; None: not known, not checked): a pool larger than the machine is
    refused in one line before any of it is taken (the arena would raise MemoryError partway
    through the build)."""
    if offload.pool_bytes is not None and memory is not None and offload.pool_bytes > memory:
        raise ValueError(f"Offload(pool_bytes={offload.pool_bytes}): a pool of "
                         f"{size_text(offload.pool_bytes)} is more than this machine's "
                         f"{size_text(memory)} of memory; give a pool of a few hundred MiB "
                         f"(or leave it out: the default chooses it from the host's memory)")
    return ScratchFile(offload.path)


def memory_report_of(layers: list[ShardedLayer], rank: int, world_size: int,
                     device: torch.device, mixed_precision: MixedPrecision,
                     frozen_weights: FrozenWeights,
                     optimizer: torch.optim.Optimizer | None = None,
                     arena: HostArena | None = None, hpz: bool = False,
                     store: NvmeStore | None = None) -> MemoryReport:
    """``memory_report`` of any sharded model: its layers' (or units') groups measured."""
    p_bytes = torch.tensor([], dtype=mixed_precision.param_dtype).element_size()
    param = master = grad = opt = gather = on_device = secondary = 0
    trainable_numel = frozen_numel = 0
    for layer in layers:
        for g in layer.groups:
            gather += g.gathered_bytes
            secondary += g.secondary_bytes
            on_device += g.device_shard_bytes
            shard = g.shard
            if g.trainable:
                trainable_numel += g.layout.numel
                params, masters = g.home.state_bytes()  # in memory: its home's count
                param += params
                master += masters
                if shard.grad is not None:
                    grad += shard.grad.numel() * shard.grad.element_size()
                if optimizer is not None:
                    for key, t in optimizer.state.get(shard, {}).items():
                        if isinstance(t, torch.Tensor) and t.dim() > 0:
                            opt += t.numel() * t.element_size()
            else:
                frozen_numel += g.layout.numel
                param += g.memory_shard_bytes
    n = world_size
    k = 8 if p_bytes == 4 else 12  # Adam moments, plus an fp32 master when computing in 16 bit
    frozen_copies = n if frozen_weights.replicated else 1   # a replicated base: all of it
    predicted = ((p_bytes + p_bytes + k) * trainable_numel
                 + frozen_copies * frozen_weights.frozen_nbytes(frozen_numel, p_bytes)) // n
    dev_alloc = dev_peak = None
    if device.type == "cuda":
        dev_alloc = torch.cuda.memory_allocated(device)
        dev_peak = torch.cuda.max_memory_allocated(device)
    return MemoryReport(rank, n, trainable_numel, frozen_numel, param, master, grad, opt,
                        gather, predicted, dev_alloc, dev_peak,
                        host_arena_bytes=arena.used if arena is not None else 0,
                        pinned_bytes=arena.pinned if arena is not None else 0,
                        device_shard_bytes=on_device, secondary_bytes=secondary, hpz=hpz,
                        nvme_bytes=store.size if store is not None else 0,
                        nvme_pool_bytes=store.pool_bytes if store is not None else 0,
                        nvme_pool_chosen=store is not None and store.pool_chosen)


def prepare_device(device: torch.device | str | None, mesh: Mesh,
                   offload: Offload, platform: Platform | None, what: str = "zerocore.shard"
                   ) -> tuple[torch.device, int | None, Hosts]:
    """Where this rank computes, checked by every rank of the mesh together before anything
    is allocated (see ``shard``'s ``device``); the CPU threads its optimizer steps with
    when a GPU rank offloads (its share of the host's cores; ``Offload.cpu_threads``), None
    otherwise; and every rank's host and its memory (``Placement.hosts``: the platforms'), for
    the NVMe pool. Nothing of the process is changed here: the optimizer's host step uses that
    count for its own duration (``zerocore.optim``)."""
    dev = resolve_device(device, mesh.shard)
    if platform is None:
        platform = Platform.detect(dev, kernels_cuda=BUILD.has_cuda,
                                   host_memory=host_memory_bytes())
    placement = agree_on_devices(mesh.whole, dev, platform,
                                 refusal=device_refusal(mesh, dev.type, what))
    threads = None
    if offload.optimizer and dev.type == "cuda":
        # This rank's optimizer steps on the CPU, as every other rank's on this host does.
        threads = cpu_threads(offload.cpu_threads, usable_cores=platform.usable_cores,
                              ranks_on_host=placement.ranks_on_host,
                              current=torch.get_num_threads())
    return dev, threads, placement.hosts()


def pass_line(offload: Offload) -> str:
    """How the offloaded optimizer's pass runs, for the start-up line."""
    if offload.delayed:
        return ("on a host worker, one step delayed (Offload.overlap 'delayed'): each "
                "forward computes with the weights from before the last update, which "
                "overlaps the whole forward and backward")
    if offload.overlaps:
        return ("on a host worker, overlapping the next forward (Offload.overlap 'exact')")
    return "inside optimizer.step() (not overlapped)"


class Sharding:
    """What a sharded model is, whichever front door made it (``zerocore.shard``'s
    ``ShardedSequential``, ``zerocore.shard_model``'s ``ShardedModel``; both are one): its group,
    policies and ``layers`` (``ShardedLayer``, in their index order), and everything that does
    not depend on how the layers run. Checkpoints, exports and optimizers need only this.
    ``group``, ``rank``, ``world_size``: the ranks the state is sharded over, and which slice
    this rank holds (``Mesh.state_group``, ``state_rank``): the shard group's with HSDP (one
    replica's ranks; ``mesh`` has the rest); with hpZ every rank of the mesh, ``rank`` being
    the slice s·R + r, not the rank in ``group``."""

    layers: list[ShardedLayer] | nn.ModuleList  # set by the front door as it builds them
    front_door = "zerocore.shard"                # how messages name it

    def __init__(self, mesh: Mesh, device: torch.device, *,
                 mixed_precision: MixedPrecision, prefetch: Prefetch, offload: Offload,
                 recompute: Recompute | None, frozen_weights: FrozenWeights, comm: Comm,
                 compile: Compile | None = None, host_threads: int | None = None,
                 rehearsal: Rehearsal | None = None, hybrid: Hybrid | None = None,
                 hosts: Hosts | None = None):
        """rehearsal: the step runs for ``zerocore.plan`` (engine/rehearsal.py). hybrid: the
        layout asked of a 2-D mesh (``mesh`` was resolved with it). host_threads, hosts:
        ``prepare_device``'s (None in a rehearsal)."""
        self.mesh = mesh
        self.group = mesh.state_group
        # The groups' own ranks and sizes: a planned world's group is not registered with
        # torch.distributed (comm/fake.py).
        self.rank = mesh.state_rank
        self.world_size = mesh.state_size
        self.device = device
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch
        self.offload = offload
        self.recompute = recompute
        self.frozen_weights = frozen_weights
        self.comm = comm
        self.compile = compile
        # The mesh first: ranks given other meshes would agree on the rest in other groups.
        agree_on_policies(dict(mesh=mesh.describe()), mesh.whole, device, self.front_door,
                          noun="meshes", timeout_s=comm.timeout_s)
        # Each rank may keep its NVMe scratch on a disk of its own (the path is its own
        # business: it changes no collective), so the path alone is not agreed on.
        agreed_offload = (dataclasses.replace(offload, path="(each rank's own)")
                          if offload.path is not None else offload)
        agree_on_policies(dict(mixed_precision=mixed_precision, prefetch=prefetch,
                               offload=agreed_offload, recompute=recompute,
                               frozen_weights=frozen_weights, comm=comm, compile=compile,
                               hybrid=hybrid),
                          mesh.whole, device, self.front_door, timeout_s=comm.timeout_s)
        # The same answers on every rank: the mesh and the policies are agreed.
        meshes.refuse_hybrid(mesh, hybrid, self.front_door)
        if comm.quantize_gradients is not None and mesh.replicate is None:
            raise ValueError(f"{self.front_door}: Comm(quantize_gradients="
                             f"{comm.quantize_gradients!r}) quantizes the gradients' all-reduce "
                             f"across HSDP's replicas, and this model has none ({mesh.line()}); "
                             f"pass a 2-D mesh (replicate, shard) with more than one replica, "
                             f"or leave it out")
        if frozen_weights.replicated and offload.params == "nvme":
            raise ValueError(f"{self.front_door}: FrozenWeights(placement='replicated') keeps "
                             f"the whole quantized frozen base in each rank's memory (the "
                             f"device's, or the host's with Offload(params='cpu')), and "
                             f"Offload(params='nvme') puts the parameters on NVMe; give "
                             f"params='cpu', or shard the frozen base")
        self.hybrid = hybrid
        self.ctx = build_context(mesh, device, mixed_precision, offload, frozen_weights, comm,
                                 host_threads, rehearsal, hosts)
        self.counter = self.ctx.counter
        self.ways = self.ctx.ways
        self.lockstep = self.ctx.lockstep
        if mesh.whole.rank() == 0 and rehearsal is None:
            ranks = mesh.world_size
            log.info("%s: %d rank%s on %s; %s", self.front_door, ranks,
                     "s" if ranks != 1 else "", device, self.ways.line())
            if offload.optimizer:
                log.info("%s: the optimizer (offloaded to %s) steps %s", self.front_door,
                         offload.optimizer,
                         pass_line(offload))
        self.schedule: Schedule | None = None  # decided by ``seal``, once the layers are built
        self.runtime: Runtime | None = None    # the hooks that run the layers (``start``)
        # Why this rank's last build step failed, and its exception, until agreed (``agree``).
        self._failed: tuple[str, Exception] | None = None

    # -- building, a step every rank agrees on ------------------------------------------------

    def attempt(self, index: int, make: Callable[[], T], *, even_after_failure: bool = False
                ) -> T | None:
        """``make()`` (getting layer ``index`` or building it); None when it fails, or when an
        earlier step of this rank's failed: the failure waits for the next ``agree`` (or
        ``settle``), where every rank learns of it and raises, instead of this rank alone.
        ``even_after_failure``: ``make()`` runs on a rank that failed too, its result and its
        failure ignored (drawing the next layer from the caller's iterator, which may itself
        run collectives: a rank that skipped it would meet the others in another one)."""
        if self._failed is not None:
            if even_after_failure:
                with contextlib.suppress(Exception):
                    make()
            return None
        try:
            return make()
        except Exception as e:  # noqa: BLE001  (any failure must reach the other ranks)
            self._failed = (f"could not build layer {index}: {type(e).__name__}: {e}", e)
            return None

    def agree(self, index: int, print_: int | None, what: str) -> bool:
        """``agree_on_structure`` for layer ``index``, carrying this rank's failure, if any."""
        failed = self._failed
        try:
            return agree_on_structure(index, print_, self.mesh.whole, self.device, what,
                                      failed=failed[0] if failed else None)
        except BuildError as e:
            if failed is not None:
                raise e from failed[1]   # this rank's own exception as the cause
            raise

    def settle(self, what: str) -> None:
        """After the last build step: every rank learns whether any failed."""
        self.agree(-1, None, what)

    def new_layer(self, module: nn.Module, index: int, *, compiled: bool = True,
                  **where) -> ShardedLayer:
        """Layer ``index``'s groups, sharded now (``where``: ``read`` or ``params``, as
        ``ShardedLayer`` takes them), its forward compiled under ``Compile`` (unless not
        ``compiled``: ``shard_model``'s root, which is the model itself)."""
        layer = ShardedLayer(module, index, self.ctx, self.world_size, **where)
        if self.compile is not None and compiled:
            compile_forward(self.compile, module)
        return layer

    def seal(self, layers: list[ShardedLayer], recomputable: int | None = None) -> None:
        """After the last layer is built: the step's schedule (zerocore/engine/schedule.py:
        the layers ``Prefetch.keep_gathered`` keeps, whose frozen groups become resident, and
        those recomputed; every rank decides alike, the sizes being the same everywhere).
        ``recomputable``: as ``Schedule.of`` takes it."""
        self.schedule = Schedule.of(self.prefetch, self.recompute,
                                    [l.gathered_size for l in layers], recomputable)
        on_disk = [g.disk_region.span for l in layers for g in l.groups
                   if g.disk_region is not None]
        if on_disk:
            # The gathers read their shards through the pool: slots of the largest (the same
            # on every rank: the shards are equal, so is the pool: refused alike, if it is).
            self.ctx.store.use_slots(max(on_disk))
        for layer in layers:
            layer.recompute = layer.index in self.schedule.recomputed
            if layer.frozen is not None:
                layer.frozen.resident = self.schedule.resident(layer.index)
        self._carry(layers)

    def _carry(self, layers: list[ShardedLayer]) -> None:
        """Over gloo's collectives of a flat mesh, the lockstep's identity travels in rows of
        one width (comm/carried.py), and the gathers of units of one group whose part fits in
        ``CARRY_MAX_BYTES`` carry their data in them, as do their gradient reductions where
        the slices each rank sends fit too: their check costs no collective of its own (the
        lockstep is on here whenever there is more than one rank: ``Lockstep.enabled`` is
        switched off only after, for a measurement). Peer reading, HSDP, hpZ and the gather
        by nodes keep the exchange as it is: their gathers are not gloo's broadcasts over the
        lockstep's group. Every rank decides alike: the ways, the mesh and the layers' sizes
        are the same everywhere."""
        ctx, lockstep = self.ctx, self.lockstep
        ways = ctx.ways
        if lockstep.enabled and not ways.planned and lockstep.reads_every_rank:
            self._carry_reading(layers)
            return
        if not (lockstep.enabled and ways.gloo and ways.gather == "collective"
                and not ways.planned and ctx.peers is None and ctx.replicas is None
                and ctx.across is None
                and lockstep.group.size() == ctx.process_group.size()):
            return
        world = ctx.process_group.size()
        carried = {layer.index: layer.groups[0] for layer in layers
                   if len(layer.groups) == 1 and layer.groups[0].home.gathers
                   and 0 < layer.groups[0].gather_bytes // world <= CARRY_MAX_BYTES}
        # A carried unit's gradients reduced in the rows: each rank's row holds the slices of
        # its packed gradients the other ranks keep, in the reduce dtype (wider than the part
        # where the parameters are 16-bit and the reduction fp32): at two ranks the exchange's
        # half; at three and more what gloo's all-to-all sends, summed in the same order, so
        # that the lockstep on or off gives the same bits.
        sent = {index: CarriedReduce.row_nbytes(g.layout.padded_numel, world, ctx.reduce_dtype)
                for index, g in carried.items()
                if g.trainable and (type(g.reduce) is transport.ReduceByExchange
                                    or (type(g.reduce) is transport.Reduce and world > 2))}
        sent = {index: n for index, n in sent.items() if n <= CARRY_MAX_BYTES}
        width = max([g.gather_bytes // world for g in carried.values()] + list(sent.values()),
                    default=0)
        lockstep.carry(width, set(carried), set(sent))
        for group in carried.values():
            group.gather = CarriedGather(group.gather, lockstep, group.unit_index)
        for index in sent:
            group = carried[index]
            group.reduce = CarriedReduce(group.reduce, lockstep, group.shard.layer_index)

    def _carry_reading(self, layers: list[ShardedLayer]) -> None:
        """Over peer reading of a flat mesh, the gathers and reductions by reading carry the
        lockstep's identity in their ready message (comm/carried.py), every unit's:
        their check costs no message or wait of its own. Every rank decides alike."""
        ways, lockstep = self.ctx.ways, self.lockstep
        gathers, reduces = ways.gather == "read", ways.reduce == "read"
        lockstep.carry_reading(gathers, reduces)
        for layer in layers:
            for group in layer.groups:
                if gathers:
                    group.gather = ReadCarriedGather(group.gather, lockstep)
                if reduces and group.trainable:
                    group.reduce = ReadCarriedReduce(group.reduce, lockstep)

    def start(self, model: nn.Module, units: list[Unit], root_owners: list[nn.Module]) -> None:
        """Puts the runtime's hooks on the model (zerocore/engine/runtime.py): ``units`` in
        their index order, then the root (``model`` itself)."""
        self.lockstep.names = [self.unit_label(u.name) for u in units]
        self.runtime = Runtime(model, units, self.schedule, self.lockstep,
                               mirrors=self.ctx.homes.trainable.uploads_before_forward,
                               root_owners=root_owners, staging=self._staging())
        if self.ctx.arena is not None:
            self.ctx.arena.pin()   # every offloaded buffer is taken: pinned, exactly those

    def _staging(self) -> list[torch.Tensor]:
        """Optimizer offload on a GPU: the two host buffers gradient shards are copied into from
        the device, in turn, each as large as the largest shard (from the arena, so pinned with
        it). None on the CPU, where the gradients are already on the host, and when the
        optimizer is on the device."""
        arena = (self.ctx.arena if self.ctx.streams is not None
                 and self.ctx.homes.trainable.steps_on_host else None)
        largest = max((l.trainable.layout.shard_numel for l in self.layers
                       if l.trainable is not None), default=0)
        if arena is None or largest == 0:
            return []
        return [arena.take(largest, self.ctx.reduce_dtype) for _ in range(2)]

    @staticmethod
    def unit_label(name: str) -> str:
        """How messages name the unit of this name (``Unit.name``; "" for the root)."""
        return f"layer {name}" if name else "the weights tied across layers"

    @property
    def kept_layers(self) -> frozenset[int]:
        """The layers ``Prefetch.keep_gathered`` keeps (the schedule's)."""
        return self.schedule.kept

    def param_name(self, index: int, name: str) -> str:
        """Layer ``index``'s parameter ``name`` as the unsharded model names it."""
        return name

    # -- what the sharding holds -------------------------------------------------------------

    def trainable_shards(self) -> list[ShardParameter]:
        """This rank's trainable shards, one per layer with trainable parameters: what the
        optimizer steps (the frozen shards have no gradient; optimizers skip them)."""
        return [l.trainable_shard for l in self.layers if l.trainable_shard is not None]

    def trainable_finite(self) -> bool:
        """Whether every trainable master weight this rank holds is finite (not NaN, not
        infinite): what a run checks before it saves. Reads NVMe-offloaded masters from the
        scratch, one shard at a time. Collective when the optimizer's pass is overlapped
        (``Offload.overlap``): every rank waits for it, a failure of it agreed."""
        settle_updates(self.trainable_shards(), together=True, kind=FINITE)
        return all(bool(torch.isfinite(master_values(s)).all()) for s in self.trainable_shards())

    def shards(self) -> Iterator[nn.Parameter]:
        """Every shard this rank holds, trainable then frozen, layer by layer."""
        for layer in self.layers:
            for g in layer.groups:
                yield g.shard

    def release_gathered(self) -> None:
        """Frees every gathered buffer, the resident frozen groups of ``Prefetch.keep_gathered``
        included (they are gathered again when next used). Call it after writing shards
        yourself; ``zerocore.load_checkpoint`` does."""
        self.runtime.release()

    def iter_full_states(self, trainable_only: bool = False, *, to_rank: int | None = None
                         ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Collective: ``(layer index, {parameter name: full CPU tensor})`` layer by layer, so
        host memory holds one full layer at a time; trainable parameters in fp32 from the
        master weights, frozen ones in the param dtype (none with ``trainable_only``).

        to_rank: None, every rank receives every layer; r, only rank r of the group does (the
        one that writes an export): the others yield empty dicts, but must iterate as far,
        since each layer is a collective."""
        if to_rank is not None and (type(to_rank) is not int
                                    or not 0 <= to_rank < self.world_size):
            raise ValueError(f"iter_full_states: to_rank must be a rank of the group "
                             f"(0 .. {self.world_size - 1}) or None, got {to_rank!r}")
        self.lockstep.collective(FULL_STATE)
        # The masters are read: an overlapped optimizer pass ends first, its failure agreed.
        settle_updates(self.trainable_shards(), together=True)
        return ((layer.index, layer.full_state(trainable_only, to_rank=to_rank))
                for layer in self.layers)

    # -- accumulation ------------------------------------------------------------------------

    def set_requires_all_reduce(self, requires: bool) -> None:
        """HSDP: whether the next backward's gradient shards are all-reduced across the
        replicas (default True). Set False for the micro-batches before the last of an
        accumulation, True for the last: the earlier ones' sums wait, in fp32, and cross the
        replicas once, with the last one's (FSDP2's ``set_requires_all_reduce``). Until then
        the gradient shards do not hold those micro-batches: step the optimizer only after a
        backward that all-reduced. Flat layouts have nothing to all-reduce: it changes
        nothing there."""
        if type(requires) is not bool:
            raise TypeError(f"set_requires_all_reduce takes True or False, got {requires!r}")
        if self.ctx.replicas is not None:
            self.ctx.replicas.requires_all_reduce = requires

    def replicas_agree(self) -> bool:
        """Collective (every rank of the mesh): whether HSDP's replicas hold the same bits:
        each rank's trainable shards (fp32 masters and 16-bit model copies) hashed, and the
        hashes of each place in the shard dim compared across the replicas; the same answer on
        every rank. True for a flat layout (one copy). It reads every trainable shard once:
        a check for the end of a run, not for every step."""
        self.lockstep.collective(REPLICAS)  # every rank compares here, or every rank says where
        settle_updates(self.trainable_shards(), together=True)  # (an overlapped pass's state)
        digest = hashlib.sha256()
        for shard in self.trainable_shards():
            for t in (shard, shard.model_copy):
                if t is not None:
                    digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
        mine = (self.rank, digest.hexdigest())
        every = all_gather_objects(mine, self.mesh.whole,
                                   comm_device(self.mesh.whole, _CPU, self.device))
        by_place: dict[int, set[str]] = {}
        for place, hexdigest in every:
            by_place.setdefault(place, set()).add(hexdigest)
        return all(len(d) == 1 for d in by_place.values())

    # -- accounting --------------------------------------------------------------------------

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Bytes of model state this rank holds, measured from the tensors, next to the
        (2+2+K)·Ψ/N_d prediction (N_d: the ranks the state is sharded over, all of them with
        hpZ); and what is held now beyond it (gathered buffers, hpZ's secondary shards). Pass
        the optimizer to count its state."""
        return memory_report_of(list(self.layers), self.rank, self.world_size, self.device,
                                self.mixed_precision, self.frozen_weights, optimizer,
                                self.ctx.arena, hpz=self.mesh.hpz, store=self.ctx.store)

    def expected_traffic(self, forward_only: bool = False) -> tuple[int, int]:
        """(bytes all-gathered, bytes reduce-scattered) one step should move (within the shard
        group); ``forward_only``: the forward's gathers alone."""
        return self.schedule.traffic(
            [groups_of(layer) for layer in self.layers],
            reduce_bytes=self.mixed_precision.grad_reduce_dtype.itemsize,
            forward_only=forward_only)

    def expected_across_traffic(self) -> tuple[int, int]:
        """hpZ: (bytes gathered, bytes reduce-scattered) across the nodes by one forward and
        backward: each forward gather's secondary shard (1/S of it; backward's gathers stay in
        the node), and each trainable group's secondary gradient slice (1/S of it, in the
        reduce dtype, or its int8 message: ``AcrossNodes.reduce_nbytes``); (0, 0) otherwise."""
        across = self.ctx.across
        if across is None:
            return 0, 0
        forward, _ = self.expected_traffic(forward_only=True)
        return (across.gather_nbytes(forward),
                sum(across.reduce_nbytes(l.trainable.layout.padded_numel,
                                         self.mixed_precision.grad_reduce_dtype)
                    for l in self.layers if l.trainable is not None))

    def expected_replica_traffic(self) -> int:
        """Bytes HSDP all-reduces across the replicas per optimizer step: every trainable
        group's shard, once, in the reduce dtype, or quantized (``Replicas.nbytes``); 0 when
        flat, or with one replica."""
        replicas = self.ctx.replicas
        if replicas is None:
            return 0
        return sum(replicas.nbytes(l.trainable.layout.shard_numel,
                                   self.mixed_precision.grad_reduce_dtype)
                   for l in self.layers if l.trainable is not None)

    def comm_report(self, reset: bool = False) -> CommReport:
        """Bytes moved by each kind of collective since the last reset, and the per-step
        expectation: every layer gathered in forward and again in backward, except layers no
        autograd node covers (before the first trainable one, when the input needs no
        gradient) and those kept gathered between the passes (``Prefetch.keep_last``,
        ``keep_gathered``); trainable gradients reduced once; with HSDP each gradient shard
        all-reduced across the replicas once per optimizer step; with hpZ each forward's
        secondary shards gathered and each micro-batch's secondary gradient slices
        reduce-scattered across the nodes; and how they travelled."""
        gather, reduce = self.expected_traffic()
        across_gather, across_reduce = self.expected_across_traffic()
        c = self.counter
        report = CommReport(c.all_gather_bytes, c.reduce_scatter_bytes, c.all_reduce_bytes,
                            gather, reduce, ways=transport.ways(self.layers),
                            replica_all_reduce_bytes=c.replica_all_reduce_bytes,
                            expected_replica_all_reduce_bytes=self.expected_replica_traffic(),
                            layout=self.mesh.line(), hybrid=self.mesh.hybrid,
                            nodes=self.mesh.nodes or 1,
                            across_all_gather_bytes=c.replicate_all_gather_bytes,
                            across_reduce_scatter_bytes=c.replicate_reduce_scatter_bytes,
                            expected_across_all_gather_bytes=across_gather,
                            expected_across_reduce_scatter_bytes=across_reduce,
                            hpz=self.mesh.hpz)
        if reset:
            c.reset()
        return report


def groups_of(layer: ShardedLayer) -> list[tuple[int, bool, int]]:
    """A layer's groups as ``Schedule.traffic`` counts them."""
    return [(g.layout.padded_numel, g.trainable, g.gather_bytes) for g in layer.groups]
