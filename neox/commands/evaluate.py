"""python -m neox.evaluate: mean token loss and perplexity of a GPT-NeoX model on a text file.

Works on a fine-tuning run (its output directory or a checkpoint; by default the built-in
run's), its export (OUTPUT_DIR/hf), pretrained weights or a preset. One process. A text is cut
into non-overlapping windows of --seq-len + 1 tokens (the last partial window is dropped); a run
without a text is evaluated on its own validation windows. Every predicted token counts once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from neox import data as nd
from neox.commands.flags import (HelpFormatter, Parser, add_loading_arguments, loading_source,
                                 positive_int)
from neox.run.evaluation import (evaluate_windows, read_text, run_corpus,
                                 run_validation_windows, token_windows)
from neox.run.inference import load_model


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m neox.evaluate",
               description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("text", type=Path, nargs="?", default=None,
                   help="UTF-8 text file (default: for a fine-tuning run, its own validation "
                        "windows; else tiny_shakespeare from the cache or --data-dir)")
    add_loading_arguments(p)
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
        corpus = read_text(args.text, args.data_dir) if args.text is not None else None
        loaded = load_model(loading_source(args))
        if corpus is None and loaded.recipe is not None:
            corpus = run_corpus(loaded)
            inputs, targets = run_validation_windows(loaded, corpus)
            what = "the run's validation windows"
            checked = loaded.data_sha256 is not None
        else:
            if corpus is None:
                corpus = read_text(None, args.data_dir)
            positions = loaded.model.config.max_position_embeddings
            if args.seq_len > positions:  # as neox.generate refuses a prompt beyond them
                raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {positions} "
                                 f"positions; give --seq-len {positions} or less")
            tokens = torch.from_numpy(nd.encode_text(loaded.tokenizer, corpus.text)
                                      .astype("int64"))
            inputs, targets = token_windows(tokens, args.seq_len)
            what, checked = str(args.text or corpus.name), None
        if args.max_windows is not None:
            inputs, targets = inputs[:args.max_windows], targets[:args.max_windows]
        result = evaluate_windows(loaded.model, inputs, targets, batch_size=args.batch_size,
                                  device=loaded.device, progress=not args.json)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["model"] = loaded.source
    result["text"] = what
    # Which text it was, plainly: where it was read, its digest, and (a run's own windows)
    # whether it is the one the run's checkpoint recorded.
    result["corpus"] = corpus.source
    result["corpus_sha256"] = corpus.sha256
    if checked is not None:
        result["checked_against_the_run"] = checked
    if args.json:
        print(json.dumps(result))
    else:
        note = {True: ", the text the run trained on (its sha256 checked)",
                False: ", unchecked: the checkpoint records no digest of the run's text",
                None: ""}[checked]
        print(f"{result['model']}: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}, accuracy {result['accuracy']:.3f} over "
              f"{result['tokens']:,} tokens of {what}: {corpus.source} (sha256 "
              f"{corpus.sha256[:12]}...{note})")
    return 0
