"""GPT-NeoX on zerocore: the model as a stack of layers, its checkpoint formats, fine-tuning.

    model = neox.from_pretrained("path/to/hf-dir", filter_layers={0, 1})  # ids -> logits

For sharding, stream the layers instead of building the whole model:

    with neox.open_weights(path) as reader:
        layers = neox.iter_layers(reader, filter_layers=..., dtype=..., prepare=...)
"""

from neox.config import PRESETS, NeoXConfig, filtered_config, normalize_filter_layers
from neox.model import (Block, Embedding, FinalNorm, LayerSpec, NeoXModel, Readout, build_layer,
                        build_layers, init_weights, layer_specs)
from neox.weights import (HFReader, RandomInit, WeightsError, WeightsReader, from_pretrained,
                          iter_layer_states, iter_layers, materialize, open_weights, save_hf)

__all__ = [
    "NeoXConfig", "PRESETS",
    "NeoXModel", "Embedding", "Block", "FinalNorm", "Readout", "LayerSpec",
    "build_layer", "build_layers", "init_weights", "layer_specs", "normalize_filter_layers",
    "filtered_config", "WeightsError", "WeightsReader", "HFReader", "RandomInit",
    "open_weights", "materialize", "iter_layers", "from_pretrained", "iter_layer_states",
    "save_hf",
]
