"""Pretrained GPT-NeoX weights, read one layer at a time whatever their format.

- ``base``: the reader interface (``WeightsReader``), its error (``WeightsError``), and
  ``iter_layers``/``materialize``, which turn a reader into checked, materialised layers,
  and ``meta_layer`` for readers that read by range (each rank reads only its shard);
- ``hf``: Hugging Face directories (read layer by layer; ``save_hf`` writes them);
- ``slim``: EleutherAI's GPT-NeoX-20B "slim weights", tensor-parallel partitions merged;
- ``neox_yaml``: the NeoX library's YAML configs, translated into a ``NeoXConfig``;
- ``random_init``: seeded random weights for presets (machines without weights);
- ``formats``: ``open_weights`` (the reader for a path) and ``from_pretrained``.

"Weights" are what a run starts from; the sharded training state a run saves is a zerocore
checkpoint (``zerocore.save_checkpoint``), a different thing with its own error type.
"""

from neox.weights.base import (WeightsError, WeightsReader, iter_layer_states, iter_layers,
                               layer_label, load_state_file, materialize, meta_layer)
from neox.weights.hf import HFReader, hf_key, is_hf_directory, save_hf
from neox.weights.neox_yaml import config_from_neox_yaml, read_neox_yaml
from neox.weights.random_init import RandomInit
from neox.weights.slim import SlimReader, find_slim_directory, open_slim
from neox.weights.formats import from_pretrained, open_weights

__all__ = [
    "WeightsError", "WeightsReader", "iter_layers", "iter_layer_states", "layer_label",
    "meta_layer",
    "load_state_file", "materialize", "HFReader", "hf_key", "is_hf_directory", "save_hf",
    "config_from_neox_yaml", "read_neox_yaml", "RandomInit", "SlimReader", "find_slim_directory",
    "open_slim", "from_pretrained", "open_weights",
]
