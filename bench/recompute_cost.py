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
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = {"kept": (), "every block": tuple(range(8)), "every 2nd block": tuple(range(8))}
EVERY = {"kept": 1, "every block": 1, "every 2nd block": 2}


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import zerocore
    from neox.config import NeoXConfig
    from neox.finetune_modes import FinetuneMode, prepare_layer
    from neox.model import layer_specs
    from neox.run.planning import PlanRequest, plan_run
    from neox.run.recipe import ShardingConfig
    from neox.run.step import micro_batch_loss
    from neox.weights import RandomInit, materialize
    config = NeoXConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=8,
                        num_attention_heads=8, intermediate_size=2048)
    specs = layer_specs(config)
    mode = FinetuneMode("full")
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    results = {}
    runs = {}
    for name, blocks in CONFIGS.items():
        sharding = ShardingConfig(activation_checkpointing=blocks,
                                  activation_checkpointing_every=EVERY[name])
        with zerocore.PeakMemory("cpu") as peak:
            model = zerocore.shard((prepare_layer(materialize(RandomInit(config), s), i, mode)
                                    for i, s in enumerate(specs)),
                                   recompute=sharding.recompute(specs))
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
                         "activations": plan.peak["activations"]}
        runs[name] = step
    # Seeded: the same order on every rank (steps are collective). No warm-up round: every
    # configuration has run two steps above.
    rounds = harness.Interleaved({name: (lambda r, run=run: run()) for name, run in runs.items()},
                                 warmup=0, before=lambda _: dist.barrier()).run(args.rounds)
    for name in CONFIGS:
        results[name]["times"] = rounds.times_s[name]
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    start = harness.header(packages=("torch",))
    results = harness.run_ranks(rank_main, 2, args, timeout_s=3600)
    mib = 2**20

    def step_s(name: str) -> float:
        return statistics.median(harness.slowest([r[name]["times"] for r in results]))
    base = step_s("kept")
    print(start)
    print(f"# load average at the end {harness.load_average():.2f}; batch {args.batch_size} x "
          f"{args.seq_len} tokens per rank, {args.rounds} interleaved rounds")
    rows = []
    for name in CONFIGS:
        r0, r1 = results[0][name], results[1][name]
        step = step_s(name)
        rows.append((f"{name} {'recomputed' if name != 'kept' else ''}",
                     f"{r0['measured'] / mib:,.1f} / {r1['measured'] / mib:,.1f}",
                     f"{r0['planned'] / mib:,.1f}", f"{r0['activations'] / mib:,.1f}",
                     f"{step:.3f}", f"{step / base:.3f}"))
    print(harness.table(("activations", "measured peak MiB (rank 0 / 1)", "planned MiB",
                         "planned activations at the peak MiB", "step s (median, slower rank)",
                         "step time / kept"), rows, "llrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
