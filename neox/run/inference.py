"""Loading a model and its tokenizer for single-process use (``neox.evaluate``,
``neox.generate``): a fine-tuning run (its output directory or one of its checkpoints, rebuilt
from the checkpoint alone), pretrained weights (Hugging Face, slim weights, a run's
``--export-hf`` output), or a randomly initialised preset. With none given, the built-in run's
output (``python -m neox.finetune`` with no arguments writes ``runs/neox-finetune``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from tokenizers import Tokenizer

from neox import data as nd
from neox.blocks import parse_layers
from neox.config import filtered_config, preset_config
from neox.dtypes import resolve_dtype
from neox.model import NeoXModel
from neox.run.recipe import OutputConfig, Recipe
from neox.run.run_dir import DATA_SHA256, OutputDirError
from neox.run.trained import checkpoint_tokenizer, open_run, run_checkpoint, trained_model
from neox.weights import RandomInit, iter_layers, open_weights

GPT_NEOX_TOKENIZER = "gpt-neox-20b-tokenizer.json"
# Where the built-in run writes (neox.finetune's --output-dir default).
BUILT_IN_RUN = Path(OutputConfig().output_dir)


@dataclasses.dataclass
class Loaded:
    model: NeoXModel       # eval mode, on ``device``
    tokenizer: Tokenizer
    device: torch.device
    source: str            # what was loaded, for messages
    recipe: Recipe | None  # the run's recipe, when a run's checkpoint was loaded
    data_sha256: str | None = None  # the SHA-256 of the text that run trained on, if recorded


def _tokenizer(path: Path) -> Tokenizer:
    tokenizer = nd.load_tokenizer(path, corpus=None, cache_dir=Path("."),  # type: ignore
                                  log=lambda *a, **k: None)
    return tokenizer


def choose_device(name: str | None) -> torch.device:
    """``--device``: cpu, cuda or cuda:N, checked against what this torch and machine have
    (ValueError, one line, otherwise)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: not a device these tools run on; use cpu, cuda or "
                         f"cuda:N")
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ValueError(f"--device {name}: this torch ({torch.__version__}) is a CPU-only "
                             f"build; use --device cpu, or install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is visible; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             f"GPU(s), numbered from 0")
    return device


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Which model to load, as the loading commands' flags say (the names are the flags')."""

    checkpoint: Path | None = None     # weights, a run's output directory or a checkpoint
    model: str | None = None           # a preset, when no checkpoint
    filter_layers: str | None = None   # kept blocks of pretrained weights, as written
    allow_outside_weights: bool = False
    dtype: str | None = None
    seed: int = 0                      # a preset's random weights
    tokenizer: Path | None = None
    data_dir: Path | None = None       # where a preset's GPT-NeoX tokenizer is
    device: str | None = None
    allow_unverified: bool = False     # a run's checkpoint of an older format


def load_model(args: ModelSource) -> Loaded:
    """The model and tokenizer ``args`` describe. Raises ValueError (with a message for
    the user) on bad input."""
    device = choose_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    source = args.checkpoint
    if source is None and args.model is None:
        if not (BUILT_IN_RUN / "checkpoints").is_dir():
            raise ValueError(
                f"no model given, and no built-in run's output in {BUILT_IN_RUN}: pass "
                f"--checkpoint DIR (a fine-tuning run's output directory or one of its "
                f"checkpoints, or Hugging Face or slim weights), or --model PRESET for random "
                f"weights; python -m neox.finetune with no arguments writes {BUILT_IN_RUN}")
        source = BUILT_IN_RUN
    try:
        ckpt = run_checkpoint(source) if source is not None else None
    except OutputDirError as e:
        raise ValueError(str(e).replace("--resume", "--checkpoint")) from None
    if ckpt is not None:
        if args.filter_layers is not None:
            raise ValueError("--filter-layers applies to pretrained weights; a run's checkpoint "
                             "holds the blocks the run kept")
        # Verified once, before any path its recipe names is opened.
        ckpt = open_run(ckpt, allow_unverified=args.allow_unverified)
        tok_path = args.tokenizer
        if tok_path is None:
            tok_path, looked = checkpoint_tokenizer(ckpt)
            if tok_path is None:
                raise ValueError(f"the tokenizer of the run of {ckpt.path} was not found "
                                 f"(looked in "
                                 f"{', '.join(str(p) for p in looked)}); pass --tokenizer FILE")
        model = trained_model(ckpt, dtype=dtype, device=device)
        sha = ckpt.extra.get(DATA_SHA256)
        loaded = Loaded(model, _tokenizer(tok_path), device, str(ckpt.path), ckpt.recipe,
                        sha if isinstance(sha, str) else None)
    else:
        ranges = parse_layers(args.filter_layers)
        if source is not None:
            reader = open_weights(source, allow_outside=args.allow_outside_weights)
            tok_path = args.tokenizer or Path(source) / "tokenizer.json"
            if not Path(tok_path).is_file():
                raise ValueError(f"{source} has no tokenizer.json; pass --tokenizer FILE")
        else:
            reader = RandomInit(preset_config(args.model), seed=args.seed)
            tok_path = args.tokenizer or (args.data_dir or nd.default_data_dir()) / \
                GPT_NEOX_TOKENIZER
            if not Path(tok_path).is_file():
                raise ValueError(f"--model {args.model} needs a tokenizer: the GPT-NeoX "
                                 f"tokenizer {tok_path} is not there; pass --tokenizer FILE")
        with reader:
            config = reader.config
            kept = ranges.blocks(config.num_hidden_layers) if ranges is not None else None
            model = NeoXModel(filtered_config(config, kept),
                              iter_layers(reader, filter_layers=kept, dtype=dtype,
                                          device=device), source_layers=kept)
        loaded = Loaded(model, _tokenizer(tok_path), device, str(source or args.model), None)
    nd.check_vocab(loaded.tokenizer, loaded.model.config.vocab_size)
    loaded.model.eval()
    return loaded
