"""The engine's own host cost per layer (issue 23, item 3): a deep stack of small layers, where
the step is almost all overhead, at world sizes 1 and 2.

    python bench/layer_cost.py [--layers 96] [--width 64] [--rounds 10] [--nproc 1 2]

Each layer is ``Linear(width, width)`` + GELU, fp32, a batch of 8 x 16 rows per rank, so the
arithmetic of a layer is a few microseconds and the step's time is what each engine does
around it: gathering, installing views, autograd bookkeeping, reducing, the optimizer. Engines
in the same ranks, stepped alternately in a seeded random order per round (the machine's load
affects them alike):
- ``shard``: ``zerocore.shard(layers)``, zerocore's AdamW;
- ``shard A/A``: the same again, a second model stepped in the same rounds: the control, whose
  ratio to ``shard`` is the noise band of the run (identical engines differ only by chance);
- ``shard_model``: ``zerocore.shard_model(nn.Sequential(*layers), layers)`` (a unit per layer);
- ``fsdp2``: ``fully_shard`` on every layer and on the stack, ``torch.optim.AdamW`` (fused
  where available);
- ``unsharded``: the plain stack and ``torch.optim.AdamW(fused=True)``, the floor: what the
  arithmetic, autograd and a fused optimizer cost without sharding.
Reported: the median step time over the rounds divided by the number of layers (microseconds
per layer per step, the slowest rank), and for zerocore the part spent issuing and waiting for
its collectives (``CommCounter``'s timers: the transport's share). DeepSpeed is not run here:
it lives in a separate venv (bench/bench_fsdp.py runs it).

``--device cuda`` runs the same on GPUs (NCCL, one GPU per rank; bench/gpu_check.sh does at one
rank), each step ending with a device synchronisation, so that the host's cost per layer stands
beside what the kernels take (the unsharded stack's time is then mostly the kernels').
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import harness
import zerocore

ROWS, SEQ = 8, 16


def stack(layers: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]


def torch_adamw(params) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, TypeError, NotImplementedError):
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    base = stack(args.layers, args.width)
    engines = {}
    for name in ("shard", "shard A/A"):
        model = zerocore.shard(copy.deepcopy(base), device=device)
        engines[name] = (model, zerocore.optim.AdamW(model.parameters(), lr=1e-4),
                         model.counter)
    layers = copy.deepcopy(base)
    seq = nn.Sequential(*layers)
    sharded = zerocore.shard_model(seq, layers)
    engines["shard_model"] = (seq, zerocore.optim.AdamW(seq.parameters(), lr=1e-4),
                              sharded.counter)
    fsdp = nn.Sequential(*copy.deepcopy(base))
    fsdp.to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in fsdp:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    engines["fsdp2"] = (fsdp, torch_adamw(fsdp.parameters()), None)
    plain = nn.Sequential(*copy.deepcopy(base)).to(device)
    engines["unsharded"] = (plain, torch_adamw(plain.parameters()), None)
    x = torch.randn(ROWS, SEQ, args.width,
                    generator=torch.Generator().manual_seed(rank)).to(device)
    def step(name: str):
        model, opt, _ = engines[name]

        def run(_round: int) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's kernels are part of its time
        return run

    def before(name: str) -> None:
        counter = engines[name][2]
        if counter is not None:
            counter.reset()
        dist.barrier()

    def collectives_s(name: str) -> float | None:
        counter = engines[name][2]
        return (None if counter is None else counter.gather_issue_s + counter.gather_wait_s +
                counter.reduce_issue_s + counter.reduce_wait_s)

    rounds = harness.Interleaved({name: step(name) for name in engines}, warmup=2,
                                 before=before, probe=collectives_s).run(args.rounds)
    return {name: dict(us=rounds.median_s(name) / args.layers * 1e6,
                       comm_us=(statistics.median(rounds.probes[name]) / args.layers * 1e6
                                if engines[name][2] is not None else None))
            for name in engines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo ranks; default) or cuda (NCCL, a GPU per rank)")
    args = p.parse_args()
    print(harness.header(f"{args.layers} layers of Linear({args.width}, {args.width}) + GELU, "
                         f"fp32, {ROWS} x {SEQ} rows per rank; {args.rounds} rounds; "
                         f"{args.device}",
                         packages=("torch",)))
    rows = []
    for nproc in args.nproc:
        per_rank = harness.run_ranks(
            rank_main, nproc, args,
            backend="cuda:nccl,cpu:gloo" if args.device == "cuda" else "gloo")
        worst = {name: max(r[name]["us"] for r in per_rank) for name in per_rank[0]}
        for name in ("shard", "shard A/A", "shard_model", "fsdp2", "unsharded"):
            comm = per_rank[0][name]["comm_us"]
            rows.append((nproc, name, f"{worst[name]:.1f}",
                         "-" if comm is None else f"{comm:.1f}",
                         f"{worst[name] / worst['fsdp2']:.2f}"))
    print(harness.table(("world size", "engine", "µs per layer per step", "of which collectives",
                         "vs FSDP2"), rows, "rlrrr"))


if __name__ == "__main__":
    main()
