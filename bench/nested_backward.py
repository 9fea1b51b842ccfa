"""What an autograd Function per layer costs by itself (issue 23, item 3's bound): plain torch,
no sharding, one process, one thread. The same deep stack of small layers as layer_cost.py,
trained two ways, alternately (harness.Interleaved):
- ``one backward``: the stack's forward and one ``loss.backward()``, as the unsharded model runs;
- ``a backward per layer``: each layer's forward on a detached input and, in backward, one
  ``torch.autograd.grad`` per layer from the layer after it, which was the structure of
  ``zerocore.shard``'s ``LayerFunction`` (its inner graph differentiated in its backward) until
  issue 29 made the hooks the one runtime.
The difference is the host cost of torch's autograd engine entered once per layer, which no
code of zerocore's adds to or can remove while the layer runs through an autograd Function.

    python bench/nested_backward.py [--layers 96] [--width 64] [--rounds 20]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import harness

ROWS, SEQ = 8, 16  # as layer_cost.py


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
              for _ in range(args.layers)]
    x0 = torch.randn(ROWS, SEQ, args.width)

    def one_backward(_round: int) -> None:
        x = x0
        for layer in layers:
            x = layer(x)
        x.square().mean().backward()

    def per_layer(_round: int) -> None:
        inputs, outputs = [], []
        x = x0
        for layer in layers:
            x_in = x.detach().requires_grad_(True)
            x = layer(x_in)
            inputs.append(x_in)
            outputs.append(x)
        grad = torch.autograd.grad(x.square().mean(), x)[0]
        for layer, x_in, y in zip(reversed(layers), reversed(inputs), reversed(outputs)):
            grad = torch.autograd.grad(y, [x_in, *layer.parameters()], grad)[0]

    print(harness.header(f"bench/nested_backward.py: {args.layers} layers of Linear("
                         f"{args.width}, {args.width}) + GELU, fp32, {ROWS} x {SEQ} rows, "
                         f"1 thread; {args.rounds} rounds", packages=("torch",)))
    rounds = harness.Interleaved({"one backward": one_backward,
                                  "a backward per layer": per_layer},
                                 warmup=2).run(args.rounds)
    base = rounds.median_s("one backward")
    rows = [(name, f"{rounds.median_s(name) / args.layers * 1e6:.1f}",
             f"{(rounds.median_s(name) - base) / args.layers * 1e6:+.1f}")
            for name in ("one backward", "a backward per layer")]
    print(harness.table(("way", "µs per layer per step", "vs one backward"), rows, "lrr"))


if __name__ == "__main__":
    main()
