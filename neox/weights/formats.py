"""Which reader reads a path (``open_weights``), and a whole model from one
(``from_pretrained``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from neox.config import NeoXConfig, filtered_config, normalize_filter_layers
from neox.model import NeoXModel
from neox.weights.base import WeightsError, WeightsReader, iter_layers
from neox.weights.hf import WEIGHT_FILES, HFReader, is_hf_directory
from neox.weights.slim import find_slim_directory, open_slim

__all__ = ["open_weights", "from_pretrained"]


def open_weights(path: str | Path, *, config: NeoXConfig | None = None,
                 allow_outside: bool = False) -> WeightsReader:
    """Opens the pretrained weights at ``path`` with the reader for their format:

    - a Hugging Face directory: ``config.json`` plus ``model.safetensors``,
      ``model.safetensors.index.json``, ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``;
    - a GPT-NeoX slim-weights directory: ``layer_XX-model_YY-model_states.pt`` files.

    ``config`` overrides the configuration the weights carry (required where they carry none).
    ``allow_outside``: follow index entries, ``latest`` pointers and symbolic links that lead
    out of ``path`` (refused by default: a weights directory should be self-contained; the
    Hugging Face hub cache's links from ``snapshots/`` into ``blobs/`` count as inside). Raises
    ``WeightsError`` when nothing readable is there.
    """
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such weights directory")
    if path.is_file():
        raise WeightsError(f"{path} is a file; give the weights directory (holding "
                           f"config.json and the weight files)")
    if is_hf_directory(path):
        return HFReader(path, config=config, allow_outside=allow_outside)
    # The path itself, or the checkpoint its ``latest`` names, or its only global_step*.
    slim = find_slim_directory(path, allow_outside=allow_outside)
    if slim is not None:
        return open_slim(slim, config=config, allow_outside=allow_outside)
    raise WeightsError(
        f"{path}: no weights found; expected a Hugging Face directory (config.json with "
        f"{', '.join(WEIGHT_FILES)}) or GPT-NeoX slim weights "
        f"(layer_XX-model_YY-model_states.pt)")


def from_pretrained(path: str | Path, *, filter_layers: Iterable[int] | None = None,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    config: NeoXConfig | None = None, allow_outside: bool = False) -> NeoXModel:
    """Loads pretrained weights (any format ``open_weights`` reads) as a ``NeoXModel`` mapping
    token ids (B, T) to logits (B, T, vocab). ``filter_layers``: the blocks to keep (0-based,
    as in the checkpoint; embedding, final norm and readout are always kept). ``dtype`` None
    keeps the stored dtype; ``device`` defaults to the CPU. The returned model's
    ``config.num_hidden_layers`` is the number of kept blocks and ``source_layers`` their
    checkpoint indices. ``allow_outside``: see ``open_weights``."""
    with open_weights(path, config=config, allow_outside=allow_outside) as reader:
        kept = normalize_filter_layers(reader.config, filter_layers)
        layers = list(iter_layers(reader, filter_layers=kept, dtype=dtype, device=device))
        built = filtered_config(reader.config, kept)
    return NeoXModel(built, layers, source_layers=kept)
