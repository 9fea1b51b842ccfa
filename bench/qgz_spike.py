"""qgZ's loss against the exact run's, on a stable run and through a loss spike (issue 40,
item 6): the toy transformer of tests/support/toy_stack.py on a 2x2 HSDP mesh of gloo ranks,
two micro-batches a step, no clipping, at each learning rate given; per step the mean loss of
the exact HSDP run, of qgZ (``Comm(quantize_gradients="int8")``), and of flat sharding over
the 4 ranks (the same mean summed in another order: what any reordering of the sums moves).

    python bench/qgz_spike.py --lr 1e-2 3e-2 1e-1 --steps 20
"""

from __future__ import annotations

import argparse

import torch

import zerocore
from tests.support.dist_utils import World
from tests.support.hybrid_runs import MICRO, mean_losses, mesh_of
from tests.support.toy_stack import WEIGHT_DECAY, Spec, make_layers


def losses(rank: int, world_size: int, way: str, lr: float, steps: int,
           dtype: torch.dtype) -> list[float]:
    """The mean loss over the ranks at each step of one run (``way``: exact, qgz, flat)."""
    torch.manual_seed(0)
    spec = Spec(model="transformer", steps=steps, micro=MICRO, param_dtype=dtype)
    where = {} if way == "flat" else dict(mesh=mesh_of((2, 2)))
    comm = zerocore.Comm(quantize_gradients="int8" if way == "qgz" else None)
    model = zerocore.shard(make_layers(spec), comm=comm,
                           mixed_precision=zerocore.MixedPrecision(dtype), **where)
    opt = zerocore.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    return mean_losses(model, opt, spec, rank, world_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lr", type=float, nargs="+", default=[1e-2, 3e-2, 1e-1])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    with World(4) as world:
        for lr in args.lr:
            runs = {way: world.run(losses, way, lr, args.steps, dtype, timeout=900)[0]
                    for way in ("exact", "qgz", "flat")}
            exact = runs["exact"]

            def dev(other: list[float], steps: range) -> float:
                return max(abs(exact[s] - other[s]) / exact[s] for s in steps)

            # The spike: the step whose loss rose most over the one before.
            spike = max(range(1, args.steps), key=lambda s: exact[s] / exact[s - 1])
            every = range(args.steps)
            print(f"lr {lr:g} {args.dtype}: loss {exact[0]:.3f} -> {exact[-1]:.3f}; largest "
                  f"rise x{exact[spike] / exact[spike - 1]:.2f} at step {spike}; qgZ vs exact "
                  f"{dev(runs['qgz'], range(spike + 1)):.2%} up to it, "
                  f"{dev(runs['qgz'], every):.2%} in all; flat vs exact "
                  f"{dev(runs['flat'], range(spike + 1)):.2%} up to it, "
                  f"{dev(runs['flat'], every):.2%} in all", flush=True)


if __name__ == "__main__":
    main()
