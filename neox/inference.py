"""Loading a model and its tokenizer for single-process use (``neox.evaluate``,
``neox.generate``): pretrained weights (Hugging Face, slim weights, or a fine-tuning run's
``--export-hf`` output) or a randomly initialised preset."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer

from neox import data as nd
from neox.cli import add_model_arguments, default_data_dir_flag, parse_layers, preset_config, \
    resolve_dtype
from neox.config import filtered_config
from neox.model import NeoXModel
from neox.weights import RandomInit, iter_layers, open_weights

GPT_NEOX_TOKENIZER = "gpt-neox-20b-tokenizer.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model flags (shared with ``neox.finetune``), the tokenizer and the device."""
    add_model_arguments(p, for_training=False)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json (default: the checkpoint's; for a preset: the GPT-NeoX "
                        "tokenizer in --data-dir)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir_flag(),
                   help="local data (default: shared/data beside the repository)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def load_model(args: argparse.Namespace) -> tuple[NeoXModel, Tokenizer, torch.device]:
    """The model (eval mode) and tokenizer the arguments describe. Raises ValueError (with a
    message for the user) on bad input."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    ranges = parse_layers(args.filter_layers)
    if args.checkpoint is not None:
        reader = open_weights(args.checkpoint, allow_outside=args.allow_outside_weights)
        tok_path = args.tokenizer or args.checkpoint
    else:
        reader = RandomInit(preset_config(args.model), seed=args.seed)
        tok_path = args.tokenizer or (args.data_dir or nd.default_data_dir()) / GPT_NEOX_TOKENIZER
    with reader:
        config = reader.config
        kept = ranges.blocks(config.num_hidden_layers) if ranges is not None else None
        model = NeoXModel(filtered_config(config, kept),
                          iter_layers(reader, filter_layers=kept, dtype=dtype, device=device),
                          source_layers=kept)
    tokenizer = nd.load_tokenizer(tok_path, corpus=None, cache_dir=Path("."),  # type: ignore
                                  log=lambda *a, **k: None)
    nd.check_vocab(tokenizer, model.config.vocab_size)
    return model.eval(), tokenizer, device
