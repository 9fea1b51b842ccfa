"""python -m neox.generate: sample text from a GPT-NeoX model with a key/value cache.

Greedy (--temperature 0) or temperature / top-k sampling, from a base checkpoint, a fine-tuning
run's export (OUTPUT_DIR/hf) or a preset. One process.
"""

from __future__ import annotations

import sys

import torch

from neox.commands.flags import (HelpFormatter, Parser, add_loading_arguments, loading_source,
                                 nonnegative_float, nonnegative_int, positive_int)
from neox.run.inference import load_model
from neox.run.sampling import generate


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m neox.generate",
               description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    add_loading_arguments(p)
    p.add_argument("--prompt", default="ROMEO:", help="text to continue")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens to generate after the prompt")
    # Sampling by default: a small model's greedy continuation soon repeats one token.
    p.add_argument("--temperature", type=nonnegative_float, default=0.8,
                   help="sampling temperature, >= 0 (0: greedy, always the likeliest token)")
    p.add_argument("--top-k", type=nonnegative_int, default=40,
                   help="sample among the k likeliest (0: all)")
    p.add_argument("--num-samples", type=positive_int, default=1,
                   help="independent continuations of the prompt, each printed")
    args = p.parse_args(argv)
    try:
        loaded = load_model(loading_source(args))
        model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.device
        ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
        if not ids:
            raise ValueError("--prompt encodes to no tokens; give some text")
        if len(ids) + args.max_new_tokens > model.config.max_position_embeddings:
            raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's "
                             f"{model.config.max_position_embeddings} positions")
        prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
        gen = torch.Generator().manual_seed(args.seed)
        out = generate(model, prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, generator=gen)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        # Special tokens are text in this corpus (the bundled tokenizer maps "assistant" to one).
        print(tokenizer.decode(row, skip_special_tokens=False))
    return 0
