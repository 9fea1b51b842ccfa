"""What the lockstep costs (issue 39, item 1: every gather, reduction and optimizer step says
first where each rank is, comm/lockstep.py): the step of the same sharded stack with the
exchange on and off, on both gloo transports, interleaved with an A/A control.

    python bench/lockstep_cost.py [--layers 96] [--width 64] [--rounds 10] [--nproc 2]

The stack is bench/layer_cost.py's (``Linear(width, width)`` + GELU per layer, fp32, 8 x 16
rows per rank): at width 64 the step is almost all host overhead, so the figure is the host
cost per layer; at a larger width (``--layers 6 --width 512``) it is an end-to-end step whose
arithmetic dominates. Models in the same ranks, stepped alternately in a seeded random order
per round:
- ``read, on`` / ``read, on A/A``: peer reading (the default on one host), the exchange through
  its pipes; two identical models, whose ratio is the noise band of the run;
- ``read, off``: the same with the exchange switched off (``Lockstep.enabled``, an internal
  switch for this measurement; no policy turns it off);
- ``collective, on`` / ``collective, off``: gloo's collectives (``Comm(peer_read="off")``), the
  exchange one all-gather of an int64 per rank.
Reported: the median step time over the rounds per layer (microseconds, the slowest rank), and
each "on" against its "off".
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn

import harness
import zerocore

ROWS, SEQ = 8, 16
VARIANTS = ("read, on", "read, on A/A", "read, off", "collective, on", "collective, off")


def stack(layers: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    base = stack(args.layers, args.width)
    engines = {}
    for name in VARIANTS:
        transport, state = name.split(", ")[0], name.split(", ")[1]
        comm = zerocore.Comm() if transport == "read" else zerocore.Comm(peer_read="off")
        model = zerocore.shard(copy.deepcopy(base), comm=comm)
        model.lockstep.enabled = state != "off"
        engines[name] = (model, zerocore.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(ROWS, SEQ, args.width, generator=torch.Generator().manual_seed(rank))

    def step(name: str):
        model, opt = engines[name]

        def run(_round: int) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    rounds = harness.Interleaved({name: step(name) for name in engines}, warmup=2,
                                 before=lambda name: dist.barrier()).run(args.rounds)
    return {name: rounds.median_s(name) / args.layers * 1e6 for name in engines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--nproc", type=int, nargs="+", default=[2])
    args = p.parse_args()
    print(harness.header(f"{args.layers} layers of Linear({args.width}, {args.width}) + GELU, "
                         f"fp32, {ROWS} x {SEQ} rows per rank; {args.rounds} rounds",
                         packages=("torch",)))
    rows = []
    for nproc in args.nproc:
        per_rank = harness.run_ranks(rank_main, nproc, args)
        worst = {name: max(r[name] for r in per_rank) for name in VARIANTS}
        for name in VARIANTS:
            off = worst[name.split(", ")[0] + ", off"]
            rows.append((nproc, name, f"{worst[name]:.1f}",
                         f"{worst[name] * args.layers / 1e3:.2f}", f"{worst[name] / off:.3f}"))
    print(harness.table(("world size", "transport, exchange", "µs per layer per step",
                         "ms per step", "vs off"), rows, "rlrrr"))


if __name__ == "__main__":
    main()
