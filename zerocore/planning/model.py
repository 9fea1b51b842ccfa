"""``zerocore.plan_model`` for ``zerocore.shard_model``'s models: the model's own forward and
backward on fake tensors, with hooks where ``ShardedModel`` has its own, changing the ledger as
the engine changes its buffers:

- a unit's forward pre-hook gathers it (and prefetches the unit that came next in the previous
  forward); its forward hook frees it, unless the schedule keeps it for its backward;
- the unit's trainable views are the outputs of one autograd node (``_Views``, as
  ``UnitParams``): when autograd has every parameter's gradient, it packs them and hands the
  reduction over;
- a gradient hook on the unit's outputs gathers it again for its backward (and prefetches the
  unit before it); it is freed once its parameters' node and its inputs' gradient are both done;
- the root (every parameter no single unit owns) is gathered from the model's pre-hook to the
  end of backward.

``Recompute`` runs the units' forward under the same non-reentrant checkpoint as the engine.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import register_multi_grad_hook
from torch.utils import _pytree as pytree

from zerocore.engine.schedule import Schedule
from zerocore.engine.sharded_model import assign_params, recomputing, unit_modules
from zerocore.planning.ledger import Ledger
from zerocore.planning.memory_plan import (GRADIENTS, Layer, ModelState, Options,
                                           layer_from_params)


def model_layers(model: nn.Module, units: Iterable[nn.Module] | nn.Module, world_size: int,
                 int8_block: int | None) -> tuple[nn.Module, list[nn.Module], list[Layer]]:
    """A copy of the model, its units' modules in it, and the layers: the units in the order
    given, then the root, split into flat groups as ``shard_model`` splits them."""
    names = {id(m): n for n, m in model.named_modules()}
    chosen = unit_modules(model, units)   # refused as shard_model refuses them
    copied = copy.deepcopy(model)         # the caller's model keeps its parameters
    modules = [copied.get_submodule(names[id(u)]) for u in chosen]
    per_unit, root = assign_params(copied, modules)
    layers = [layer_from_params(m, params, i, world_size, int8_block)
              for i, (m, params) in enumerate(zip([*modules, copied], [*per_unit, root]))]
    if not any(l.groups for l in layers):
        raise ValueError("plan_model: the model has no parameters to shard")
    return copied, modules, layers


@dataclasses.dataclass(eq=False)
class _Call:
    """One forward call of a unit that built a graph, until its backward is done."""

    layer: Layer
    previous: Layer | None      # the unit before it in this forward: backward's next
    waiting: int | None = 0     # parts of its backward still to come; None: the root


class _Views(torch.autograd.Function):
    """The unit's trainable views, as ``UnitParams`` makes them: one node whose backward runs
    once every parameter's gradient is there."""

    @staticmethod
    def forward(ctx, step: "ModelStep", call: _Call, anchor: torch.Tensor):
        ctx.step, ctx.call = step, call
        ctx.set_materialize_grads(False)
        return tuple(step.views(call.layer.trainable))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.step.params_done(ctx.call)
        return None, None, None


def _requiring_grad(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.requires_grad]


