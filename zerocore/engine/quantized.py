"""``Quantized``: how a quantized frozen flat group (``FrozenWeights(dtype=...)``) is packed into
bytes and unpacked into the compute dtype.

A rank's part of the group (its shard: ``shard_numel`` elements, whole blocks, since the layout
puts every parameter and every shard on block boundaries) is one byte buffer, the codes then
their fp32 scales, so that one collective moves both. The whole group is the ranks' parts in
rank order: what an all-gather of the shards gives, and what a replicated home holds
(homes/replicated.py), quantized part by part exactly as when sharded, so every placement gives
the same bits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import is_fake

from zerocore.kernels import formats, ops
from zerocore.policies import FrozenWeights


@dataclasses.dataclass(frozen=True)
class Quantized:
    """One format and its block (``FrozenWeights``')."""

    dtype: str        # "int8", "nf4" or "fp8"
    block: int        # elements per fp32 scale

    @staticmethod
    def of(frozen_weights: FrozenWeights) -> "Quantized | None":
        """The packing of ``frozen_weights``; None when frozen groups are not quantized."""
        if not frozen_weights.quantized:
            return None
        return Quantized(frozen_weights.dtype, frozen_weights.block)

    def part_nbytes(self, part_numel: int) -> int:
        """Bytes of one rank's packed part of ``part_numel`` elements (whole blocks)."""
        assert part_numel % self.block == 0, "a part is whole blocks (the layout's)"
        codes = part_numel // 2 if self.dtype == "nf4" else part_numel
        return codes + 4 * (part_numel // self.block)

    def pack(self, values: torch.Tensor, part_numel: int) -> torch.Tensor:
        """``values`` (1D, any float dtype, a whole number of parts of ``part_numel``
        elements) as the parts' packed bytes end to end (1D, uint8, on values' device)."""
        if is_fake(values):
            # A plan's rehearsal (zerocore.plan): only the bytes' size counts, and NF4's and
            # fp8's quantizers, plain PyTorch, read the values (their finiteness check).
            n_parts = values.numel() // part_numel
            return values.new_empty(n_parts * self.part_nbytes(part_numel), dtype=torch.uint8)
        return torch.cat([self._pack_part(part)
                          for part in values.contiguous().split(part_numel)])

    def _pack_part(self, part: torch.Tensor) -> torch.Tensor:
        if self.dtype == "int8":
            codes, scales = ops.quantize_blockwise(part, self.block)
        elif self.dtype == "nf4":
            codes, scales = formats.quantize_nf4(part, self.block)
        else:
            codes, scales = formats.quantize_fp8(part, self.block)
        return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)])

    def unpack(self, packed: torch.Tensor, out: torch.Tensor, part_numel: int) -> None:
        """out (1D, the compute dtype, a whole number of parts) <- the parts packed in
        ``packed`` (``pack``'s bytes, or every rank's as gathered), one fused dequantization
        per part, straight into out."""
        if is_fake(out):
            # A plan's rehearsal: the dequantization writes into ``out`` in place, through
            # views, and allocates nothing, so it changes no byte the plan counts (nor a FLOP:
            # torch's counter does not count zerocore's kernels); its few fake operations per
            # rank's part were a seventh of a quantized base's plan.
            return
        codes_nbytes = self.part_nbytes(part_numel) - 4 * (part_numel // self.block)
        parts = packed.split(self.part_nbytes(part_numel))
        for r, part in enumerate(parts):
            target = out[r * part_numel:(r + 1) * part_numel]
            codes, scales = part[:codes_nbytes], part[codes_nbytes:].view(torch.float32)
            if self.dtype == "int8":
                ops.dequantize_blockwise_(target, codes.view(torch.int8), scales, self.block)
            elif self.dtype == "nf4":
                ops.dequantize_nf4_(target, codes, scales, self.block)
            else:
                ops.dequantize_fp8_(target, codes, scales, self.block)
