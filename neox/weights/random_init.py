"""Random weights as a reader: the stand-in for presets on machines without weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from neox.config import NeoXConfig
from neox.model import LayerKind, allocated, build_layer, init_weights
from neox.weights.base import WeightsReader

__all__ = ["RandomInit"]


class RandomInit(WeightsReader):
    """A 'checkpoint' of random weights (``neox.model.init_weights``): the stand-in for presets
    on machines without weights. Each layer is drawn from its own generator, seeded from
    ``seed`` and the layer's identity, so every rank gets the same values, and a filtered model
    gets the same blocks as the full one."""

    def __init__(self, config: NeoXConfig, *, seed: int = 0, std: float = 0.02):
        self.config = config
        self.path = Path(f"<random init, seed {seed}>")
        self.seed = seed
        self.std = std

    def read(self, kind: LayerKind, index: int | None = None) -> dict[str, torch.Tensor]:
        digest = hashlib.sha256(f"{self.seed}:{kind}:{index}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        layer = allocated(build_layer(kind, self.config, device="meta"), "cpu")
        init_weights(layer, std=self.std, generator=generator)
        return dict(layer.state_dict())
