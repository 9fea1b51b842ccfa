"""``MetaLayer``: a layer given to ``zerocore.shard`` as shapes plus a reader, so that each rank
reads only the part of each parameter that its shard holds.

``zerocore.shard`` keeps 1/N of every flat group; a layer handed over materialised costs every
rank the whole layer's memory and I/O before that slice is cut. A ``MetaLayer`` instead carries
a module whose parameters may be on the meta device (names, shapes, dtypes and requires_grad
set, values absent) and a function that reads any element range of any of those parameters:
the engine computes the layout from the shapes and asks, for each parameter its shard overlaps,
for just those elements. Parameters that do hold values (adapters created on the CPU, say) are
used as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

# read(name, start, stop) -> 1-D tensor of elements [start, stop) of parameter ``name``
# (its name in the module, as named_parameters gives it), flattened row-major; any float
# dtype, on the CPU or the compute device.
RangeReader = Callable[[str, int, int], torch.Tensor]
# The most elements the engine asks a reader for at once (a larger range is asked for in
# pieces): what bounds the loading's transient, whatever the largest parameter. 4 Mi elements:
# 16 MiB stored in fp32 (and its conversion), small beside a shard of a model worth sharding;
# large enough that a read's fixed cost (a system call, a Python call) is negligible.
READ_PIECE_NUMEL = 2**22


@dataclasses.dataclass(frozen=True)
class MetaLayer:
    """A layer whose parameter values are read by range when it is sharded.

    module: the layer; parameters on the meta device are read through ``read``, the others are
        taken as they are. Buffers must hold values (they are small and every rank keeps them).
    read: ``read(name, start, stop)``: elements ``[start, stop)`` of the flattened parameter
        ``name``. Called only for meta parameters, only for ranges inside them, of at most
        ``READ_PIECE_NUMEL`` elements.
    """

    module: nn.Module
    read: RangeReader

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"MetaLayer.module must be an nn.Module, got "
                            f"{type(self.module).__name__}")
        if not callable(self.read):
            raise TypeError("MetaLayer.read must be a function read(name, start, stop)")
        meta_buffers = [n for n, b in self.module.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ValueError(f"MetaLayer: buffers {meta_buffers} are on the meta device; only "
                             f"parameters are read by range: materialise the buffers first")
