"""What the command-line tools share: dtype names, the block-list syntax of ``--filter-layers``,
the model flags, and turning them into a model configuration (a preset or pretrained weights).

Nothing here starts processes or reads data; the tools (``neox.finetune``, ``neox.evaluate``,
``neox.generate``, ``neox.export``) import it, and it imports none of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path

import torch

from neox.config import PRESETS, NeoXConfig
from neox.finetune_modes import MODES

__all__ = ["DTYPES", "UsageError", "BlockRanges", "parse_layers", "add_model_arguments",
           "preset_config", "resolve_dtype", "HelpFormatter", "Parser", "byte_budget",
           "VOCAB_MULTIPLE", "positive_int", "nonnegative_int", "finite_float",
           "nonnegative_float",
           "default_data_dir_flag", "add_mode_arguments", "add_step_arguments", "auto_mode",
           "FINETUNE_DEFAULT_MODE", "recompute_blocks", "ALL_BLOCKS"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}

# The tiny preset's vocabulary is the tokenizer's, rounded up as GPT-NeoX pads its embedding.
VOCAB_MULTIPLE = 128


class UsageError(ValueError):
    """A problem with the user's input: reported as one clear message, without a traceback."""


@dataclasses.dataclass(frozen=True)
class BlockRanges:
    """``--filter-layers`` as written: inclusive ranges of block indices, not yet expanded, so
    that ``0-1000000000`` costs nothing until it is checked against a model's block count."""

    text: str
    ranges: tuple[tuple[int, int], ...]
    flag: str = "--filter-layers"   # the flag that gave them, for messages

    def blocks(self, num_blocks: int) -> tuple[int, ...]:
        """The sorted, de-duplicated block indices, after checking that every range lies in
        ``0 .. num_blocks - 1``."""
        for lo, hi in self.ranges:
            if hi >= num_blocks:
                bad = f"{lo}-{hi}" if lo != hi else str(lo)
                raise UsageError(f"{self.flag} {self.text!r}: block {bad} is out of range: "
                                 f"the model has {num_blocks} blocks, numbered 0..{num_blocks - 1}"
                                 f" (0-based, as gpt_neox.layers.{{i}} in the checkpoint)")
        return tuple(sorted({i for lo, hi in self.ranges for i in range(lo, hi + 1)}))


