"""Offload on a GPT-NeoX shape: the step time with the parameter shards in host memory (issue 31:
``Offload(params=True)``, each layer's shard uploaded ahead of its all-gather on the prefetch
schedule, on a side stream), with the optimizer in host memory (issue 44: its pass overlapped
with the next forward, or inside the step), and both, against the resident step, at one rank on
one device.

    python bench/offload_step.py [--device cuda] [--model pythia-410m] [--blocks 4]
        [--seq-len 512] [--batch-size 4] [--rounds 8] [--variants resident,params,...]

The workload users run: neox's own blocks (attention, MLP, rotary) of a Pythia preset, a few of
them with the embedding and the readout, bf16 on a GPU (fp32 on the CPU), full fine-tuning,
zerocore's AdamW; each step ends with a device synchronisation. Variants in the same process,
stepped alternately in a seeded random order per round (harness.Interleaved): ``resident``,
``params`` (``Offload(params=True)``, the optimizer on the device), ``optimizer``
(``Offload(optimizer=True)``: the CPU Adam pass overlapped with the next forward, exactly, the
default), ``optimizer-in-step`` (the same with ``overlap="off"``: the pass inside ``step()``),
``optimizer-delayed`` (``overlap="delayed"``: the update one step late, its pass beside the
next forward and backward; other weights, so other losses),
``all`` (``params=True, optimizer=True``: the full CPU offload). Reported: the median step time
of each and its ratio to ``resident`` round by round (median), against the issues' targets where
the copies and the pass overlap the compute (``TARGETS``; bench/gpu_check.sh runs this at one
rank). The step ends with a device synchronisation, not with the pass: an overlapped pass's
time shows in the next step, where the forward waits for each layer's update. On the CPU the
"device" is a stand-in, the uploads are copies on the same cores and the pass shares them with
the forward: the ratios there measure what the copies and the pass cost, not an overlap.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import harness
import zerocore
from neox.config import PRESETS
from neox.model import build_layers
from neox.run.step import micro_batch_loss

VARIANTS = {"resident": zerocore.Offload(), "params": zerocore.Offload(params=True),
            "optimizer": zerocore.Offload(optimizer=True),
            "optimizer-in-step": zerocore.Offload(optimizer=True, overlap="off"),
            "optimizer-delayed": zerocore.Offload(optimizer=True, overlap="delayed"),
            "all": zerocore.Offload(params=True, optimizer=True)}
# Against resident, on a GPU: the uploads overlapping the compute (issue 31), the CPU Adam
# pass overlapping the next forward, and one step late, the next forward and backward (issue 44).
TARGETS = {"params": 1.3, "optimizer": 1.15, "optimizer-delayed": 1.05}


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = PRESETS[args.model]
    models = {}
    for name in args.variants:
        offload = VARIANTS[name]
        layers = build_layers(config, filter_layers=range(args.blocks),
                              generator=torch.Generator().manual_seed(0))
        model = zerocore.shard(layers, device=device, offload=offload,
                               mixed_precision=zerocore.MixedPrecision(dtype, torch.float32))
        models[name] = (model, zerocore.optim.AdamW(model.parameters(), lr=1e-5))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1),
                        generator=g).to(device)

    def step(name: str):
        model, opt = models[name]

        def run(_round: int) -> None:
            loss, _ = micro_batch_loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)  # the step's kernels and copies are its time
        return run

    rounds = harness.Interleaved({name: step(name) for name in models}, warmup=2,
                                 seed="param-offload").run(args.rounds)
    return {name: dict(median_s=rounds.median_s(name),
                       ratio=statistics.median(rounds.ratios(name, "resident")))
            for name in models}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=sorted(PRESETS), default="pythia-410m")
    p.add_argument("--blocks", type=int, default=4, help="blocks kept (default 4)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    p.add_argument("--variants", type=_variants, default=list(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default all; resident is "
                        f"always run: the ratios are to it)")
    args = p.parse_args()
    print(harness.header(f"{args.model}, {args.blocks} blocks with embedding and readout, "
                         f"{args.batch_size} x {args.seq_len} tokens, one rank, {args.device}; "
                         f"{args.rounds} rounds", packages=("torch",)))
    result = harness.run_ranks(rank_main, 1, args,
                               backend="cuda:nccl,cpu:gloo" if args.device == "cuda"
                               else "gloo")[0]
    rows = [(name, f"{r['median_s'] * 1e3:.1f}", f"{r['ratio']:.2f}")
            for name, r in result.items()]
    print(harness.table(("variant", "step ms (median)", "vs resident (median of rounds)"),
                        rows, "lrr"))
    for name, target in TARGETS.items():
        if name in result:
            ratio = result[name]["ratio"]
            print(f"{name} / resident: {ratio:.2f} (target on a GPU <= {target}: "
                  f"{'met' if ratio <= target else 'NOT met'})")


def _variants(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"no variant {', '.join(unknown)}; the variants: "
                                         f"{', '.join(VARIANTS)}")
    return ["resident"] + [n for n in names if n != "resident"]


if __name__ == "__main__":
    main()
