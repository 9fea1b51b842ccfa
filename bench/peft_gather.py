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
    python bench/peft_gather.py --configs "zerocore,zerocore int8,zerocore nf4,zerocore fp8,\
zerocore nf4 replicated"

The quantized configurations beside int8 (issue 41): ``"zerocore nf4"`` / ``"zerocore fp8"``
(``FrozenWeights("nf4")`` / ``("fp8")``, sharded: each gather moves the quantized bytes) and
``"zerocore nf4 replicated"`` (the whole NF4 base on each rank: nothing frozen gathered; int8
and fp8 alike). A configuration named again with `` again`` appended is built and timed as a
second model of the same configuration: the A/A control, whose time ratio to the first is the
noise of the measurement. Each placement on a GPT-NeoX shape, a few of its blocks kept:

    python bench/peft_gather.py --modes lora --model pythia-410m --filter-layers 0-1 \
        --batch-size 4 --configs "zerocore,zerocore again,zerocore int8,zerocore int8 \
replicated,zerocore nf4,zerocore nf4 replicated,zerocore fp8,zerocore fp8 replicated"
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = ("fsdp2", "zerocore", "zerocore budget", "zerocore int8", "zerocore budget+int8")
QUANTIZED = ("int8", "nf4", "fp8")


def _zerocore_model(layers: list[nn.Module], name: str):
    import zerocore
    dtype = next((q for q in QUANTIZED if q in name), None)
    return zerocore.shard(
        layers, prefetch=zerocore.Prefetch(keep_gathered="all" if "budget" in name else 0),
        frozen_weights=zerocore.FrozenWeights(
            dtype, placement="replicated" if "replicated" in name else "sharded"))