def parse_layers(text: str | None, *, flag: str = "--filter-layers") -> BlockRanges | None:
    """``"0,1,4-6"`` -> ranges (0, 0), (1, 1), (4, 6). Negative numbers, reversed ranges and
    anything that is not a number are refused here; the upper bound is checked by
    ``BlockRanges.blocks`` once the model's block count is known."""
    if text is None:
        return None
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {part!r} is not a block index or a "
                             f"range; expected indices like '0,1,4-6'") from None
        if lo < 0:
            raise UsageError(f"{flag} {text!r}: {part!r}: block indices start at 0")
        if hi < lo:
            raise UsageError(f"{flag} {text!r}: {part!r} is a reversed range; write "
                             f"{hi}-{lo}")
        ranges.append((lo, hi))
    if not ranges:
        raise UsageError(f"{flag} is empty: give at least one block index, e.g. '0,1'")
    return BlockRanges(text, tuple(ranges), flag)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are two lines: the full usage of a tool with forty
    flags buries the one line that says what is wrong, so it points to ``--help`` instead."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"({self.prog} --help lists every flag)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default after its help, unless the help already says it or there is
    nothing to show (no value, or an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False,
                                                                      argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def byte_budget(text: str) -> int | str:
    """argparse type: ``all``, or a number of bytes with an optional unit (KiB, MiB, GiB,
    TiB; kB, MB, GB, TB), e.g. ``2GiB`` or ``1.5GB``."""
    t = text.strip().lower()
    if t == "all":
        return "all"
    number = t.rstrip("kmgtib")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be 'all' or a size such as 2GiB, 512MiB or 1000000 (bytes), got {text!r}")
    return int(value * _UNITS[unit])


def finite_float(text: str) -> float:
    """argparse type: a finite number (``inf`` and ``nan`` are refused)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def default_data_dir_flag() -> Path | None:
    """The ``--data-dir`` default: ``$NEOX_DATA_DIR`` when set (read here, at the edge, so the
    test suite can hide the shared data to prove it runs without), else None, which means
    ``neox.data.default_data_dir()``."""
    value = os.environ.get("NEOX_DATA_DIR")
    return Path(value) if value else None


def add_model_arguments(p: argparse.ArgumentParser, *, for_training: bool) -> None:
    """The flags that say which model: the same names and defaults in every tool."""
    g = p.add_argument_group("model")
    g.add_argument("--checkpoint", type=Path, default=None,
                   help="pretrained weights: a Hugging Face GPT-NeoX directory (e.g. a run's "
                        "OUTPUT_DIR/hf) or EleutherAI 20B slim-weights directory" + (
                            "" if for_training else
                            ", or a fine-tuning run: its output directory (the newest checkpoint)"
                            " or one of its step-XXXXXXXX checkpoints") + (
                        "; without it --model picks a randomly initialised preset"
                        if for_training else "; default: the built-in run's output "
                        "runs/neox-finetune"))
    g.add_argument("--model", default="tiny" if for_training else None, choices=sorted(PRESETS),
                   help="preset when no --checkpoint (random initialisation, for machines "
                        "without weights)")
    g.add_argument("--filter-layers", default=None,
                   help="keep only these transformer blocks, 0-based as in the checkpoint, e.g. "
                        "'0,1' or '0-3'; embedding, final norm and readout are always kept "
                        "(default: all)")
    g.add_argument("--allow-outside-weights", action="store_true",
                   help="follow weight-index entries and 'latest' pointers that lead out of the "
                        "--checkpoint directory (refused by default)")
    g.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="compute dtype (default: fp32 on the CPU, bf16 on a GPU)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds a preset's random weights" + (
                       ", the LoRA adapters and the data order" if for_training
                       else " (and sampling)"))


# --finetune auto: biases when there are pretrained weights; without them there is nothing to
# fine-tune, so the whole preset trains from scratch (neox.finetune also changes its
# optimisation defaults then).
FINETUNE_DEFAULT_MODE = "biases"


def auto_mode(has_weights: bool) -> str:
    """What ``--finetune auto`` trains: biases of pretrained weights, everything otherwise."""
    return FINETUNE_DEFAULT_MODE if has_weights else "full"


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """What is trained: ``--finetune`` and the LoRA settings (neox.finetune, neox.plan)."""
    m = p.add_argument_group("fine-tuning mode")
    m.add_argument("--finetune", choices=("auto",) + MODES, default="auto",
                   help="what to train; auto: biases with --checkpoint, and without one (nothing "
                        "pretrained to fine-tune) full training of the preset from scratch")
    m.add_argument("--lora-rank", type=positive_int, default=8,
                   help="rank r of each LoRA adapter (--finetune lora)")
    m.add_argument("--lora-alpha", type=finite_float, default=16.0,
                   help="LoRA scaling numerator: adapters add (alpha / r) * B A")
    m.add_argument("--lora-targets", default="query_key_value,attention.dense",
                   help="comma-separated projections that get adapters")


# --activation-checkpointing given without a value.
ALL_BLOCKS = "all"


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """What one training step holds in memory and moves: sequence length, batch, gradient
    accumulation, the gradients' reduction dtype, optimizer offload and activation
    recomputation (neox.finetune, neox.plan)."""
    s = p.add_argument_group("the training step (what memory holds)")
    s.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    s.add_argument("--batch-size", type=positive_int, default=16,
                   help="sequences per rank per micro-batch")
    s.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step")
    s.add_argument("--reduce-dtype", choices=list(DTYPES), default="fp32",
                   help="dtype in which gradients are summed over the ranks: fp32 keeps every "
                        "bit over many ranks; bf16 halves the traffic, losing bits at each hop "
                        "(the compute dtype is --dtype)")
    s.add_argument("--offload-optimizer", action="store_true",
                   help="keep fp32 masters, gradients and Adam moments in CPU memory")
    s.add_argument("--activation-checkpointing", nargs="?", const=ALL_BLOCKS, default=None,
                   metavar="BLOCKS",
                   help="recompute blocks' activations in backward instead of keeping them: "
                        "alone, every kept block; or a block list as --filter-layers takes "
                        "(checkpoint numbering, e.g. '0-21'); same results, bitwise, for one "
                        "more forward of those blocks (default: off)")
    s.add_argument("--frozen-weights", choices=("compute", "int8"), default="compute",
                   help="how frozen weights are held and all-gathered: in the compute dtype, or "
                        "int8 with an fp32 scale per block of 128 (about half of bf16's bytes "
                        "in memory and on the wire, dequantized after each gather; trainable "
                        "weights, masters and optimizer state are never quantized; exports use "
                        "the unquantized base)")
    s.add_argument("--keep-gathered", type=byte_budget, default=0, metavar="SIZE",
                   help="gathered-memory budget per rank (e.g. 2GiB, 512MiB, a byte count, or "
                        "'all'): layers from the last one backwards that fit stay gathered, so "
                        "their backward all-gather is skipped and their frozen weights are "
                        "gathered once for the whole run; same results, bitwise (default: 0, "
                        "none beyond the last layer)")
    s.add_argument("--activation-checkpointing-every", type=positive_int, default=1,
                   metavar="K",
                   help="of the blocks --activation-checkpointing chooses, recompute every K-th "
                        "(the first, the K+1-th, ...): less memory saved, less time spent")


def recompute_blocks(choice: str | tuple[int, ...] | None, kept: tuple[int, ...]
                     ) -> tuple[int, ...]:
    """The kept blocks (checkpoint indices) --activation-checkpointing chooses: none, all of
    ``kept``, or the listed ones, each of which must be kept."""
    if choice is None:
        return ()
    if choice == ALL_BLOCKS:
        return kept
    missing = [b for b in choice if b not in kept]
    if missing:
        raise UsageError(f"--activation-checkpointing: block(s) {missing} are not among the "
                         f"kept blocks ({_ranges(kept)}); recompute only blocks the run keeps")
    return tuple(b for b in kept if b in choice)


def _ranges(blocks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``'0-2,5'``."""
    parts: list[str] = []
    for b in blocks:
        if parts and b == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{b}"
        else:
            parts.append(str(b))
    return ",".join(parts)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``--dtype``, or its default for the device: fp32 on the CPU; bf16 on a GPU (fp16 where
    the GPU has no bf16)."""
    if name is not None:
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def preset_config(name: str, *, tokenizer_rows: int | None = None) -> NeoXConfig:
    """A preset's configuration. The tiny preset takes the tokenizer's vocabulary (rounded up
    to ``VOCAB_MULTIPLE``): it is meant for whatever tokenizer the run trains."""
    if name not in PRESETS:
        raise UsageError(f"unknown --model {name!r}; presets: {', '.join(sorted(PRESETS))}")
    config = PRESETS[name]
    if name == "tiny" and tokenizer_rows is not None:
        config = dataclasses.replace(
            config, vocab_size=-(-tokenizer_rows // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    return config
