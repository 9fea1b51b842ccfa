"""GPT-NeoX-20B on a cluster, per layout: memory per GPU and bytes per optimizer step within and
across the nodes, for flat ZeRO-3, HSDP (a 2-D mesh, nodes x GPUs per node), hpZ (the same mesh,
``zerocore.Hybrid("hpz")``), each hybrid layout also with the cross-node gradients in int8
(qgZ), from ``zerocore.plan`` (the engine's own step on fake tensors: nothing is trained, no
weights are read), as a Markdown table. The layouts and their figures are
``neox.run.planning.compare_layouts``', the table ``python -m neox.plan --nodes N`` prints.

    python bench/hybrid_plan.py --nodes 4 --gpus 8
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from neox.config import preset_config  # noqa: E402
from neox.dtypes import DTYPES  # noqa: E402
from neox.finetune_modes import FinetuneMode  # noqa: E402
from neox.run.planning import GiB, PlanRequest, compare_layouts  # noqa: E402


def _request(mode: str, args: argparse.Namespace) -> PlanRequest:
    """The run on every GPU of the cluster (``compare_layouts`` lays it out on the nodes)."""
    config = preset_config("gpt-neox-20b", tokenizer_rows=None)
    return PlanRequest(
        config=config, filter_layers=None, mode=FinetuneMode(mode, lora_rank=8),
        dtype=DTYPES["bf16"], reduce_dtype=DTYPES["fp32"], batch_size=args.batch_size,
        seq_len=args.seq_len, grad_accum=args.grad_accum, offload=False,
        recompute=tuple(range(config.num_hidden_layers)), recompute_every=1,
        world_size=args.nodes * args.gpus, device="cuda")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=4)
    args = p.parse_args()
    gib = lambda n: f"{n / GiB:,.2f}"  # noqa: E731
    print(f"GPT-NeoX-20B, {args.nodes} nodes x {args.gpus} GPUs, bf16 compute, fp32 gradient "
          f"reduction, {args.batch_size} x {args.seq_len} tokens per rank per micro-batch, "
          f"{args.grad_accum} micro-batches per step, every block recomputed; planned "
          f"{datetime.date.today()} with torch {torch.__version__}.\n")
    print("| fine-tuning | layout | model state / GPU | secondary shards / GPU (most) | "
          "peak / GPU (with headroom) | within a node / step | across nodes / step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for mode in ("lora", "full"):
        for r in compare_layouts(_request(mode, args), args.nodes):
            print(f"| {mode} | {r.layout.name} | {gib(r.model_state)} GiB | "
                  f"{gib(r.secondary)} GiB | {gib(r.peak)} GiB | {gib(r.within_nodes)} GiB | "
                  f"{gib(r.across_nodes)} GiB |", flush=True)


if __name__ == "__main__":
    main()
