"""``zerocore.plan``: what a sharded training step will hold in memory and move, per rank, from
the layers' shapes alone: before renting the machines. ``plan`` for a stack that
``zerocore.shard`` would take, ``plan_model`` for a model that ``zerocore.shard_model`` would
(its units' hooks run as the engine's do); the simulations live in ``zerocore/planning/``.

Model state is counted from the flat layouts ``zerocore.shard`` would build (the same
``FlatLayout``), so it is exact. Everything that comes and goes during a step — gathered
layers, packed gradients, gradient shards, activations — is found by running the step's
schedule once on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes, no
memory, torch's own kernels' choices): the layers' forward and backward, the loss, recomputation,
in the engine's order, while a counter follows every tensor the step creates and frees. The
engine's own buffers are added where the engine allocates and frees them (``ShardedSequential``,
``LayerFunction``, ``BackwardCoordinator``); the peak is the largest sum at any point of the
step. So the plan holds what the step holds, not what a formula hopes: the logits and the
loss's fp32 copies, the parameter gradients of a layer before they are packed, the prefetched
layer, the last layer kept gathered, a second micro-batch's forward with gradients present.

Fake tensors run the CPU's kernel choices (fake tensors are CPU tensors): attention by
``scaled_dot_product_attention`` then keeps what a fused (flash) kernel keeps, q, k, v, the
output and one fp32 value per query, as the flash and memory-efficient CUDA kernels do; the
meta device would have run the math kernel, which keeps the T x T weights.

On a GPU the caching allocator and CUDA itself take memory that no tensor accounts for; the
plan adds a stated ``headroom`` for it (``CUDA_HEADROOM``). On the CPU there is none, and the
CPU has one memory: host and device bytes add up (``MemoryPlan.peak_bytes``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zerocore.comm.transport import resolve
from zerocore.engine.meta_layer import MetaLayer
from zerocore.engine.schedule import Schedule
from zerocore.planning.ledger import Ledger
from zerocore.planning.memory_plan import (  # noqa: F401  (the names a plan is read by)
    ACTIVATIONS, CATEGORIES, CUDA_FIXED_HEADROOM, CUDA_HEADROOM_FRACTION, FROZEN, GATHERED,
    GiB, GRAD_BUFFERS, GRADIENTS, MASTERS, MIRRORS, OPTIMIZER, TRAINABLE, Layer, MemoryPlan,
    ModelState, Options, layer_of, model_state)
from zerocore.planning.model import ModelStep, model_layers
from zerocore.planning.stack import StackStep
from zerocore.policies import (Comm, FrozenWeights, MixedPrecision, Offload, Prefetch,
                               Recompute)


def plan(layers: Iterable[nn.Module | MetaLayer], example: torch.Tensor, *, world_size: int,
         loss: Callable[[torch.Tensor], torch.Tensor] | None = None, device: str = "cuda",
         mixed_precision: MixedPrecision = MixedPrecision(), prefetch: Prefetch = Prefetch(),
         offload: Offload = Offload(), recompute: Recompute | None = None,
         micro_batches: int = 1, frozen_weights: FrozenWeights = FrozenWeights(),
         comm: Comm = Comm()) -> MemoryPlan:
    """The memory and communication of one training step of ``zerocore.shard(layers, ...)``
    on ``world_size`` ranks, per rank, from shapes alone.

    layers: the stack as it would be given to ``shard`` (parameters' shapes, dtypes and
        ``requires_grad`` are what count: build it on the meta device; ``MetaLayer``s too).
    example: the first layer's input for one micro-batch of one rank (a meta tensor will do).
    loss: maps the last layer's output to the scalar whose backward the step runs, as the
        training loop computes it (default: the output's sum).
    device: "cuda" (NCCL: reduce-scatter buffers, the allocator's headroom) or "cpu" (gloo).
    micro_batches: forward/backward passes per optimizer step (gradient accumulation).
    comm: how gradients travel (``zerocore.Comm``), which decides what the transport holds. On
        the CPU, ``"auto"`` plans for ranks of one Linux host that may read each other's memory
        (what ``shard`` finds there unless ptrace is restricted); plan with
        ``Comm(peer_read="off")`` for ranks that cannot.
    The policies are ``shard``'s and the optimizer ``zerocore.optim``'s Adam(W), which holds
    its moments from construction; gradients are dropped by ``zero_grad(set_to_none=True)``.
    """
    _check("plan", device, world_size, micro_batches)
    stack = [layer_of(l.module if isinstance(l, MetaLayer) else l, i, world_size,
                      frozen_weights.int8_block)
             for i, l in enumerate(layers)]
    if not stack:
        raise ValueError("plan: got no layers")
    opt = _options(world_size, device, mixed_precision, prefetch, offload, micro_batches,
                   frozen_weights, comm)
    # The engine's own schedule (what is kept, prefetched, recomputed), from the same sizes.
    schedule = Schedule.of(prefetch, recompute,
                           [l.gathered_bytes(opt.param_bytes) for l in stack])
    fake = FakeTensorMode()
    for layer in stack:
        layer.recompute = layer.index in schedule.recomputed
        _fake_buffers(layer.module, fake)
    with fake:
        fake_example = torch.empty(example.shape, dtype=example.dtype)
    step = StackStep(stack, model_state(stack, opt), opt, schedule, fake)
    step.excluded.add(fake_example.untyped_storage()._cdata)
    step.run(fake_example, loss if loss is not None else (lambda y: y.sum()))
    gather, reduce = schedule.traffic(_traffic_groups(stack, opt), reduce_bytes=opt.reduce_bytes)
    return _result(step, gather, reduce)


def plan_model(model: nn.Module, units: Iterable[nn.Module] | nn.Module, example: Any = (), *,
               world_size: int, example_kwargs: dict[str, Any] | None = None,
               loss: Callable[[Any], torch.Tensor] | None = None, device: str = "cuda",
               mixed_precision: MixedPrecision = MixedPrecision(),
               prefetch: Prefetch = Prefetch(), offload: Offload = Offload(),
               recompute: Recompute | None = None, micro_batches: int = 1,
               frozen_weights: FrozenWeights = FrozenWeights(),
               comm: Comm = Comm()) -> MemoryPlan:
    """The memory and communication of one training step of ``zerocore.shard_model(model,
    units, ...)`` on ``world_size`` ranks, per rank, from shapes alone: the model's own forward
    runs on fake tensors, its units gathered, freed, kept and prefetched by hooks where the
    engine's are, the root gathered from the model's first operation to the end of backward.

    model, units: as ``shard_model`` takes them (build the model on the meta device; a copy is
        planned, the model is left as it is).
    example: the model's positional input for one micro-batch of one rank (a tensor or a
        tuple; meta tensors will do); ``example_kwargs`` its keyword arguments.
    loss: maps the model's output to the scalar whose backward the step runs (default: the
        output's ``loss`` when it has one, as a ``transformers`` model given labels does, else
        the output's sum).
    The rest as for ``plan``; ``Recompute``'s positions are the units'.
    """
    _check("plan_model", device, world_size, micro_batches)
    opt = _options(world_size, device, mixed_precision, prefetch, offload, micro_batches,
                   frozen_weights, comm)
    copied, modules, layers = model_layers(model, units, world_size, frozen_weights.int8_block)
    schedule = Schedule.of(prefetch, recompute, [l.gathered_bytes(opt.param_bytes)
                                                 for l in layers],
                           recomputable=len(layers) - 1)
    fake = FakeTensorMode()
    for layer in layers:
        layer.recompute = layer.index in schedule.recomputed
    _fake_buffers(copied, fake)
    args = example if isinstance(example, tuple) else (example,)
    with fake:
        fake_args, fake_kwargs = (
            [torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t
             for t in values] for values in (args, (example_kwargs or {}).values()))
    kwargs = dict(zip((example_kwargs or {}).keys(), fake_kwargs))
    step = ModelStep(copied, modules, layers, model_state(layers, opt), opt, schedule, fake)
    for t in [*fake_args, *fake_kwargs]:
        if isinstance(t, torch.Tensor):
            step.excluded.add(t.untyped_storage()._cdata)
    step.run(tuple(fake_args), kwargs, loss if loss is not None else _default_loss)
    gather, reduce = schedule.traffic(_traffic_groups(layers[:-1], opt),
                                      reduce_bytes=opt.reduce_bytes,
                                      root=_traffic_groups(layers[-1:], opt)[0])
    return _result(step, gather, reduce)


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


def _options(world_size: int, device: str, mixed_precision: MixedPrecision,
             prefetch: Prefetch, offload: Offload, micro_batches: int,
             frozen_weights: FrozenWeights, comm: Comm) -> Options:
    return Options(world_size=world_size, device=device,
                   param_bytes=mixed_precision.param_dtype.itemsize,
                   reduce_bytes=mixed_precision.grad_reduce_dtype.itemsize,
                   param_dtype=mixed_precision.param_dtype, prefetch=prefetch,
                   offload=offload.optimizer, micro_batches=micro_batches,
                   frozen_weights=frozen_weights,
                   reduce_way=resolve(comm, gloo=device == "cpu", world_size=world_size,
                                      can_read=device == "cpu" and comm.peer_read == "auto")[1])


def _fake_buffers(module: nn.Module, fake: FakeTensorMode) -> None:
    """The module's buffers as fake CPU tensors (their values are never read)."""
    with fake:
        for name, buf in list(module.named_buffers()):
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            setattr(owner, attr, torch.empty(buf.shape, dtype=buf.dtype))


def _traffic_groups(layers: list[Layer], opt: Options) -> list[list[tuple[int, bool, int]]]:
    return [[(g.layout.padded_numel, g.trainable, opt.gather_bytes(g)) for g in layer.groups]
            for layer in layers]


def _result(step: Ledger, gather: int, reduce: int) -> MemoryPlan:
    opt, state = step.opt, step.state
    device_tensors = sum(v for k, v in step.peak.items()
                         if opt.device == "cpu" or k not in state.on_host)
    headroom = (CUDA_FIXED_HEADROOM + int(CUDA_HEADROOM_FRACTION * device_tensors)
                if opt.device == "cuda" else 0)
    host = (sum(v for k, v in step.peak.items() if k in state.on_host)
            if opt.device == "cuda" else 0)
    return MemoryPlan(
        world_size=opt.world_size, device=opt.device, state=state, peak=step.peak,
        peak_phase=step.peak_phase, gathered_peak=step.gathered_peak,
        activations_peak=step.activations_peak, host_peak=host, headroom=headroom,
        all_gather_bytes=gather * opt.micro_batches,
        reduce_scatter_bytes=reduce * opt.micro_batches,
        recomputed_layers=tuple(l.index for l in step.layers if l.recompute))