def _fsdp2_model(layers: list[nn.Module]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import zerocore
    from neox.blocks import parse_layers
    from neox.config import filtered_config, preset_config
    from neox.finetune_modes import FinetuneMode, prepare_layer
    from neox.model import layer_specs
    from neox.run.step import micro_batch_loss
    from neox.weights import RandomInit, materialize
    config = preset_config(args.model, tokenizer_rows=args.vocab)
    if args.filter_layers is not None:  # random weights: the kept blocks' shapes are all alike
        config = filtered_config(config, parse_layers(args.filter_layers).blocks(
            config.num_hidden_layers))
    specs = layer_specs(config)
    mode = FinetuneMode(args.mode)

    def layers() -> list[nn.Module]:
        reader = RandomInit(config, seed=0)
        return [prepare_layer(materialize(reader, s), i, mode) for i, s in enumerate(specs)]

    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1),
                             generator=g) for _ in range(args.warmup + args.rounds + 1)]
    models, steps, results = {}, {}, {}
    for name in args.configs:
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
        results[name] = {"losses": losses}
    for i in range(args.warmup):
        for name in args.configs:
            steps[name](batches[i])
    for name in args.configs:
        if name != "fsdp2":
            models[name].comm_report(reset=True)
    # Seeded: the same order on every rank (steps are collective).
    rounds = harness.Interleaved(
        {name: (lambda r, step=steps[name]: step(batches[args.warmup + r]))
         for name in args.configs},
        warmup=0, before=lambda _: dist.barrier()).run(args.rounds)
    for name in args.configs:
        results[name]["times"] = rounds.times_s[name]
    for name in args.configs:
        if name == "fsdp2":
            # Its default: every layer gathered in forward and again in backward (the root's
            # parameters, none here, would be kept).
            numel = sum(p.numel() for p in models[name].parameters())  # DTensor: global size
            results[name]["gathered"] = 2 * numel * 4
            results[name]["reduced"] = sum(p.numel() for p in models[name].parameters()
                                           if p.requires_grad) * 4
            results[name]["params"] = None
        else:
            comm = models[name].comm_report()
            results[name]["gathered"] = comm.all_gather_bytes / args.rounds
            results[name]["reduced"] = comm.reduce_scatter_bytes / args.rounds
            # The parameter bytes a rank holds: shards, or a replicated base's every part.
            results[name]["params"] = models[name].memory_report().param_bytes
        # Gathered buffers alive before the step (resident frozen groups of the budget): the
        # step's peak below counts only what is allocated during the step.
        results[name]["held"] = (models[name].memory_report().gather_bytes
                                 if name != "fsdp2" else 0)
        with zerocore.PeakMemory("cpu") as peak:
            steps[name](batches[-1])
        results[name]["peak"] = peak.peak_bytes
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="biases,lora")
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab", type=int, default=8192, help="the tiny preset's vocabulary "
                   "(the BPE neox.finetune trains by default)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--filter-layers", default=None,
                   help="keep only these blocks of the preset, as neox's --filter-layers")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated configurations (default: the tables'); the first is "
                        "the baseline of the time ratio")
    args = p.parse_args()
    args.configs = args.configs.split(",")
    mib = 2**20
    from neox.config import preset_config
    vocab = preset_config(args.model, tokenizer_rows=args.vocab).vocab_size
    kept = f", blocks {args.filter_layers} kept" if args.filter_layers is not None else ""
    print(harness.header(f"{args.model}{kept} (vocabulary {vocab}), 2 gloo ranks, fp32, batch "
                         f"{args.batch_size} x {args.seq_len} tokens per rank; {args.warmup} "
                         f"warm-up + {args.rounds} interleaved rounds", packages=("torch",)))
    for mode in args.modes.split(","):
        args.mode = mode
        r0, r1 = harness.run_ranks(rank_main, 2, args, timeout_s=3600)

        def step_s(name: str) -> float:
            return statistics.median(harness.slowest([r0[name]["times"], r1[name]["times"]]))
        base = step_s(args.configs[0])
        plain_gather = r0["zerocore"]["gathered"]
        print(f"\n### --finetune {mode} (load average {harness.load_average():.2f} at the "
              f"end)\n")
        rows = []
        for name in args.configs:
            t = step_s(name)
            gathered = r0[name]["gathered"]
            losses = ", ".join(f"{x:.5f}" for x in r0[name]["losses"][:3])
            params = r0[name]["params"]
            rows.append((name, f"{t * 1e3:.1f}", f"{t / base:.3f}", f"{gathered / mib:.2f}",
                         f"{gathered / plain_gather:.3f}", f"{r0[name]['reduced'] / mib:.2f}",
                         f"{params / mib:.1f}" if params is not None else "-",
                         f"{r0[name]['peak'] / mib:.1f} / {r1[name]['peak'] / mib:.1f}",
                         f"{r0[name]['held'] / mib:.1f}", losses))
        print(harness.table(("configuration", "step ms (median, slower rank)",
                             f"/ {args.configs[0]}",
                             "all-gathered MiB per step", "/ zerocore plain",
                             "reduce-scattered MiB per step", "parameter MiB held (rank 0)",
                             "peak MiB allocated in a step (rank 0 / 1)",
                             "MiB held gathered between steps", "losses, first 3 steps (rank 0)"),
                            rows, "lrrrrrrlrl"))
        plain = r0["zerocore"]["losses"]
        notes = []
        if "zerocore budget" in r0:
            notes.append(f"budget == plain bitwise: {r0['zerocore budget']['losses'] == plain}")
        for name in args.configs:
            if name.endswith(" again"):
                twin = r0[name.removesuffix(" again")]["losses"]
                notes.append(f"{name} == {name.removesuffix(' again')} bitwise: "
                             f"{r0[name]['losses'] == twin}")
            elif any(q in name for q in QUANTIZED):
                drift = max(abs(a - b) for a, b in zip(r0[name]["losses"], plain))
                notes.append(f"largest |{name.removeprefix('zerocore ')} - plain|: "
                             f"{drift:.2e}")
        print(f"\nlosses over all {len(plain)} steps: {'; '.join(notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
