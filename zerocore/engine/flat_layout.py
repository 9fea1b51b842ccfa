"""Where each parameter of a layer lives in its flat group, and which slice each rank owns.

A layer's parameters are split into two flat groups, trainable and frozen (``requires_grad`` at
``zerocore.shard`` time). In each group, parameters are laid end to end in registration order,
each starting at a multiple of ``ALIGN`` elements so every unsharded view and every shard boundary
is aligned for 16-byte vector loads in any dtype; the group is padded to a multiple of
``ALIGN * world_size`` and rank r owns ``[r * shard_numel, (r + 1) * shard_numel)``. Gaps and the
tail are padding: zero, and kept zero (pack writes zeros there).

The layout is plain data (names, shapes, offsets): checkpoints store it so a checkpoint written by
N ranks can be read by M.
"""

from __future__ import annotations

import dataclasses
import math

# Elements; 16 fp32 = 64 bytes, 16 fp16 = 32 bytes: a cache line / two 16-byte vectors.
ALIGN = 16


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    name: str                # parameter name within the layer, e.g. "attention.dense.bias"
    shape: tuple[int, ...]
    offset: int              # first element in the unsharded flat group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    world_size: int
    padded_numel: int        # unsharded flat size, a multiple of ALIGN * world_size
    block: int = 1           # int8 frozen groups: slots and shards on whole blocks (build)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def numel(self) -> int:
        """Real (unpadded) number of parameters in the group."""
        return sum(s.numel for s in self.slots)

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    @staticmethod
    def build(named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int,
              block: int = 1) -> "FlatLayout":
        """block: int8 frozen groups' quantization block: every parameter starts on a block
        boundary and every shard is whole blocks, so no block mixes two parameters (a
        LayerNorm weight of ~1 would set the scale of a matrix's ~0.02 values) or two ranks."""
        unit = math.lcm(ALIGN, block)
        slots, cursor = [], 0
        for name, shape in named_shapes:
            slots.append(ParamSlot(name, tuple(shape), cursor))
            cursor = _round_up(cursor + math.prod(shape), unit)
        padded = _round_up(max(cursor, 1), unit * world_size) if slots else 0
        return FlatLayout(tuple(slots), world_size, padded, block)

    def to_dict(self) -> dict:
        d = {"world_size": self.world_size, "padded_numel": self.padded_numel,
             "slots": [[s.name, list(s.shape), s.offset] for s in self.slots]}
        if self.block != 1:  # absent otherwise: layouts read as before
            d["block"] = self.block
        return d

    @staticmethod
    def from_dict(d: dict) -> "FlatLayout":
        return FlatLayout(tuple(ParamSlot(n, tuple(sh), o) for n, sh, o in d["slots"]),
                          d["world_size"], d["padded_numel"], d.get("block", 1))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
