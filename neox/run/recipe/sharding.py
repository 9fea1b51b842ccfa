"""How each layer is held and computed by the sharding engine: the dtype gradients are summed
in, how frozen weights are held, which blocks are recomputed, whether each layer's forward is
compiled, and how much stays gathered. ``policies`` gives ``zerocore.shard`` those policies."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import zerocore
from neox.blocks import ALL_BLOCKS
from neox.dtypes import DTYPES
from neox.model import LayerSpec
from neox.run.recipe.declaring import AT_LEAST_1, STEP, at_least, blocks, check_fields, is_bool
from neox.setting import Flag, byte_budget, setting

__all__ = ["ShardingConfig"]


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """The engine's policies for the layers (``zerocore.MixedPrecision``'s reduce dtype,
    ``FrozenWeights``, ``Recompute``, ``Compile``, ``Prefetch``)."""

    reduce_dtype: str = setting(
        "fp32", check=lambda x: x in DTYPES,
        problem="{name} must be fp32, bf16 or fp16, got {value!r}",
        flag=Flag(STEP, "dtype in which gradients are summed over the ranks: fp32 keeps every "
                        "bit over many ranks; bf16 halves the traffic, losing bits at each hop "
                        "(the compute dtype is --dtype)", choices=tuple(DTYPES), resumable=True))
    # How frozen weights are held and gathered, in the engine's words
    # (``zerocore.FrozenWeights(dtype)``): None, the compute dtype; "int8", quantized once,
    # dequantized after each gather.
    frozen_weights: str | None = setting(
        None, check=lambda x: x in (None, "int8"),
        problem="{name} must be null (the compute dtype) or int8, got {value!r}",
        since=2, upgrade=lambda x: None if x == "compute" else x,
        flag=Flag(STEP, "how frozen weights are held and all-gathered: in the compute dtype, or "
                        "int8 with an fp32 scale per block of 128 (about half of bf16's bytes "
                        "in memory and on the wire, dequantized after each gather; trainable "
                        "weights, masters and optimizer state are never quantized; exports use "
                        "the unquantized base)", choices={"compute": None, "int8": "int8"},
                  text=lambda x: "compute" if x is None else x))

    # Blocks (checkpoint indices, among the kept ones) whose activations are recomputed in
    # backward instead of kept; () none. Of those, every k-th is (the first, the k+1-th, ...).
    # Results are bitwise the same either way, so a resumed run may change them.
    activation_checkpointing: tuple[int, ...] = setting(
        (), check=blocks, problem="{name} must be block indices, got {value!r}",
        flag=Flag(STEP, "recompute blocks' activations in backward instead of keeping them: "
                        "alone, every kept block; or a block list as --filter-layers takes "
                        "(checkpoint numbering, e.g. '0-21'); same results, bitwise, for one "
                        "more forward of those blocks (default: off)", nargs="?",
                  const=ALL_BLOCKS, default=None, has_default=True, metavar="BLOCKS",
                  late=True, resumable=True))
    activation_checkpointing_every: int = setting(
        1, check=at_least(1), problem=AT_LEAST_1,
        flag=Flag(STEP, "of the blocks --activation-checkpointing chooses, recompute every K-th "
                        "(the first, the K+1-th, ...): less memory saved, less time spent",
                  parse=int, metavar="K", resumable=True))
    compile: bool = setting(
        False, check=is_bool, problem="{name} must be a bool", since=4,
        flag=Flag(STEP, "compile each layer's forward (embedding, blocks, head) with "
                        "torch.compile (zerocore.Compile; the sharding engine stays eager "
                        "around it); the first steps take longer while it compiles",
                  resumable=True))
    # Gathered-memory budget per rank (zerocore.Prefetch.keep_gathered): bytes, or "all".
    # Bitwise neutral too: a resumed run may change it.
    keep_gathered: int | str = setting(
        0, check=lambda x: x == "all" or at_least(0)(x), since=2,
        problem="{name} must be a number of bytes >= 0 or 'all', got {value!r}",
        flag=Flag(STEP, "gathered-memory budget per rank (e.g. 2GiB, 512MiB, a byte count, or "
                        "'all'): layers from the last one backwards that fit stay gathered, so "
                        "their backward all-gather is skipped and their frozen weights are "
                        "gathered once for the whole run; same results, bitwise (default: 0, "
                        "none beyond the last layer)", parse=byte_budget, metavar="SIZE",
                  resumable=True))


    def __post_init__(self) -> None:
        check_fields(self, "recipe.sharding")

    def recompute(self, specs: list[LayerSpec]) -> zerocore.Recompute | None:
        """The engine's ``Recompute`` for the blocks ``activation_checkpointing`` names
        (checkpoint indices), at their positions in the stack ``specs`` describes; None for
        none."""
        chosen = set(self.activation_checkpointing)
        positions = tuple(i for i, spec in enumerate(specs)
                          if spec.kind == "block" and spec.source in chosen)
        if not positions:
            return None
        return zerocore.Recompute(layers=positions, every=self.activation_checkpointing_every)

    def policies(self, *, dtype: torch.dtype, specs: list[LayerSpec]) -> dict[str, Any]:
        """``zerocore.shard``'s keywords for these policies, for layers ``specs`` computing in
        ``dtype`` (the model's, resolved for the device)."""
        return dict(mixed_precision=zerocore.MixedPrecision(
                        param_dtype=dtype, reduce_dtype=DTYPES[self.reduce_dtype]),
                    frozen_weights=zerocore.FrozenWeights(self.frozen_weights),
                    recompute=self.recompute(specs),
                    compile=zerocore.Compile() if self.compile else None,
                    prefetch=zerocore.Prefetch(keep_gathered=self.keep_gathered))

    def words(self) -> str:
        """What these policies change of a plain build, for the run's model line ("" none)."""
        return (("; frozen weights held and gathered in int8"
                 if self.frozen_weights == "int8" else "")
                + ("; each layer's forward compiled (torch.compile)" if self.compile else ""))
