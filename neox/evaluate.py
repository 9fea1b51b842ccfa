"""python -m neox.evaluate: mean token loss and perplexity of a GPT-NeoX model on a text file.

Works on a fine-tuning run (its output directory or a checkpoint; by default the built-in
run's), its export (OUTPUT_DIR/hf), pretrained weights or a preset. One process. A text is cut
into non-overlapping windows of --seq-len + 1 tokens (the last partial window is dropped); a run
without a text is evaluated on its own validation windows. Every predicted token counts once.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from neox import data as nd
from neox.cli import HelpFormatter, Parser, positive_int
from neox.inference import Loaded, add_arguments, load_model
from neox.progress import Progress


def read_text(path: Path | None, data_dir: Path | None) -> str:
    """The text to evaluate on: ``path``, or tiny_shakespeare from the cache or the data
    directory (no download: offline, the standard library's help texts stand in, as in a run)."""
    return nd.load_corpus(path, cache_dir=nd.default_cache_dir(),
                          data_dir=data_dir or nd.default_data_dir(), url=None,
                          log=lambda *a, **k: None).text


def run_validation_windows(loaded: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation windows of the run whose checkpoint was loaded: its corpus, tokenizer,
    sequence length and split, so the loss is comparable with the run's own validation line."""
    data = loaded.recipe.data
    corpus = nd.load_corpus(data.data, cache_dir=Path(data.cache_dir or nd.default_cache_dir()),
                            data_dir=Path(data.data_dir) if data.data_dir else
                            nd.default_data_dir(), url=None, log=lambda *a, **k: None)
    dataset = nd.TokenDataset.from_corpus(
        corpus, loaded.tokenizer, seq_len=data.seq_len,
        cache_dir=Path(data.cache_dir or nd.default_cache_dir()),
        val_fraction=data.val_fraction, log=lambda *a, **k: None)
    windows = dataset.val.windows.long()
    return windows[:, :-1], windows[:, 1:]


def token_windows(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token stream cut into (inputs, targets) windows of ``seq_len``."""
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"the text has {tokens.numel()} tokens; --seq-len {seq_len} needs at "
                         f"least {seq_len + 1}")
    # Window i predicts tokens[i*T+1 .. (i+1)*T] from tokens[i*T .. (i+1)*T - 1].
    inputs = tokens[: n * seq_len].view(n, seq_len)
    targets = tokens[1: n * seq_len + 1].view(n, seq_len)
    return inputs, targets


@torch.no_grad()
def evaluate_windows(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                     batch_size: int, device: torch.device, progress: bool = False
                     ) -> dict[str, float]:
    """Loss, perplexity and accuracy of predicting ``targets`` (N, T) from ``inputs`` (N, T),
    every token counted once."""
    n, seq_len = inputs.shape
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
    p = Parser(prog="python -m neox.evaluate",
               description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("text", type=Path, nargs="?", default=None,
                   help="UTF-8 text file (default: for a fine-tuning run, its own validation "
                        "windows; else tiny_shakespeare from the cache or --data-dir)")
    add_arguments(p)
    p.add_argument("--seq-len", type=positive_int, default=128,
                   help="tokens per window of TEXT (a run's validation windows keep the run's)")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="windows per forward (more: faster, more memory)")
    p.add_argument("--max-windows", type=positive_int, default=None,
                   help="evaluate only the first N")
    p.add_argument("--json", action="store_true", help="print one JSON object (machine output)")
    args = p.parse_args(argv)
    try:
        # A text given is read first: a missing file is reported before any model is loaded.
        text = read_text(args.text, args.data_dir) if args.text is not None else None
        loaded = load_model(args)
        if text is None and loaded.recipe is not None:
            inputs, targets = run_validation_windows(loaded)
            what = "the run's validation windows"
        else:
            if text is None:
                text = read_text(None, args.data_dir)
            positions = loaded.model.config.max_position_embeddings
            if args.seq_len > positions:  # as neox.generate refuses a prompt beyond them
                raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {positions} "
                                 f"positions; give --seq-len {positions} or less")
            tokens = torch.from_numpy(nd.encode_text(loaded.tokenizer, text).astype("int64"))
            inputs, targets = token_windows(tokens, args.seq_len)
            what = str(args.text or "tiny_shakespeare")
        if args.max_windows is not None:
            inputs, targets = inputs[:args.max_windows], targets[:args.max_windows]
        result = evaluate_windows(loaded.model, inputs, targets, batch_size=args.batch_size,
                                  device=loaded.device, progress=not args.json)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["model"] = loaded.source
    result["text"] = what
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']}: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}, accuracy {result['accuracy']:.3f} over "
              f"{result['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
