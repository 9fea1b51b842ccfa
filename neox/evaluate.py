"""python -m neox.evaluate: mean token loss and perplexity of a GPT-NeoX model on a text file.

Works on a base checkpoint, a fine-tuning run's export (OUTPUT_DIR/hf), or a preset. One
process; the text is cut into non-overlapping windows of --seq-len + 1 tokens (the last partial
window is dropped), and every predicted token counts once.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from neox import data as nd
from neox.cli import HelpFormatter
from neox.inference import add_arguments, load_model
from neox.progress import Progress


@torch.no_grad()
def evaluate_tokens(model: torch.nn.Module, tokens: torch.Tensor, *, seq_len: int,
                    batch_size: int, device: torch.device, progress: bool = False
                    ) -> dict[str, float]:
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"the text has {tokens.numel()} tokens; --seq-len {seq_len} needs at "
                         f"least {seq_len + 1}")
    # Window i predicts tokens[i*T+1 .. (i+1)*T] from tokens[i*T .. (i+1)*T - 1].
    inputs = tokens[: n * seq_len].view(n, seq_len)
    targets = tokens[1: n * seq_len + 1].view(n, seq_len)
    loss_sum = correct = 0.0
    bar = Progress(-(-n // batch_size), enabled=progress, stream=sys.stderr)
    for b, start in enumerate(range(0, n, batch_size)):
        x = inputs[start:start + batch_size].to(device)
        y = targets[start:start + batch_size].to(device)
        logits = model(x).float()
        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        bar.update(b + 1, f"loss {loss_sum / ((start + len(x)) * seq_len):.4f}")
    bar.close()
    count = n * seq_len
    loss = loss_sum / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)), "accuracy": correct / count,
            "tokens": count, "windows": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neox.evaluate",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("text", type=Path, nargs="?", default=None,
                   help="UTF-8 text file (default: tiny_shakespeare from --data-dir)")
    add_arguments(p)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N")
    p.add_argument("--json", action="store_true", help="print one JSON object (machine output)")
    args = p.parse_args(argv)
    try:
        # The text first: a missing file is reported before any model is loaded.
        data_dir = args.data_dir or nd.default_data_dir()
        text = (nd.load_corpus(args.text, cache_dir=nd.default_cache_dir(),
                               data_dir=data_dir, url=None,
                               log=lambda *a, **k: None).text)
        model, tokenizer, device = load_model(args)
        tokens = torch.from_numpy(nd.encode_text(tokenizer, text).astype("int64"))
        if args.max_windows is not None:
            tokens = tokens[: args.max_windows * args.seq_len + 1]
        result = evaluate_tokens(model, tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                                 device=device, progress=not args.json)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["model"] = str(args.checkpoint or args.model)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']}: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}, accuracy {result['accuracy']:.3f} over "
              f"{result['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
