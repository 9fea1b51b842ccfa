"""Generation under ZeRO-3: tokens/s of ``generate`` on a ``shard_model`` model, gathering per
token (with and without transformers' per-token agreement, ``synced_gpus``) vs inside
``ShardedModel.gathered()``, beside the unsharded model in the same ranks.

    python bench/generate_gathered.py [--nproc 2] [--layers 6] [--hidden 256] [--tokens 32]

The GPT-NeoX of bench/bench_hf.py (from a config, fp32), greedy decoding of ``--tokens`` new
tokens from a 16-token prompt, 2 sequences per rank, KV cache on. Every rank runs the four
ways in a seeded random order per round (the machine's load affects them alike); reported: the
median over the rounds of new tokens per second per rank, the all-gathers one generate issued,
and whether the tokens agree (they must: the same gathered values).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

import harness
import zerocore
from bench_hf import build

PROMPT, ROWS = 16, 2


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    model = build(args.layers, args.hidden).eval()
    plain = copy.deepcopy(model)
    sharded = zerocore.shard_model(model, model.gpt_neox.layers)
    prompt = torch.randint(0, 4096, (ROWS, PROMPT), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                  pad_token_id=0)

    def per_token():
        return model.generate(input_ids=prompt, **kwargs)

    def gathered():
        with sharded.gathered():
            return model.generate(input_ids=prompt, **kwargs)

    # The same tokens without transformers' per-token agreement (synced_gpus, on by itself for
    # a shard_model model): what that one-element all-reduce per token costs.
    def unsynced():
        return model.generate(input_ids=prompt, synced_gpus=False, **kwargs)

    ways = {"unsharded": lambda: plain.generate(input_ids=prompt, **kwargs),
            "per token": per_token, "per token, synced_gpus=False": unsynced,
            "gathered()": gathered}
    def before(_name: str) -> None:
        dist.barrier()
        sharded.counter.reset()
    rounds = harness.Interleaved({k: (lambda r, way=way: way()) for k, way in ways.items()},
                                 warmup=1, before=before,
                                 probe=lambda _: sharded.counter.all_gather_calls
                                 ).run(args.rounds)
    tokens = {k: v[-1] for k, v in rounds.values.items()}
    return {"tok_s": {k: ROWS * args.tokens / rounds.median_s(k) for k in ways},
            "gathers": {k: v[-1] for k, v in rounds.probes.items()},
            "same": all(torch.equal(t, tokens["unsharded"]) for t in tokens.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generate")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    args = p.parse_args()
    per_rank = harness.run_ranks(rank_main, args.nproc, args)
    print(harness.header(f"GPT-NeoX {args.layers} layers, hidden {args.hidden}, vocab 4096, "
                         f"fp32; greedy, {ROWS} x {PROMPT}-token prompts + {args.tokens} new "
                         f"tokens per rank; {args.nproc} gloo ranks; {args.rounds} rounds"))
    base = min(r["tok_s"]["unsharded"] for r in per_rank)
    rows = []
    for name in ("unsharded", "per token", "per token, synced_gpus=False", "gathered()"):
        rate = min(r["tok_s"][name] for r in per_rank)
        rows.append((name, f"{rate:.1f}", per_rank[0]["gathers"][name], f"{rate / base:.2f}"))
    print(harness.table(("per rank (slowest rank)", "new tokens/s", "all-gathers per generate",
                         "vs unsharded"), rows, "lrrr"))
    print("tokens identical on every rank and way:", all(r["same"] for r in per_rank))


if __name__ == "__main__":
    main()
