"""What a PEFT step moves and costs (issue 12): neox's model, bias or LoRA fine-tuning, 2 gloo
ranks on the CPU, with zerocore plain, with a gathered-memory budget (``Prefetch(keep_gathered=
"all")``), with int8 frozen weights (``FrozenWeights("int8")``), with both, and PyTorch FSDP2
(``fully_shard`` per layer and on the root, ``torch.optim.AdamW(fused=True)`` on the trainable
parameters) on the same layers and batches.

Every configuration's model lives in the same pair of processes and the timed steps are
interleaved: each round runs one step of every configuration in a shuffled order (the same on
both ranks), so a slow moment of the shared machine falls on all of them alike. Reported per
configuration: the median step time (the slower rank's, per round), its ratio to FSDP2, the
bytes all-gathered per step (``comm_report``; FSDP2's are those of gathering every layer in
forward and again in backward, its default), the peak bytes of tensors per rank over one step
(``zerocore.PeakMemory``, a step apart from the timed ones: what the step allocates, beyond the
shards every configuration holds), the gathered buffers held from step to step (the budget's
resident frozen groups, to be added to that peak) and the losses of the first steps
(each configuration trains on the same batches: int8 moves them a little, the budget not at all).

    python bench/peft_gather.py                       # the tables of bench/RESULTS.md
    python bench/peft_gather.py --modes lora --model pythia-70m
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
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = ("fsdp2", "zerocore", "zerocore budget", "zerocore int8", "zerocore budget+int8")


def _zerocore_model(layers: list[nn.Module], name: str):
    import zerocore
    return zerocore.shard(
        layers, prefetch=zerocore.Prefetch(keep_gathered="all" if "budget" in name else 0),
        frozen_weights=zerocore.FrozenWeights("int8" if "int8" in name else None))


def _fsdp2_model(layers: list[nn.Module]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    import zerocore
    from neox.cli import preset_config
    from neox.finetune_modes import FinetuneMode, prepare_layer
    from neox.model import layer_specs
    from neox.step import micro_batch_loss
    from neox.weights import RandomInit, materialize
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=900))
    config = preset_config(args.model, tokenizer_rows=args.vocab)
    specs = layer_specs(config)
    mode = FinetuneMode(args.mode)

    def layers() -> list[nn.Module]:
        reader = RandomInit(config, seed=0)
        return [prepare_layer(materialize(reader, s), i, mode) for i, s in enumerate(specs)]

    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1),
                             generator=g) for _ in range(args.warmup + args.rounds + 1)]
    models, steps, results = {}, {}, {}
    for name in CONFIGS:
        if name == "fsdp2":
            model = _fsdp2_model(layers())
            trainable = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
        else:
            model = _zerocore_model(layers(), name)
            opt = zerocore.optim.AdamW(model.parameters(), lr=1e-4)
        losses: list[float] = []

        def step(ids: torch.Tensor, model=model, opt=opt, losses=losses) -> None:
            loss, _ = micro_batch_loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        models[name], steps[name] = model, step
        results[name] = {"times": [], "losses": losses}
    for i in range(args.warmup):
        for name in CONFIGS:
            steps[name](batches[i])
    for name in CONFIGS:
        if name != "fsdp2":
            models[name].comm_report(reset=True)
    order = list(CONFIGS)
    shuffle = random.Random(0)  # the same order on every rank: steps are collective
    for r in range(args.rounds):
        shuffle.shuffle(order)
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            steps[name](batches[args.warmup + r])
            results[name]["times"].append(time.perf_counter() - start)
    for name in CONFIGS:
        if name == "fsdp2":
            # Its default: every layer gathered in forward and again in backward (the root's
            # parameters, none here, would be kept).
            numel = sum(p.numel() for p in models[name].parameters())  # DTensor: global size
            results[name]["gathered"] = 2 * numel * 4
        else:
            results[name]["gathered"] = models[name].comm_report().all_gather_bytes / args.rounds
        # Gathered buffers alive before the step (resident frozen groups of the budget): the
        # step's peak below counts only what is allocated during the step.
        results[name]["held"] = (models[name].memory_report().gather_bytes
                                 if name != "fsdp2" else 0)
        with zerocore.PeakMemory("cpu") as peak:
            steps[name](batches[-1])
        results[name]["peak"] = peak.peak_bytes
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="biases,lora")
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab", type=int, default=8192, help="the tiny preset's vocabulary "
                   "(the BPE neox.finetune trains by default)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    mib = 2**20
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}; {args.model} (vocabulary {args.vocab}), 2 gloo ranks, fp32, "
          f"batch {args.batch_size} x {args.seq_len} tokens per rank; {args.warmup} warm-up + "
          f"{args.rounds} interleaved rounds; torch {torch.__version__}")
    for mode in args.modes.split(","):
        args.mode = mode
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join()
        r0, r1 = results[0], results[1]

        def step_s(name: str) -> float:
            return statistics.median(max(a, b) for a, b in zip(r0[name]["times"],
                                                               r1[name]["times"]))
        base = step_s("fsdp2")
        plain_gather = r0["zerocore"]["gathered"]
        print(f"\n### --finetune {mode} (load average {os.getloadavg()[0]:.2f} at the end)\n")
        print("| configuration | step ms (median, slower rank) | / FSDP2 | all-gathered MiB per "
              "step | / zerocore plain | peak MiB allocated in a step (rank 0 / 1) | MiB held "
              "gathered between steps | losses, first 3 steps (rank 0) |")
        print("|---|---:|---:|---:|---:|---|---:|---|")
        for name in CONFIGS:
            t = step_s(name)
            gathered = r0[name]["gathered"]
            losses = ", ".join(f"{x:.5f}" for x in r0[name]["losses"][:3])
            print(f"| {name} | {t * 1e3:.1f} | {t / base:.3f} | {gathered / mib:.2f} | "
                  f"{gathered / plain_gather:.3f} | {r0[name]['peak'] / mib:.1f} / "
                  f"{r1[name]['peak'] / mib:.1f} | {r0[name]['held'] / mib:.1f} | {losses} |")
        drift = max(abs(a - b) for a, b in zip(r0["zerocore int8"]["losses"],
                                                r0["zerocore"]["losses"]))
        same = r0["zerocore budget"]["losses"] == r0["zerocore"]["losses"]
        print(f"\nlosses over all {len(r0['zerocore']['losses'])} steps: budget == plain "
              f"bitwise: {same}; largest |int8 - plain|: {drift:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
