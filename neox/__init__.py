"""GPT-NeoX on zerocore: the model as a stack of layers, its checkpoint formats, fine-tuning.

    model = neox.from_pretrained("path/to/hf-dir", filter_layers={0, 1})  # ids -> logits

For sharding, stream the layers instead of building the whole model:

    with neox.open_weights(path) as reader:
        layers = neox.iter_layers(reader, filter_layers=..., dtype=..., prepare=...)

The names are imported when first used (``neox.from_pretrained`` imports ``neox.weights``, and
so torch): ``python -m neox.<command>`` imports this package before the command's module runs,
and a command must be able to tell Ctrl-C in the seconds torch takes to import from a crash
(``neox.commands.entry``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Where each name of the package face is defined.
_HOMES = {
    "neox.config": ("PRESETS", "NeoXConfig", "filtered_config", "normalize_filter_layers"),
    "neox.model": ("Block", "Embedding", "FinalNorm", "LayerSpec", "NeoXModel", "Readout",
                   "build_layer", "build_layers", "init_weights", "layer_specs"),
    "neox.weights": ("HFReader", "RandomInit", "WeightsError", "WeightsReader",
                     "from_pretrained", "iter_layer_states", "iter_layers", "materialize",
                     "open_weights", "save_hf"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [name for names in _HOMES.values() for name in names]


def __getattr__(name: str) -> Any:
    """A name of the package face, from its module (imported now if it was not yet)."""
    if name not in _HOME:
        raise AttributeError(f"module 'neox' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
