"""What activation recomputation (``zerocore.Recompute``) saves and costs: an 8-block GPT-NeoX
(hidden 512, 2 gloo ranks on the CPU, fp32, full training), without recomputation, recomputing
every block, and every second block; each rank's measured peak bytes per step
(``zerocore.PeakMemory``) beside the plan's, the activations at the plan's peak, and the step
time, measured interleaved: every round runs one step of each configuration in a shuffled
order, so a slow moment of the shared machine falls on all of them alike.

    python bench/recompute_cost.py                 # the table of bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = {"kept": (), "every block": tuple(range(8)), "every 2nd block": tuple(range(8))}
EVERY = {"kept": 1, "every block": 1, "every 2nd block": 2}


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    import zerocore
    from neox.config import NeoXConfig
    from neox.finetune_modes import FinetuneMode, prepare_layer
    from neox.model import layer_specs
    from neox.plan import PlanRequest, plan_run
    from neox.recipe import LoopConfig
    from neox.step import micro_batch_loss, recompute_policy
    from neox.weights import RandomInit, materialize
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=900))
    config = NeoXConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=8,
                        num_attention_heads=8, intermediate_size=2048)
    specs = layer_specs(config)
    mode = FinetuneMode("full")
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    results = {}
    runs = {}
    for name, blocks in CONFIGS.items():
        loop = LoopConfig(activation_checkpointing=blocks,
                          activation_checkpointing_every=EVERY[name])
        with zerocore.PeakMemory("cpu") as peak:
            model = zerocore.shard((prepare_layer(materialize(RandomInit(config), s), i, mode)
                                    for i, s in enumerate(specs)),
                                   recompute=recompute_policy(specs, loop))
            opt = zerocore.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model=model, opt=opt) -> None:
                loss, _ = micro_batch_loss(model(ids[:, :-1]), ids[:, 1:])
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
            step()
            peak.mark()
            step()
        plan = plan_run(PlanRequest(
            config=config, filter_layers=None, mode=mode, dtype=torch.float32,
            reduce_dtype=torch.float32, batch_size=args.batch_size, seq_len=args.seq_len,
            grad_accum=1, offload=False, recompute=blocks, recompute_every=EVERY[name],
            world_size=world_size, device="cpu"))
        results[name] = {"measured": peak.peak_bytes, "planned": plan.device_peak,
                         "activations": plan.peak["activations"], "times": []}
        runs[name] = step
    order = list(CONFIGS)
    shuffle = random.Random(0)  # the same order on every rank: steps are collective
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            results[name]["times"].append(time.perf_counter() - start)
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load = os.getloadavg()[0]
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join()
    mib = 2**20
    base = statistics.median(max(a, b) for a, b in zip(results[0]["kept"]["times"],
                                                      results[1]["kept"]["times"]))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load:.2f} "
          f"-> {os.getloadavg()[0]:.2f}; batch {args.batch_size} x {args.seq_len} tokens per "
          f"rank, {args.rounds} interleaved rounds")
    print("| activations | measured peak MiB (rank 0 / 1) | planned MiB | planned activations at "
          "the peak MiB | step s (median, slower rank) | step time / kept |")
    print("|---|---|---:|---:|---:|---:|")
    for name in CONFIGS:
        r0, r1 = results[0][name], results[1][name]
        step = statistics.median(max(a, b) for a, b in zip(r0["times"], r1["times"]))
        print(f"| {name} {'recomputed' if name != 'kept' else ''} | {r0['measured'] / mib:,.1f} / "
              f"{r1['measured'] / mib:,.1f} | {r0['planned'] / mib:,.1f} | "
              f"{r0['activations'] / mib:,.1f} | {step:.3f} | {step / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
