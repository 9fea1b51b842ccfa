"""``zerocore.shard``: the public entry point, and ``ShardedSequential``, the module it returns.

``ShardedSequential`` runs its layers in order, each a unit of the one runtime (runtime.py), as
``zerocore.shard_model`` runs a model's units: gathered by a hook before it runs (the next one
prefetched), freed after it ran unless the schedule keeps it for its backward, gathered again
for its backward. A parameter that two layers share (tied weights: an embedding and the readout)
belongs to the root unit, gathered for the whole forward and backward, as in ``shard_model``.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zerocore.comm import mesh as meshes
from zerocore.comm.device import Platform
from zerocore.comm.mesh import Mesh
from zerocore.engine.compiled import refuse_compiled_call
from zerocore.engine.meta_layer import MetaLayer, RangeReader
from zerocore.engine.rehearsal import Rehearsal
from zerocore.engine.runtime import Unit
from zerocore.engine.sharded_layer import Params, ShardedLayer, collect_params
from zerocore.engine.sharded_param import prefix_names
from zerocore.engine.sharding import (Hosts, Sharding, fingerprint, groups_of,
                                      prepare_device)
from zerocore.policies import (Comm, Compile, FrozenWeights, Hybrid, MixedPrecision, Offload,
                               Prefetch, Recompute)


def _tied_across_layers(layers: Sequence[nn.Module | MetaLayer]) -> dict[int, tuple]:
    """Parameters that more than one layer holds, by id: (the name ``nn.Sequential(*layers)``
    gives it, the parameter, every (owner module, attribute) in any layer, the layer it is first
    named in)."""
    seen: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]], set[int], int]] = {}
    for i, layer in enumerate(layers):
        module = layer.module if isinstance(layer, MetaLayer) else layer
        for name, p, owners in collect_params(module):
            entry = seen.setdefault(id(p), (f"{i}.{name}", p, [], set(), i))
            entry[2].extend(owners)
            entry[3].add(i)
    return {key: (name, p, owners, first) for key, (name, p, owners, where, first)
            in seen.items() if len(where) > 1}


def _check_not_tied(layer: nn.Module, index: int,
                    owners: weakref.WeakValueDictionary[int, nn.Parameter]) -> None:
    """Layers given one at a time (an iterator): refuses a parameter already seen in an earlier
    layer, already sharded by then, and remembers this layer's. (A function of its own so that
    no loop variable keeps a full parameter alive afterwards.)"""
    for name, p in layer.named_parameters():
        if owners.get(id(p)) is p:
            raise ValueError(f"zerocore.shard: parameter {name} of layer {index} also belongs to "
                             f"an earlier layer; weights tied across layers need the layers as a "
                             f"list (or nn.Sequential / nn.ModuleList), so that every layer is "
                             f"seen before any is sharded; got an iterator")
    for p in layer.parameters():
        owners[id(p)] = p


class ShardedSequential(nn.Module, Sharding):
    """Runs sharded layers in order; see ``zerocore.shard``. What it shares with
    ``shard_model``'s sharding (the runtime, reports, full states, release, the layers kept
    gathered) is ``Sharding``'s."""

    def __init__(self, layers: Iterable[nn.Module | MetaLayer], *, mesh: Mesh,
                 device: torch.device, mixed_precision: MixedPrecision, prefetch: Prefetch,
                 offload: Offload, recompute: Recompute | None = None,
                 frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
                 compile: Compile | None = None, host_threads: int | None = None,
                 rehearsal: Rehearsal | None = None, hybrid: Hybrid | None = None,
                 hosts: Hosts | None = None):
        nn.Module.__init__(self)
        Sharding.__init__(self, mesh, device, mixed_precision=mixed_precision,
                          prefetch=prefetch, offload=offload, recompute=recompute,
                          frozen_weights=frozen_weights, comm=comm, compile=compile,
                          host_threads=host_threads, rehearsal=rehearsal, hybrid=hybrid,
                          hosts=hosts)
        given = isinstance(layers, (list, tuple, nn.Sequential, nn.ModuleList))
        tied = _tied_across_layers(layers) if given else {}
        readers: dict[int, RangeReader] = {}
        sharded: list[ShardedLayer] = []
        owners: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
        iterator = iter(layers)
        index = 0
        # Each layer is a build step every rank agrees on (Sharding.attempt / agree): one that
        # fails on one rank (its values, their quantization, memory) is raised on every rank
        # at the next agreement, naming the rank and the layer.
        while True:
            layer = self.attempt(index, lambda: next(iterator, None), even_after_failure=True)
            read = None
            if isinstance(layer, MetaLayer):
                layer, read = layer.module, layer.read
                readers[index] = read
            params: Params | None = None
            if layer is not None:
                params = [e for e in collect_params(layer) if id(e[1]) not in tied]
            print_ = None if params is None else fingerprint((n, p) for n, p, _ in params)
            if not self.agree(index, print_, "zerocore.shard"):
                break
            if not given:
                _check_not_tied(layer, index, owners)
            if layer is not None:  # (refused on this rank, raised on all at the next agree)
                self.attempt(index, functools.partial(refuse_compiled_call, layer,
                                                      f"layer {index}"))
            built = self.attempt(index, lambda: self.new_layer(layer, index, read=read,
                                                               params=params))
            if built is not None:
                sharded.append(built)
                if built.trainable_shard is not None:
                    # Named as nn.Sequential(*layers) names them: "<layer index>.<name>".
                    prefix_names(built.trainable_shard, f"{index}.")
            index += 1
            del layer, read, params, built  # materialised layers may be freed one by one
        if not sharded:
            raise ValueError("zerocore.shard: got no layers")
        self.num_units = len(sharded)
        # The root: the weights tied across layers (none, usually: then it has no groups and
        # is not one of ``layers``, which checkpoints index).
        root_params = [(name, p, owners) for name, p, owners, _ in tied.values()]
        firsts = {name: first for name, _, _, first in tied.values()}
        what = "zerocore.shard: the weights tied across layers"
        self.agree(len(sharded), fingerprint((n, p) for n, p, _ in root_params), what)
        root = self.attempt(len(sharded), functools.partial(
            ShardedLayer, nn.Module(), len(sharded), self.ctx, self.world_size,
            read=_root_reader(readers, firsts), params=root_params))
        self.settle(what)
        del root_params, tied
        self.layers = nn.ModuleList(sharded + ([root] if root.groups else []))
        self._units: list[ShardedLayer] = sharded  # what forward runs, in order
        self.seal(list(self.layers), recomputable=len(sharded))
        units = [Unit(str(i), layer.module, layer) for i, layer in enumerate(sharded)]
        self.start(self, units + [Unit("", self, root)], root_owners=[])

    def param_name(self, index: int, name: str) -> str:
        # nn.Sequential(*layers)'s name of it; the root's are named so already.
        return name if index >= self.num_units else f"{index}.{name}"

    def expected_traffic(self, forward_only: bool = False) -> tuple[int, int]:
        units, root = self.layers[:self.num_units], self.layers[self.num_units:]
        # A trainable root (tied weights) puts every layer in backward, as its first use does.
        return self.schedule.traffic(
            [groups_of(layer) for layer in units],
            reduce_bytes=self.mixed_precision.grad_reduce_dtype.itemsize,
            input_requires_grad=any(l.trainable is not None for l in root),
            root=groups_of(root[0]) if root else None, forward_only=forward_only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._units:
            x = layer.module(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {layer.index} returned {type(x).__name__}; the layers "
                                f"of zerocore.shard map one tensor to one tensor (use "
                                f"zerocore.shard_model for any other model)")
        return x


def _root_reader(readers: dict[int, RangeReader], firsts: dict[str, int]) -> RangeReader | None:
    """Reads a tied parameter (named ``"<layer>.<name>"``) through the reader of the
    ``MetaLayer`` it is first named in."""
    if not readers:
        return None

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        index = firsts[name]
        return readers[index](name[len(f"{index}."):], start, stop)
    return read


def shard(layers: Iterable[nn.Module | MetaLayer], *, group: dist.ProcessGroup | None = None,
          mesh: DeviceMesh | None = None, device: torch.device | str | None = None,
          mixed_precision: MixedPrecision = MixedPrecision(), prefetch: Prefetch = Prefetch(),
          offload: Offload = Offload(), recompute: Recompute | None = None,
          frozen_weights: FrozenWeights = FrozenWeights(), comm: Comm = Comm(),
          compile: Compile | None = None, hybrid: Hybrid | None = None,
          platform: Platform | None = None) -> ShardedSequential:
    """Shards a stack of layers across the ranks of a process group (ZeRO-3).

    layers: an ``nn.Sequential``, ``nn.ModuleList``, list or any iterable of modules (a generator
        that builds each layer when asked keeps host memory near one layer), each mapping one
        tensor to one tensor, identical on every rank (same structure, same initial values: seed
        every rank alike or load the same checkpoint). Each layer's trainable parameters
        (``requires_grad`` now) and frozen parameters become two flat groups of which this rank
        keeps 1/N; the modules keep only their buffers. A parameter shared by several layers
        (tied weights) becomes the root's, gathered for the whole step (layers given as a
        sequence; an iterator with tied weights is refused). A ``zerocore.MetaLayer(module,
        read)`` in place of a layer has its meta parameters read by range: each rank reads only
        its shard's elements.
    group: the process group (default: the world). torch.distributed must be initialised; one
        process works too (world size 1).
    mesh: a torch ``DeviceMesh`` instead of ``group`` (as FSDP2's ``fully_shard(mesh=)``):
        1-D, sharded over its group, as ``group=`` would; 2-D with dims ``(replicate, shard)``,
        HSDP: parameters, gradients and optimizer state sharded over the shard dim (lay it out
        within a node: ``init_device_mesh("cuda", (nodes, gpus_per_node))``) and replicated
        over the replicate dim; gathers and reduce-scatters stay within the shard group, and
        each rank's gradient shard is all-reduced across its replicas, on the backward that
        ``model.set_requires_all_reduce`` allows (every one by default; with accumulation,
        set it False before the micro-batches before the last). ``model.group`` is then the
        shard group (what ``zerocore.LossScaler`` takes).
    hybrid: how a 2-D mesh shares the model (``zerocore.Hybrid``): None or ``Hybrid("hsdp")``,
        HSDP as above; ``Hybrid("hpz")``, ZeRO++'s hpZ: masters, gradients and optimizer state
        sharded over all the mesh's ranks (``model.group`` is then the whole mesh's group), a
        layer's forward gathering across the nodes once and keeping a node-local secondary
        shard from which its backward gathers within the node. Refused without a 2-D mesh,
        and for hpZ with one replica.
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
    platform: what this process can run on, and its host's memory (default
        ``zerocore.Platform.detect``: torch, ``zerocore.BUILD``, the host); pass one to check a
        configuration without the hardware (its ``host`` and ``host_memory`` are what an NVMe
        pool of ``Offload(pool_bytes=None)`` is chosen from).
    Returns a module running the layers in order. Give ``model.parameters()`` (or
    ``model.trainable_shards()``) to ``zerocore.optim.AdamW``.
    """
    ranks = meshes.resolve(group, mesh, "zerocore.shard", nodes=meshes.nodes_of(os.environ),
                           hybrid=hybrid)
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise TypeError("zerocore.shard expects a sequence of layers (nn.Sequential, "
                        "nn.ModuleList or list), not a single module")
    dev, host_threads, hosts = prepare_device(device, ranks, offload, platform)
    return ShardedSequential(layers, mesh=ranks, device=dev,
                             mixed_precision=mixed_precision, prefetch=prefetch, offload=offload,
                             recompute=recompute, frozen_weights=frozen_weights, comm=comm,
                             compile=compile, host_threads=host_threads, hybrid=hybrid,
                             hosts=hosts)
