"""Loading a model and its tokenizer for single-process use (``neox.evaluate``,
``neox.generate``): a checkpoint directory (Hugging Face, slim weights, or a fine-tuning run's
``--export-hf`` output) or a randomly initialised preset."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from tokenizers import Tokenizer

from neox import data as nd
from neox.checkpoint import RandomInit, from_pretrained, iter_layers
from neox.config import PRESETS
from neox.model import NeoXModel, normalize_filter_layers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="a Hugging Face or slim-weights GPT-NeoX directory, e.g. a fine-tuning "
                        "run's OUTPUT_DIR/hf (written by --export-hf)")
    p.add_argument("--model", default="tiny",
                   help="preset (random weights) when no --checkpoint is given")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--filter-layers", default=None, help="blocks to keep, e.g. '0,1' or '0-3'")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json (default: the checkpoint's; for a preset: the GPT-NeoX "
                        "tokenizer in --data-dir)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="local data (default: shared/data beside the repository)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def load_model(args: argparse.Namespace) -> tuple[NeoXModel, Tokenizer, torch.device]:
    """The model (eval mode) and tokenizer the arguments describe. Raises ValueError (with a
    message for the user) on bad input."""
    from neox.finetune import parse_layers
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    layers = parse_layers(args.filter_layers)
    if args.checkpoint is not None:
        model = from_pretrained(args.checkpoint, filter_layers=layers, dtype=dtype, device=device)
        tok_path = args.tokenizer or args.checkpoint
    else:
        if args.model not in PRESETS:
            raise ValueError(f"unknown --model {args.model!r}; presets: {sorted(PRESETS)}")
        config = PRESETS[args.model]
        kept = normalize_filter_layers(config, layers)
        model = NeoXModel(dataclasses.replace(config, num_hidden_layers=len(kept)),
                          iter_layers(RandomInit(config, seed=args.seed), filter_layers=kept,
                                      dtype=dtype, device=device), source_layers=kept)
        tok_path = args.tokenizer or (args.data_dir or nd.default_data_dir()) / \
            "gpt-neox-20b-tokenizer.json"
    tokenizer = nd.load_tokenizer(tok_path, corpus=None, cache_dir=Path("."),  # type: ignore
                                  log=lambda *a, **k: None)
    nd.check_vocab(tokenizer, model.config.vocab_size)
    return model.eval(), tokenizer, device
