"""``zerocore.shard``: the public entry point, and ``ShardedSequential``, the module it returns.

``ShardedSequential`` runs its layers in order. Before a layer runs it waits for that layer's
all-gather (started while the previous layer computed) and starts the next one's; after it runs
it frees the gathered buffers, except the last layer's when backward will follow (it is the
first layer backward needs: ``Prefetch.keep_last``). Backward is driven by ``LayerFunction``
nodes (sharded_layer.py), coordinated by one ``BackwardCoordinator``.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zerocore.comm.device import Platform
from zerocore.engine.meta_layer import MetaLayer
from zerocore.engine.sharded_layer import LayerFunction, ShardedLayer
from zerocore.engine.sharding import (Sharding, agree_on_structure, fingerprint, prepare_device,
                                      process_group)
from zerocore.policies import (Comm, Compile, FrozenWeights, MixedPrecision, Offload, Prefetch,
                               Recompute)


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


class ShardedSequential(nn.Module, Sharding):
    """Runs sharded layers in order, each through an autograd Function; see ``zerocore.shard``.
    What it shares with ``shard_model``'s sharding (reports, full states, release, the layers
    kept gathered) is ``Sharding``'s."""

    def __init__(self, layers: Iterable[nn.Module], *, group: dist.ProcessGroup,
                 device: torch.device, mixed_precision: MixedPrecision, prefetch: Prefetch,
                 offload: Offload, recompute: Recompute | None = None,
                 frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
                 compile: Compile | None = None, host_threads: int | None = None):
        nn.Module.__init__(self)
        Sharding.__init__(self, group, device, mixed_precision=mixed_precision,
                          prefetch=prefetch, offload=offload, recompute=recompute,
                          frozen_weights=frozen_weights, comm=comm, compile=compile,
                          host_threads=host_threads)
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
            sharded.append(self.new_layer(layer, len(sharded), read=read))
            if sharded[-1].trainable_shard is not None:
                # Named as nn.Sequential(*layers) names them: "<layer index>.<name>".
                sharded[-1].trainable_shard.prefix_names(f"{len(sharded) - 1}.")
            del layer, read  # materialised layers may be freed one by one (see `shard`)
        if not sharded:
            raise ValueError("zerocore.shard: got no layers")
        self._coordinator = self.seal(sharded)
        self.layers = nn.ModuleList(sharded)
        # Layers left gathered by the last forward for their backward; empty when none is.
        self._kept: list[ShardedLayer] = []

    def param_name(self, index: int, name: str) -> str:
        return f"{index}.{name}"  # nn.Sequential(*layers)'s name of it

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
            if self.schedule.prefetch_forward and i + 1 < len(layers):
                layers[i + 1].start_gather()
            needs_graph = torch.is_grad_enabled() and (
                layer.trainable is not None or (isinstance(x, torch.Tensor) and x.requires_grad))
            if needs_graph:
                shards = (layer.trainable_shard,) if layer.trainable_shard is not None else ()
                x = LayerFunction.apply(self._coordinator, layer, previous, x, *shards)
                previous = layer
            else:
                x = layer.run_without_graph(x)
            if needs_graph and self.schedule.keeps_for_backward(i, last=i + 1 == len(layers)):
                # Its backward finds it gathered (then frees it); if none runs, the next
                # forward or the end of another backward frees it.
                self._kept.append(layer)
            else:
                layer.free()
        return x


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
        (the engine around it stays eager; see zerocore/engine/compiled.py). Layers given as
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
    dev, host_threads = prepare_device(device, group, offload, platform)
    return ShardedSequential(layers, group=group, device=dev,
                             mixed_precision=mixed_precision, prefetch=prefetch, offload=offload,
                             recompute=recompute, frozen_weights=frozen_weights, comm=comm,
                             compile=compile, host_threads=host_threads)
