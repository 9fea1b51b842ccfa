"""``zerocore.shard``: the public entry point, and ``ShardedSequential``, the module it returns.

``ShardedSequential`` runs its layers in order. Before a layer runs it waits for that layer's
all-gather (started while the previous layer computed) and starts the next one's; after it runs
it frees the gathered buffers, except the last layer's when backward will follow (it is the
first layer backward needs: ``Prefetch.keep_last``). Backward is driven by ``LayerFunction``
nodes (sharded_layer.py), coordinated by one ``BackwardCoordinator``.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zerocore import BUILD, collectives, transport
from zerocore.collectives import CommCounter, PeerMemory
from zerocore.compiled import Compile
from zerocore.device import Platform, agree_on_devices, resolve_device
from zerocore.flat_group import GroupContext
from zerocore.meta_layer import MetaLayer
from zerocore.offload import OffloadStreams, cpu_threads
from zerocore.policies import Comm, FrozenWeights, MixedPrecision, Offload, Prefetch, Recompute
from zerocore.report import CommReport, MemoryReport, expected_traffic
from zerocore.sharded_layer import BackwardCoordinator, LayerFunction, ShardedLayer
from zerocore.sharded_param import ShardParameter


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """A 63-bit hash of parameters' names, shapes, dtypes and trainability."""
    desc = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in named)
    return int.from_bytes(hashlib.sha1(desc.encode()).digest()[:8], "little") >> 1


def agree_on_structure(index: int, print_: int | None, group: dist.ProcessGroup,
                       device: torch.device, what: str = "zerocore.shard") -> bool:
    """Checks that every rank is at the same layer (or unit) with the same structure
    (``fingerprint``, None when this rank has none left); False when every rank has run out.
    Ranks given different stacks would otherwise issue mismatched collectives and hang; here
    each fails at once with a clear message. One tiny all-gather per layer, so layers can be
    materialised one at a time."""
    world = dist.get_world_size(group)
    mine = torch.tensor([0 if print_ is None else 1, 0 if print_ is None else print_],
                        dtype=torch.int64, device=device)
    every = torch.empty(world * 2, dtype=torch.int64, device=device)
    collectives.all_gather_sync(every, mine, group)
    present, prints = every.view(world, 2).unbind(1)
    if present.min() != present.max():
        raise ValueError(f"{what}: ranks were given different numbers of layers (ranks "
                         f"{present.eq(0).nonzero().flatten().tolist()} have no layer {index}); "
                         f"every rank must pass the same stack")
    if prints.min() != prints.max():
        raise ValueError(f"{what}: layer {index} differs between ranks (parameter names, "
                         f"shapes, dtypes or requires_grad); every rank must pass the same stack "
                         f"with the same trainable parameters")
    return bool(present[0])


def build_context(group: dist.ProcessGroup, device: torch.device,
                  mixed_precision: MixedPrecision, offload: Offload,
                  frozen_weights: FrozenWeights, comm: Comm) -> GroupContext:
    """What every flat group of one sharded model shares (its counter, offload's streams, the
    transport between ranks of one host)."""
    streams = (OffloadStreams(device)
               if offload.optimizer and device.type == "cuda" else None)
    peers = PeerMemory(comm.timeout_s) if comm.peer_read == "auto" else None
    return GroupContext(group, dist.get_rank(group), device, mixed_precision.param_dtype,
                        mixed_precision.grad_reduce_dtype, offload.optimizer, CommCounter(),
                        streams, int8_block=frozen_weights.int8_block, peers=peers, comm=comm)


def _check_not_tied(layer: nn.Module, index: int,
                    owners: weakref.WeakValueDictionary[int, nn.Parameter]) -> None:
    """Refuses a parameter already seen in an earlier layer, and remembers this layer's. (A
    function of its own so that no loop variable keeps a full parameter alive afterwards.)"""
    for name, p in layer.named_parameters():
        if owners.get(id(p)) is p:
            raise ValueError(f"zerocore.shard: parameter {name} of layer {index} also belongs to "
                             f"an earlier layer; parameters tied across layers are not supported "
                             f"(untie them or put both users in one layer)")
    for p in layer.parameters():
        owners[id(p)] = p