class ModelStep(Ledger):
    """The step of a ``shard_model`` model: its forward and backward, the hooks in charge."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], layers: list[Layer],
                 state: ModelState, opt: Options, schedule: Schedule, fake: FakeTensorMode):
        super().__init__(layers, state, opt, schedule, fake)
        self.model = model
        self.root = layers[-1]
        self.order: list[Layer] = layers[:-1]   # the previous forward's (the given at first)
        self.order_now: list[Layer] = []
        self.calls: dict[int, _Call | None] = {}
        self.depth = 0
        self.label = ""
        self.observing = True
        with fake:
            self.anchor = torch.empty(1, requires_grad=True)   # stands for the shards
        for module, layer in zip(modules, layers):
            if layer.recompute:
                module.forward = recomputing(module.forward)
            module.register_forward_pre_hook(self._unit_pre(layer), with_kwargs=True)
            module.register_forward_hook(self._unit_post(layer), with_kwargs=True)
        model.register_forward_pre_hook(self._root_pre, with_kwargs=True)
        model.register_forward_hook(self._root_post, with_kwargs=True)

    def _observe(self, phase: str, activations: int) -> None:
        if self.observing:
            super()._observe(phase, activations)

    def run(self, args: tuple, kwargs: dict, loss: Callable[[Any], torch.Tensor]) -> None:
        # A forward without a graph first: the engine prefetches in the order of the previous
        # forward, which is the step planned here (its frozen resident groups gathered too).
        self.observing = False
        with self.fake, torch.no_grad():
            self.model(*args, **kwargs)
        self.observing = True
        simulated = min(self.opt.micro_batches, 2)   # the second sees gradients present
        for m in range(simulated):
            self.label = f"micro-batch {m + 1}, " if simulated > 1 else ""
            self.tracker.start_region()
            with self.fake, self.tracker, self.tracker.saved_hooks():
                with torch.enable_grad():
                    output = self.model(*args, **kwargs)
                    value = loss(output)
                del output   # what the loss did not keep goes now, as in a training loop
                value.backward()
                del value
            self._observe(f"{self.label}end of the backward's work", self.tracker.region_peak)
            self.end_backward(self.label)
        self.point("optimizer step")   # gradients, moments and masters all present
        self.ledger[GRADIENTS] = 0     # zero_grad(set_to_none=True)

    # the hooks, as ShardedModel's
    def _install(self, layer: Layer, with_graph: bool) -> _Call | None:
        if not with_graph:
            self.install(layer, with_grad_leaves=False)
            return None
        previous = self.order_now[-2] if len(self.order_now) > 1 else None
        call = _Call(layer, None if layer is self.root else previous,
                     waiting=None if layer is self.root else 0)
        views = None
        if layer.trainable is not None:
            views = _Views.apply(self, call, self.anchor)
            if call.waiting is not None:
                call.waiting += 1
        self.install(layer, with_grad_leaves=False, trainable_views=views)
        return call

    def _unit_pre(self, layer: Layer):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            with self.event(f"{self.label}forward of unit {layer.index}"):
                position = len(self.order_now)
                self.order_now.append(layer)
                self.gather(layer)
                before = self.order
                if (self.schedule.prefetch_forward and position + 1 < len(before)
                        and before[position] is layer and before[position + 1] is not layer):
                    self.gather(before[position + 1])
            inputs = _requiring_grad((args, kwargs))
            graph = torch.is_grad_enabled() and (layer.trainable is not None or bool(inputs))
            call = self._install(layer, graph)
            self.calls[layer.index] = call
            if call is not None and inputs:
                call.waiting += 1
                register_multi_grad_hook(inputs, lambda grads: self._part_done(call),
                                         mode="all")
        return hook

    def _unit_post(self, layer: Layer):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            call = self.calls.pop(layer.index, None)
            outputs = _requiring_grad(output) if call is not None else []
            if outputs:
                register_multi_grad_hook(outputs, lambda grad: self._backward_begins(call),
                                         mode="any")
                last = self.order[-1] if self.order else None
                if self.schedule.keeps_for_backward(layer.index, last=layer is last):
                    return
            with self.event(f"{self.label}unit {layer.index} freed after its forward"):
                self.free(layer)
        return hook

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.depth += 1
        if self.depth == 1:
            if self.order_now:
                self.order = self.order_now
            self.order_now = []
            with self.event(f"{self.label}forward of the root"):
                self.gather(self.root)
            self._install(self.root, torch.is_grad_enabled())

    def _root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and not _requiring_grad(output):
            with self.event(f"{self.label}the root freed after the forward"):
                self.free(self.root)   # else gathered until the end of backward

    def _backward_begins(self, call: _Call) -> None:
        with self.event(f"{self.label}backward of unit {call.layer.index}"):
            self.gather(call.layer)
            if self.schedule.prefetch_backward and call.previous is not None:
                self.gather(call.previous)

    def params_done(self, call: _Call) -> None:
        """UnitParams.backward: the unit's gradients packed, the reduction handed over."""
        layer = call.layer
        with self.event(f"{self.label}backward of unit {layer.index}: gradients packed"):
            self.hand_over(layer, self.pack(layer, self.label))
        self._part_done(call)

    def _part_done(self, call: _Call) -> None:
        if call.waiting is None:
            return   # the root: freed when the whole backward ends
        call.waiting -= 1
        if call.waiting == 0:
            with self.event(f"{self.label}unit {call.layer.index} freed after its backward"):
                self.free(call.layer)
