"""``zerocore.plan`` for ``zerocore.shard``'s stacks: the step on fake tensors in
``ShardedSequential``'s order, layer by layer, as ``LayerFunction`` runs each."""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import get_gradient_edge

from zerocore.planning.ledger import Ledger
from zerocore.planning.memory_plan import GRADIENTS


class _Output(torch.autograd.Function):
    """The stack's output as the loss sees it: like ``LayerFunction``'s, it needs a gradient
    but holds nothing of its own, so the loss alone decides how long the output lives; its
    backward hands the gradient to the simulation (``catch``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, anchor: torch.Tensor, catch: list) -> torch.Tensor:
        ctx.catch = catch
        return y.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.catch.append(grad)
        return None, None, None


class StackStep(Ledger):
    """The step of a stack, in the engine's order."""

    # the schedule
    def run(self, example: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        simulated = min(self.opt.micro_batches, 2)  # the second sees gradients present
        for m in range(simulated):
            label = f"micro-batch {m + 1}, " if simulated > 1 else ""
            passes = self.forward(example, label)
            self.backward(passes, loss, label)   # (takes the output: the loss may free it)
        self.point("optimizer step")   # gradients, moments and masters all present
        self.ledger[GRADIENTS] = 0     # zero_grad(set_to_none=True)

    def forward(self, example: torch.Tensor, label: str):
        layers = self.layers
        nodes = []   # (layer, x_in, leaves, y, previous graph layer)
        previous = None
        self.gather(layers[0])
        x = example
        for i, layer in enumerate(layers):
            if self.schedule.prefetch_forward and i + 1 < len(layers):
                self.gather(layers[i + 1])
            needs_graph = layer.trainable is not None or x.requires_grad
            with self.region(f"{label}forward of layer {i}"), self.fake, self.tracker, \
                    self.tracker.saved_hooks():
                if needs_graph:
                    x_in = x.detach().requires_grad_(x.requires_grad)
                    if layer.recompute:
                        with torch.no_grad():
                            self.install(layer, with_grad_leaves=False)
                            y = layer.module(x_in)
                        nodes.append([layer, x_in, None, None, previous, True])
                    else:
                        with torch.enable_grad():
                            leaves = self.install(layer, with_grad_leaves=True)
                            y = layer.module(x_in)
                        # LayerFunction keeps the output's gradient edge, not the output
                        edge = get_gradient_edge(y) if y.requires_grad else None
                        nodes.append([layer, x_in, leaves, edge, previous, False])
                    previous = layer
                    x = y.detach().requires_grad_(True)
                else:
                    with torch.no_grad():
                        self.install(layer, with_grad_leaves=False)
                        x = layer.module(x)
            last = i + 1 == len(layers)
            if not (needs_graph and self.schedule.keeps_for_backward(i, last=last)):
                self.free(layer)
        return [nodes, x]

    def backward(self, passes: list, loss: Callable[[torch.Tensor], torch.Tensor],
                 label: str) -> None:
        nodes = passes.pop(0)
        caught: list[torch.Tensor] = []
        with self.region(f"{label}loss and its backward"), self.fake, self.tracker, \
                self.tracker.saved_hooks():
            anchor = torch.empty(1, requires_grad=True)
            out = _Output.apply(passes.pop(0).detach(), anchor, caught)
            value = loss(out)
            del out          # what the loss did not keep goes now, as in a training loop
            value.backward()
            del value
            dy = caught.pop()
        for node in reversed(nodes):
            layer, x_in, leaves, output, previous, recomputed = node
            node[1:4] = [None, None, None]          # ctx.inner = None
            self.gather(layer)                      # (prefetched by the layer after it)
            if self.schedule.prefetch_backward and previous is not None:
                self.gather(previous)
            with self.region(f"{label}backward of layer {layer.index}"), self.fake, \
                    self.tracker, self.tracker.saved_hooks():
                y = None
                if recomputed:   # the forward again, under autograd
                    with torch.enable_grad():
                        leaves = self.install(layer, with_grad_leaves=True)
                        y = layer.module(x_in)
                    output = y if y.requires_grad else None
                inputs = ([x_in] if x_in.requires_grad else []) + leaves
                grads = (list(torch.autograd.grad(output, inputs, dy, allow_unused=True))
                         if output is not None and inputs else [None] * len(inputs))
                dx = grads.pop(0) if x_in.requires_grad else None
            # LayerFunction.backward holds y, grad_y and the parameters' gradients until it
            # returns, after packing and after delivering the previous layer's reduce.
            packed = self.pack(layer, label)
            self.free(layer)
            self.hand_over(layer, packed)
            del grads, y, leaves, x_in
            dy = dx
        self.end_backward(label)