def memory_report_of(layers: list[ShardedLayer], rank: int, world_size: int,
                     device: torch.device, mixed_precision: MixedPrecision,
                     frozen_weights: FrozenWeights,
                     optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """``memory_report`` of any sharded model: its layers' (or units') groups measured."""
    p_bytes = torch.tensor([], dtype=mixed_precision.param_dtype).element_size()
    param = master = grad = opt = gather = 0
    trainable_numel = frozen_numel = 0
    for layer in layers:
        for g in layer.groups:
            gather += g.gathered_bytes
            shard = g.shard
            if g.trainable:
                trainable_numel += g.layout.numel
                if isinstance(shard, ShardParameter) and shard.model_copy is not None:
                    param += shard.model_copy.numel() * shard.model_copy.element_size()
                    master += shard.numel() * 4
                else:
                    param += shard.numel() * 4
                param += g.mirror_bytes
                if shard.grad is not None:
                    grad += shard.grad.numel() * shard.grad.element_size()
                if optimizer is not None:
                    for key, t in optimizer.state.get(shard, {}).items():
                        if isinstance(t, torch.Tensor) and t.dim() > 0:
                            opt += t.numel() * t.element_size()
            else:
                frozen_numel += g.layout.numel
                param += shard.numel() * shard.element_size()
    n = world_size
    k = 8 if p_bytes == 4 else 12  # Adam moments, plus an fp32 master when computing in 16 bit
    predicted = ((p_bytes + p_bytes + k) * trainable_numel
                 + frozen_weights.frozen_nbytes(frozen_numel, p_bytes)) // n
    dev_alloc = dev_peak = None
    if device.type == "cuda":
        dev_alloc = torch.cuda.memory_allocated(device)
        dev_peak = torch.cuda.max_memory_allocated(device)
    return MemoryReport(rank, n, trainable_numel, frozen_numel, param, master, grad, opt,
                        gather, predicted, dev_alloc, dev_peak)


def iter_full_states_of(layers: list[ShardedLayer], world_size: int, trainable_only: bool,
                        to_rank: int | None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """``iter_full_states`` of any sharded model (its layers, or units); to_rank checked now,
    before the first collective."""
    if to_rank is not None and (type(to_rank) is not int or not 0 <= to_rank < world_size):
        raise ValueError(f"iter_full_states: to_rank must be a rank of the group "
                         f"(0 .. {world_size - 1}) or None, got {to_rank!r}")
    return ((layer.index, layer.full_state(trainable_only, to_rank=to_rank))
            for layer in layers)


class ShardedSequential(nn.Module):
    """Runs sharded layers in order; see ``zerocore.shard``."""

    def __init__(self, layers: Iterable[nn.Module], *, group: dist.ProcessGroup,
                 device: torch.device, mixed_precision: MixedPrecision, prefetch: Prefetch,
                 offload: Offload, recompute: Recompute | None = None,
                 frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
                 compile: Compile | None = None):
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch
        self.offload = offload
        self.recompute = recompute
        self.frozen_weights = frozen_weights
        self.comm = comm
        ctx = build_context(group, device, mixed_precision, offload, frozen_weights, comm)
        self.counter = ctx.counter
        sharded: list[ShardedLayer] = []
        owners: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
        iterator = iter(layers)
        while True:
            layer = next(iterator, None)
            read = None
            if isinstance(layer, MetaLayer):
                layer, read = layer.module, layer.read
            print_ = None if layer is None else fingerprint(layer.named_parameters())
            if not agree_on_structure(len(sharded), print_, group, device):
                break
            _check_not_tied(layer, len(sharded), owners)
            sharded.append(ShardedLayer(layer, len(sharded), ctx, self.world_size, read))
            if compile is not None:
                compile.apply(sharded[-1].module)
            if sharded[-1].trainable_shard is not None:
                # Named as nn.Sequential(*layers) names them: "<layer index>.<name>".
                sharded[-1].trainable_shard.prefix_names(f"{len(sharded) - 1}.")
            sharded[-1].recompute = recompute is not None and recompute.selects(len(sharded) - 1)
            del layer, read  # materialised layers may be freed one by one (see `shard`)
        if not sharded:
            raise ValueError("zerocore.shard: got no layers")
        if recompute is not None:
            recompute.check_range(len(sharded))
        self.layers = nn.ModuleList(sharded)
        self._coordinator = BackwardCoordinator(sharded, prefetch.backward)
        # Prefetch.keep_gathered: the chosen layers' frozen groups stay gathered once gathered,
        # and their trainable groups from forward to backward, as the last layer's do
        # (keep_last). Every rank chooses alike: the sizes are the same everywhere.
        self.kept_layers = prefetch.layers_kept([l.gathered_size for l in sharded])
        for i in self.kept_layers:
            if sharded[i].frozen is not None:
                sharded[i].frozen.resident = True
        # Layers left gathered by the last forward for their backward; empty when none is.
        self._kept: list[ShardedLayer] = []

    def trainable_shards(self) -> list[ShardParameter]:
        """This rank's trainable shards, one per layer with trainable parameters: what the
        optimizer steps (``model.parameters()`` also yields the frozen shards, which have no
        gradient and are skipped by optimizers)."""
        return [l.trainable_shard for l in self.layers if l.trainable_shard is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers: list[ShardedLayer] = list(self.layers)
        for kept in self._kept:
            # Kept by the previous forward: already freed if its backward ran; if not (and it
            # may never run), freed now and gathered afresh below or in that backward (the
            # trainable weights may have changed since; resident frozen groups stay).
            kept.free()
        self._kept = []
        if self.offload.optimizer:
            # Every upload the optimizer made necessary, at once: they overlap the first layers'
            # gathers and computation, and each layer's all-gather waits for its own upload.
            for layer in layers:
                if layer.trainable is not None:
                    layer.trainable.upload()
        previous: ShardedLayer | None = None
        layers[0].start_gather()
        for i, layer in enumerate(layers):
            layer.wait_gather()
            if self.prefetch.forward and i + 1 < len(layers):
                layers[i + 1].start_gather()
            needs_graph = torch.is_grad_enabled() and (
                layer.trainable is not None or (isinstance(x, torch.Tensor) and x.requires_grad))
            if needs_graph:
                shards = (layer.trainable_shard,) if layer.trainable_shard is not None else ()
                x = LayerFunction.apply(self._coordinator, layer, previous, x, *shards)
                previous = layer
            else:
                x = layer.run_without_graph(x)
            if needs_graph and (i in self.kept_layers
                                or (i + 1 == len(layers) and self.prefetch.keep_last)):
                # Its backward finds it gathered (then frees it); if none runs, the next
                # forward or the end of another backward frees it.
                self._kept.append(layer)
            else:
                layer.free()
        return x

    def release_gathered(self) -> None:
        """Frees every gathered buffer, the resident frozen groups of ``Prefetch.keep_gathered``
        included (they are gathered again when next used). Call it after writing frozen shards
        yourself; ``zerocore.load_checkpoint`` does."""
        for layer in self.layers:
            layer.release()
        self._kept = []

    def iter_full_states(self, trainable_only: bool = False, *, to_rank: int | None = None
                         ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Collective: ``(layer index, {parameter name: full CPU tensor})`` layer by layer, so
        host memory holds one full layer at a time; trainable parameters in fp32 from the
        master weights, frozen ones in the param dtype (none with ``trainable_only``).

        to_rank: None, every rank receives every layer; r, only rank r of the group does (the
        one that writes an export): the others yield empty dicts, but must iterate as far,
        since each layer is a collective."""
        return iter_full_states_of(list(self.layers), self.world_size, trainable_only, to_rank)

    # -- accounting ----------------------------------------------------------------------------

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Bytes of model state this rank holds, measured from the tensors, next to the
        (2+2+K)·Ψ/N_d prediction. Pass the optimizer to count its state."""
        return memory_report_of(list(self.layers), self.rank, self.world_size, self.device,
                                self.mixed_precision, self.frozen_weights, optimizer)

    def comm_report(self, reset: bool = False) -> CommReport:
        """Bytes moved by each kind of collective since the last reset, and the per-step
        expectation: every layer gathered in forward and again in backward, except layers no
        autograd node covers (before the first trainable one, when the input needs no
        gradient) and the last layer when kept gathered between the passes
        (``Prefetch.keep_last``); trainable gradients reduced once."""
        gather, reduce = expected_traffic(
            [[(g.layout.padded_numel, g.trainable, g.gather_bytes) for g in layer.groups]
             for layer in self.layers],
            reduce_bytes=self.mixed_precision.grad_reduce_dtype.itemsize,
            keep_last=self.prefetch.keep_last, kept=self.kept_layers)
        c = self.counter
        report = CommReport(c.all_gather_bytes, c.reduce_scatter_bytes, c.all_reduce_bytes,
                            gather, reduce, ways=transport.ways(self.layers))
        if reset:
            c.reset()
        return report


def process_group(group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup:
    """The group to shard over (default: the world); RuntimeError before init_process_group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed to be initialised: call "
                           f"torch.distributed.init_process_group(...) first (for one process: "
                           f"backend='gloo', world_size=1, rank=0)")
    return group if group is not None else dist.group.WORLD


def prepare_device(device: torch.device | str | None, group: dist.ProcessGroup,
                   offload: Offload, platform: Platform | None) -> torch.device:
    """Where this rank computes, checked by every rank together before anything is allocated
    (see ``shard``'s ``device``); GPU ranks that offload get their share of the host's CPU
    threads."""
    dev = resolve_device(device, group)
    if platform is None:
        platform = Platform.detect(dev, kernels_cuda=BUILD.has_cuda)
    placement = agree_on_devices(group, dev, platform)
    if offload.optimizer and dev.type == "cuda":
        # This rank's optimizer steps on the CPU, as every other rank's on this host does.
        torch.set_num_threads(cpu_threads(
            offload.cpu_threads, usable_cores=platform.usable_cores,
            ranks_on_host=placement.ranks_on_host, current=torch.get_num_threads()))
    return dev


def shard(layers: Iterable[nn.Module], *, group: dist.ProcessGroup | None = None,
          device: torch.device | str | None = None,
          mixed_precision: MixedPrecision = MixedPrecision(), prefetch: Prefetch = Prefetch(),
          offload: Offload = Offload(), recompute: Recompute | None = None,
          frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
          compile: Compile | None = None,
          platform: Platform | None = None) -> ShardedSequential:
    """Shards a stack of layers across the ranks of a process group (ZeRO-3).

    layers: an ``nn.Sequential``, ``nn.ModuleList``, list or any iterable of modules (a generator
        that builds each layer when asked keeps host memory near one layer), each mapping one
        tensor to one tensor, identical on every rank (same structure, same initial values: seed
        every rank alike or load the same checkpoint). Each layer's trainable parameters
        (``requires_grad`` now) and frozen parameters become two flat groups of which this rank
        keeps 1/N; the modules
        keep only their buffers. A ``zerocore.MetaLayer(module, read)`` in place of a layer has
        its meta parameters read by range: each rank reads only its shard's elements.
    group: the process group (default: the world). torch.distributed must be initialised; one
        process works too (world size 1).
    device: where layers compute. Default: CUDA when any backend of the group is NCCL
        (``"nccl"``, ``"cpu:gloo,cuda:nccl"``, or ``init_process_group()`` without a backend on
        a GPU machine): the group's ``device_id`` if it was given one, else the current device
        (``torch.cuda.set_device``); otherwise the CPU. Before anything is allocated there, the
        ranks check together that each can compute on its device (a CUDA build of torch, a
        visible GPU, zerocore's CUDA kernels built) and that no two share one GPU; any failure is
        raised on every rank as a ValueError saying what to do.
    frozen_weights: how frozen parameters are stored and gathered (``zerocore.FrozenWeights``;
        ``FrozenWeights("int8")``: int8 with a scale per block, dequantized after each gather).
    recompute: which layers keep only their input in forward and run it again in backward
        (``zerocore.Recompute``); None (default): every layer keeps what its backward needs.
    comm: how ranks exchange data and how long one waits for another (``zerocore.Comm``: pass
        ``Comm(timeout=...)`` with the process group's timeout, so that a stopped or hung rank
        makes the others raise ``zerocore.PeerLost`` naming it within that time).
    compile: ``zerocore.Compile(...)``: each layer's forward is compiled with torch.compile
        (the engine around it stays eager; see zerocore/compiled.py). Layers given as
        ``torch.compile(layer)`` work as well; their parameters keep their plain names.
    platform: what this process can run on (default ``zerocore.Platform.detect``: torch,
        ``zerocore.BUILD``); pass one to check a configuration without the hardware.
    Returns a module running the layers in order. Give ``model.parameters()`` (or
    ``model.trainable_shards()``) to ``zerocore.optim.AdamW``.
    """
    group = process_group(group, "zerocore.shard")
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise TypeError("zerocore.shard expects a sequence of layers (nn.Sequential, "
                        "nn.ModuleList or list), not a single module")
    dev = prepare_device(device, group, offload, platform)
    return ShardedSequential(layers, group=group, device=dev,
                             mixed_precision=mixed_precision, prefetch=prefetch, offload=offload,
                             recompute=recompute, frozen_weights=frozen_weights, comm=comm,
                             compile=compile)
