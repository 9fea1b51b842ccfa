"""What compiling each block buys, and what the engine costs around a compiled block: one
process, one thread, no communication (world size 1), interleaved rounds (harness.Interleaved)
of one training step (forward, MSE loss, backward, AdamW step) of the same GPT-NeoX blocks as
bench_fsdp.py's ``neox-6x256-t128`` (its ``make_layers``), four ways:
- ``torch``: ``nn.Sequential`` of the blocks + ``torch.optim.AdamW(fused=True)``;
- ``torch compiled``: the same with ``torch.compile(block, fullgraph=True)`` per block;
- ``zerocore``: ``zerocore.shard(blocks)`` + ``zerocore.optim.AdamW``;
- ``zerocore compiled``: ``zerocore.shard(blocks, compile=zerocore.Compile())``.
This isolates the mechanism (the computation a compiled block saves, the engine's own cost
per layer) from the 2-rank workload of bench_fsdp.py, where communication and other load
mix in. Ratios are taken round by round, calls moments apart.

    python bench/compiled_units.py [--size neox-6x256-t128] [--rounds 20] [--device cuda]

``--device cuda`` runs the four ways on the current GPU (NCCL; inductor's GPU kernels), where
compiling is expected to pay, unlike on this CPU (bench/gpu_check.sh does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from bench_fsdp import ADAMW, SIZES, make_layers, _batches  # noqa: E402

import zerocore  # noqa: E402


def _steppers(size: str, device: torch.device) -> dict[str, object]:
    """name -> (model, optimizer) of each way, from the same initial weights."""
    out = {}
    for name in ("torch", "torch compiled"):
        layers = [layer.to(device) for layer in make_layers(size)]
        if name.endswith("compiled"):
            layers = [torch.compile(layer, fullgraph=True) for layer in layers]
        model = nn.Sequential(*layers)
        out[name] = (model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True))
    for name, policy in (("zerocore", None), ("zerocore compiled", zerocore.Compile())):
        model = zerocore.shard(make_layers(size), device=device, compile=policy)
        out[name] = (model, zerocore.optim.AdamW(model.parameters(), **ADAMW))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="neox-6x256-t128", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank of bench_fsdp.py
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{harness.free_port()}",
                            rank=0, world_size=1)
    batches = [(x.to(device), y.to(device)) for x, y in _batches(0, args.size)]
    ways = _steppers(args.size, device)

    def step(name: str):
        model, opt = ways[name]

        def run(i: int) -> float:
            x, y = batches[i % len(batches)]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
        return run

    print(harness.header(f"bench/compiled_units.py --size {args.size} --rounds {args.rounds}: "
                         f"one process, 1 thread, world size 1, {device}"))
    rounds = harness.Interleaved({n: step(n) for n in ways}, warmup=args.warmup,
                                 seed="compiled").run(args.rounds)
    print(f"# load average after: {harness.load_average():.2f}")
    rows = []
    for name in ways:
        per_round = rounds.ratios(name, "torch")
        q1, med, q3 = harness.quartiles(per_round)
        rows.append((name, f"{1e3 * rounds.median_s(name):.1f}",
                     f"{1e3 * min(rounds.times_s[name]):.1f}", f"{med:.3f} ({q1:.3f}-{q3:.3f})",
                     f"{statistics.median(rounds.ratios(name, 'zerocore')):.3f}"))
    print(harness.table(["way", "step ms, median", "min", "/ torch, per round (quartiles)",
                         "/ zerocore, per round"], rows, "lrrrr"))
    last = {n: rounds.values[n][-1] for n in ways}
    print(f"# last losses: {last}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
