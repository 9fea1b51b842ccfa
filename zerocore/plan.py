"""``zerocore.plan``: what a sharded training step will hold in memory and move, per rank, from
the layers' shapes alone: before renting the machines. ``plan`` for a stack that
``zerocore.shard`` would take, ``plan_model`` for a model that ``zerocore.shard_model`` would.

The plan is the engine's own step, rehearsed (zerocore/planning/rehearsed_step.py): the same
front door's class shards a copy of the layers over a planned world of ``world_size`` ranks
(torch's fake process group: collectives that move nothing) on fake tensors
(``torch._subclasses.FakeTensorMode``: shapes and dtypes, no memory, torch's own kernels'
choices), then zerocore's AdamW trains it one step, and the next step is measured: every
storage it keeps alive is counted, the gathered buffers' resizes included, and the peak is the
largest sum. So the plan holds what the step holds, not what a formula hopes: the logits and the
loss's fp32 copies, the parameter gradients of a layer before they are packed, the prefetched
layer, the last layer kept gathered, a second micro-batch's forward with gradients present, and
whatever the engine will do that it does not yet.

Fake tensors run the CPU's kernel choices (fake tensors are CPU tensors): attention by
``scaled_dot_product_attention`` then keeps what a fused (flash) kernel keeps, q, k, v, the
output and one fp32 value per query, as the flash and memory-efficient CUDA kernels do; the
meta device would have run the math kernel, which keeps the T x T weights. A plan for CUDA
takes CUDA's decisions (the transport's ways, no spare buffers: the caching allocator reuses
memory) on those CPU tensors.

On a GPU the caching allocator and CUDA itself take memory that no tensor accounts for; the
plan adds a stated ``headroom`` for it (``CUDA_HEADROOM``). On the CPU there is none, and the
CPU has one memory: host and device bytes add up (``MemoryPlan.peak_bytes``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zerocore.comm import mesh as meshes
from zerocore.engine.host_arena import host_memory_bytes
from zerocore.engine.meta_layer import MetaLayer
from zerocore.engine.rehearsal import Rehearsal
from zerocore.engine.sharded_model import ShardedModel, unit_modules
from zerocore.engine.sharded_sequential import ShardedSequential
from zerocore.planning.memory_plan import (  # noqa: F401  (the names a plan is read by)
    ACTIVATIONS, CATEGORIES, CUDA_FIXED_HEADROOM, CUDA_HEADROOM_FRACTION, FROZEN, GATHERED,
    GiB, GRAD_BUFFERS, GRADIENTS, MASTERS, MIRRORS, NVME_POOL, OPTIMIZER, SECONDARY, TRAINABLE,
    WINDOWS, MemoryPlan, ModelState)
from zerocore.planning.pass_overlap import (  # noqa: F401  (the pass's estimate)
    H100, THIS_CPU, Machine, PassOverlap, overlap_lines, pass_overlap)
from zerocore.planning.rehearsed_step import Step, rehearse
from zerocore.policies import (Comm, FrozenWeights, Hybrid, MixedPrecision, Offload, Prefetch,
                               Recompute)

__all__ = ["plan", "plan_model", "MemoryPlan", "ModelState", "CATEGORIES", "ACTIVATIONS",
           "FROZEN", "GATHERED", "GRAD_BUFFERS", "GRADIENTS", "MASTERS", "MIRRORS", "NVME_POOL",
           "OPTIMIZER", "SECONDARY", "TRAINABLE", "WINDOWS", "CUDA_FIXED_HEADROOM",
           "CUDA_HEADROOM_FRACTION", "GiB",
           "pass_overlap", "overlap_lines", "PassOverlap", "Machine", "THIS_CPU", "H100"]

_CPU = torch.device("cpu")


def plan(layers: Iterable[nn.Module | MetaLayer], example: torch.Tensor, *, world_size: int,
         loss: Callable[[torch.Tensor], torch.Tensor] | None = None, device: str = "cuda",
         mixed_precision: MixedPrecision = MixedPrecision(), prefetch: Prefetch = Prefetch(),
         offload: Offload = Offload(), recompute: Recompute | None = None,
         micro_batches: int = 1, frozen_weights: FrozenWeights = FrozenWeights(),
         comm: Comm = Comm(), mesh: tuple[int, int] | None = None,
         hybrid: Hybrid | None = None, nodes: int = 1, count_flops: bool = False,
         host_memory: int | None = None) -> MemoryPlan:
    """The memory and communication of one training step of ``zerocore.shard(layers, ...)``
    on ``world_size`` ranks, per rank, from shapes alone.

    layers: the stack as it would be given to ``shard`` (parameters' shapes, dtypes and
        ``requires_grad`` are what count: build it on the meta device; ``MetaLayer``s too). A
        copy is planned: the layers are left as they are.
    example: the first layer's input for one micro-batch of one rank (a meta tensor will do).
    loss: maps the last layer's output to the scalar whose backward the step runs, as the
        training loop computes it (default: the output's sum).
    device: "cuda" (NCCL: reduce-scatter buffers, the allocator's headroom) or "cpu" (gloo).
    micro_batches: forward/backward passes per optimizer step (gradient accumulation).
    mesh: ``(replicas, shards)`` for HSDP (``shard(mesh=)`` with a 2-D mesh of that shape; their
        product is ``world_size``), each replica a node: memory per rank is that of
        ``shards`` ranks, parameter and reduce-scatter traffic stays in the node, and
        ``replica_all_reduce_bytes`` cross the nodes (the accumulation's last micro-batch
        alone all-reduces). None: flat over ``world_size`` ranks.
    hybrid: how the mesh shares the model, as ``shard(hybrid=)``: ``zerocore.Hybrid("hpz")``
        plans hpZ (memory per rank that of ``world_size`` ranks plus the secondary shards held
        between forward and backward; ``across_all_gather_bytes`` and
        ``across_reduce_scatter_bytes`` cross the nodes); needs ``mesh`` with more than one
        replica.
    nodes: the nodes a flat layout's ranks span (``inter_node_bytes``: all its traffic when
        more than one); with ``mesh``, its replicas are the nodes.
    count_flops: count the step's floating-point operations (``MemoryPlan.flops``, else
        None) with torch's ``FlopCounterMode``; it makes a plan about half as slow again.
    comm: how gradients travel (``zerocore.Comm``), which decides what the transport holds. On
        the CPU, ``"auto"`` plans for ranks of one Linux host that may read each other's memory
        (what ``shard`` finds there unless ptrace is restricted); plan with
        ``Comm(peer_read="off")`` for ranks that cannot.
    host_memory: the physical memory of each node's host, in bytes (default: this machine's),
        which ``Offload(pool_bytes=None)`` chooses the NVMe pool from, as ``shard`` does on
        the run's hosts (``zerocore.auto_pool_bytes``, for the ranks of one node).
    The policies are ``shard``'s and the optimizer ``zerocore.optim``'s Adam(W), which holds
    its moments from construction; gradients are dropped by ``zero_grad(set_to_none=True)``.
    """
    _check("plan", device, world_size, micro_batches)
    shape = meshes.check_shape(mesh, world_size, "plan")
    _check_nodes("plan", nodes, world_size, shape)
    pool_chosen = offload.nvme and offload.pool_bytes is None
    offload = _with_pool(offload, host_memory, world_size, nodes, shape)
    _check_hybrid("plan", hybrid, shape, world_size)
    fake = FakeTensorMode()
    stack = [_planned(l.module if isinstance(l, MetaLayer) else l, fake) for l in layers]
    if not stack:
        raise ValueError("plan: got no layers")
    loss = loss if loss is not None else (lambda y: y.sum())
    with fake:
        x = torch.empty(example.shape, dtype=example.dtype)
    held: dict[str, nn.Module] = {}

    def build(rehearsal: Rehearsal) -> ShardedSequential:
        read = _LoadingRead(*stack)
        held["model"] = ShardedSequential(
            [MetaLayer(m, read) for m in stack],
            mesh=meshes.planned(shape, world_size, hybrid),
            device=_CPU, mixed_precision=mixed_precision, prefetch=prefetch, offload=offload,
            recompute=recompute, frozen_weights=frozen_weights, comm=comm, rehearsal=rehearsal,
            hybrid=hybrid)
        read.close()
        return held["model"]

    return _saying_pool_chosen(
        rehearse(Step(build, lambda: loss(held["model"](x)), buffers=_buffer_bytes(*stack),
                      world_size=world_size,
                      device=device, comm=comm, offload=offload,
                      micro_batches=micro_batches, mesh=shape, nodes=nodes,
                      count_flops=count_flops), fake,
                 exclude=[x]), pool_chosen)


def plan_model(model: nn.Module, units: Iterable[nn.Module] | nn.Module, example: Any = (), *,
               world_size: int, example_kwargs: dict[str, Any] | None = None,
               loss: Callable[[Any], torch.Tensor] | None = None, device: str = "cuda",
               mixed_precision: MixedPrecision = MixedPrecision(),
               prefetch: Prefetch = Prefetch(), offload: Offload = Offload(),
               recompute: Recompute | None = None, micro_batches: int = 1,
               frozen_weights: FrozenWeights = FrozenWeights(),
               comm: Comm = Comm(), mesh: tuple[int, int] | None = None,
               hybrid: Hybrid | None = None, nodes: int = 1, count_flops: bool = False,
               host_memory: int | None = None) -> MemoryPlan:
    """The memory and communication of one training step of ``zerocore.shard_model(model,
    units, ...)`` on ``world_size`` ranks, per rank, from shapes alone: ``shard_model``'s own
    engine shards a copy of the model and runs its own forward on fake tensors.

    model, units: as ``shard_model`` takes them (build the model on the meta device; a copy is
        planned, the model is left as it is).
    example: the model's positional input for one micro-batch of one rank (a tensor or a
        tuple; meta tensors will do); ``example_kwargs`` its keyword arguments.
    loss: maps the model's output to the scalar whose backward the step runs (default: the
        output's ``loss`` when it has one, as a ``transformers`` model given labels does, else
        the output's sum).
    The rest as for ``plan`` (``hybrid``, ``host_memory`` too); ``Recompute``'s positions are
    the units'.
    """
    _check("plan_model", device, world_size, micro_batches)
    shape = meshes.check_shape(mesh, world_size, "plan_model")
    _check_nodes("plan_model", nodes, world_size, shape)
    pool_chosen = offload.nvme and offload.pool_bytes is None
    offload = _with_pool(offload, host_memory, world_size, nodes, shape)
    _check_hybrid("plan_model", hybrid, shape, world_size)
    names = {id(m): n for n, m in model.named_modules()}
    chosen = unit_modules(model, units)   # refused as shard_model refuses them
    fake = FakeTensorMode()
    copied = _planned(model, fake)
    copied_units = [copied.get_submodule(names[id(u)]) for u in chosen]
    loss = loss if loss is not None else _default_loss
    args = example if isinstance(example, tuple) else (example,)
    kwargs = dict(example_kwargs or {})
    with fake:
        args = tuple(torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t
                     for t in args)
        kwargs = {k: torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t
                  for k, t in kwargs.items()}
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]

    def build(rehearsal: Rehearsal) -> ShardedModel:
        read = _LoadingRead(copied)
        sharded = ShardedModel(copied, copied_units,
                               mesh=meshes.planned(shape, world_size, hybrid), device=_CPU,
                               mixed_precision=mixed_precision, prefetch=prefetch,
                               offload=offload, frozen_weights=frozen_weights, comm=comm,
                               recompute=recompute, read=read, rehearsal=rehearsal,
                               hybrid=hybrid)
        read.close()
        return sharded

    return _saying_pool_chosen(
        rehearse(Step(build, lambda: loss(copied(*args, **kwargs)),
                      buffers=_buffer_bytes(copied), world_size=world_size,
                      device=device, comm=comm, offload=offload,
                      micro_batches=micro_batches, mesh=shape, nodes=nodes,
                      count_flops=count_flops), fake,
                 exclude=inputs), pool_chosen)


def _with_pool(offload: Offload, host_memory: int | None, world_size: int, nodes: int,
               shape: tuple[int, int] | None) -> Offload:
    """``offload`` with the NVMe pool ``shard`` would choose on the planned hosts when it is
    None (``Offload.with_pool``): a node's ranks (an HSDP mesh's shards, each replica a node;
    else ``world_size / nodes``) on a host of ``host_memory`` bytes (None: this machine's)."""
    if offload.pool_bytes is not None or not offload.nvme:
        return offload
    if host_memory is not None and (type(host_memory) is not int or host_memory <= 0):
        raise ValueError(f"plan: host_memory must be a number of bytes above 0, got "
                         f"{host_memory!r}")
    per_node = shape[1] if shape is not None else world_size // nodes
    memory = host_memory if host_memory is not None else host_memory_bytes()
    return offload.with_pool(memory, per_node)


def _saying_pool_chosen(plan: MemoryPlan, chosen: bool) -> MemoryPlan:
    """``plan``, whose state says its NVMe pool was chosen (``ModelState.pool_chosen``) when
    ``_with_pool`` chose it: the rehearsal is given the pool's size alone, as an explicit
    one."""
    if not chosen:
        return plan
    return dataclasses.replace(plan, state=dataclasses.replace(plan.state, pool_chosen=True))


def _planned(module: nn.Module, fake: FakeTensorMode) -> nn.Module:
    """A copy of ``module`` for the plan: parameters on the meta device (read as fake tensors
    by the engine, as ``MetaLayer``'s are), buffers as fake CPU tensors (their values are never
    read)."""
    module = copy.deepcopy(module).to("meta")
    with fake:
        for name, buf in list(module.named_buffers()):
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            owner._buffers[attr] = torch.empty(buf.shape, dtype=buf.dtype)
    return module


class _LoadingRead:
    """The engine's rank-local read of meta parameters, in a plan (run under its fake mode):
    what ``zerocore.hf_pretrained``'s reader holds at most, so that the plan's loading
    (``MemoryPlan.loading``) is that reader's. It keeps one buffer from read to read, as large
    as the largest piece so far stored in fp32 (the widest dtype a checkpoint stores
    parameters in), and converts each piece to the parameter's dtype: at a read both are
    held, 4 bytes per element and the parameter's own (the conversion is a copy here even in
    fp32, which bounds a bf16 checkpoint read into fp32 too: 2 + 4). ``close``, as the
    reader is closed when the loading returns, lets the buffer go."""

    def __init__(self, *modules: nn.Module):
        self._dtypes = {name: p.dtype for m in modules
                        for name, p in m.named_parameters(remove_duplicate=False)}
        self._buffer = torch.empty(0)

    def __call__(self, name: str, start: int, stop: int) -> torch.Tensor:
        if self._buffer.numel() < stop - start:
            self._buffer = torch.empty(stop - start, dtype=torch.float32)
        return torch.empty(stop - start, dtype=self._dtypes.get(name, torch.float32))

    def close(self) -> None:
        self._buffer = torch.empty(0)


def _buffer_bytes(*modules: nn.Module) -> int:
    """The modules' buffers' bytes: every rank holds them whole, from the loading on."""
    return sum(b.numel() * b.element_size() for m in modules for b in m.buffers())


def _default_loss(output: Any) -> torch.Tensor:
    value = getattr(output, "loss", None)
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(output, torch.Tensor):
        return output.sum()
    raise ValueError(f"plan_model: the model returned a {type(output).__name__} with no "
                     f"'loss'; pass loss=, mapping the model's output to the training loss")


def _check(what: str, device: str, world_size: Any, micro_batches: Any) -> None:
    if device not in ("cuda", "cpu"):
        raise ValueError(f"{what}: device must be 'cuda' or 'cpu', got {device!r}")
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"{what}: world_size must be a positive int, got {world_size!r}")
    if type(micro_batches) is not int or micro_batches < 1:
        raise ValueError(f"{what}: micro_batches must be a positive int, got "
                         f"{micro_batches!r}")


def _check_hybrid(what: str, hybrid: Any, shape: tuple[int, int] | None,
                  world_size: int) -> None:
    """Refuses a hybrid layout the planned mesh cannot give, as ``shard`` refuses it."""
    if hybrid is not None and not isinstance(hybrid, Hybrid):
        raise TypeError(f"{what}: hybrid must be a zerocore.Hybrid or None, got "
                        f"{type(hybrid).__name__}")
    meshes.refuse_hybrid(meshes.planned(shape, world_size, hybrid), hybrid, what,
                         fix="mesh=(nodes, ranks_per_node)")


def _check_nodes(what: str, nodes: Any, world_size: int, shape: tuple[int, int] | None) -> None:
    if type(nodes) is not int or nodes < 1 or world_size % nodes:
        raise ValueError(f"{what}: nodes must be a positive int dividing world_size="
                         f"{world_size}, got {nodes!r}")
    if shape is not None and nodes not in (1, shape[0]):
        raise ValueError(f"{what}: an HSDP mesh's nodes are its {shape[0]} replicas; leave "
                         f"nodes out (got nodes={nodes})")
