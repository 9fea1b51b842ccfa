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
from zerocore import FROZEN_FORMATS, FROZEN_PLACEMENTS

__all__ = ["ShardingConfig", "AUTO_PLACEMENT"]

# --frozen-placement's word for "what the plan picks": never a recipe's value, the commands
# resolve it to a placement first (neox.run.layout_choice.auto_placement).
AUTO_PLACEMENT = "auto"


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
    # (``zerocore.FrozenWeights(dtype)``): None, the compute dtype; "int8", "nf4" or "fp8",
    # quantized once (at the build and at each load) by blocks of the format's default size.
    # It changes the numbers: a resumed run keeps it.
    frozen_weights: str | None = setting(
        None, check=lambda x: x is None or x in FROZEN_FORMATS,
        problem=f"{{name}} must be null (the compute dtype) or one of {tuple(FROZEN_FORMATS)}, "
                f"got {{value!r}}",
        since=2, upgrade=lambda x: None if x == "compute" else x,
        flag=Flag(STEP, "how frozen weights are held and all-gathered: in the compute dtype, or "
                        "quantized by blocks with an fp32 scale each: int8 (blocks of 128, about "
                        "half of bf16's bytes), nf4 (QLoRA's 4-bit NormalFloat, blocks of 64, "
                        "about a quarter) or fp8 (e4m3, blocks of 128, as int8's bytes); "
                        "dequantized just before use; trainable weights, masters and optimizer "
                        "state are never quantized; checkpoints and exports hold the "
                        "unquantized base",
                  choices={"compute": None, **{f: f for f in FROZEN_FORMATS}},
                  text=lambda x: "compute" if x is None else x))
    # Where quantized frozen weights live (``zerocore.FrozenWeights(placement=)``): "sharded",
    # each rank its shard, gathered for each use; "replicated", the whole quantized base on
    # every rank, nothing frozen gathered. The same bits either way, and checkpoints hold the
    # unquantized base, so a resumed run may change it. Recipes before version 8 were sharded.
    frozen_placement: str = setting(
        "sharded", check=lambda x: x in FROZEN_PLACEMENTS, since=8,
        problem=f"{{name}} must be one of {FROZEN_PLACEMENTS}, got {{value!r}}",
        flag=Flag(STEP, "where quantized frozen weights live (with --frozen-weights int8, nf4 "
                        "or fp8): 'sharded', each rank holds its shard and each use all-gathers "
                        "it; 'replicated', every rank holds the whole quantized base and "
                        "dequantizes each layer just before it runs: nothing frozen is gathered, "
                        "for the whole base's memory on every rank; same results, bitwise; "
                        "'auto', what the plan picks (replicated when it fits the GPU, else "
                        "sharded), resolved before the run starts and stored as that",
                  choices=FROZEN_PLACEMENTS + (AUTO_PLACEMENT,), resumable=True))

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
                    frozen_weights=zerocore.FrozenWeights(self.frozen_weights,
                                                          placement=self.frozen_placement),
                    recompute=self.recompute(specs),
                    compile=zerocore.Compile() if self.compile else None,
                    prefetch=zerocore.Prefetch(keep_gathered=self.keep_gathered))

    @property
    def frozen_quantized(self) -> bool:
        """Whether the frozen weights are held quantized (in any format)."""
        return self.frozen_weights is not None

    def problem(self, *, offload: str | None, offload_device: str) -> str | None:
        """Why the recipe's --frozen-placement cannot be (None: it can), with --offload
        ``offload`` to ``offload_device`` (zerocore refuses these too, in its own words and
        later). With --offload params or all, a replicated base lives in host memory, never on
        NVMe."""
        if self.frozen_placement != "replicated":
            return None
        if not self.frozen_quantized:
            return ("--frozen-placement replicated holds the whole quantized frozen base on "
                    "every rank: add --frozen-weights nf4, fp8 or int8, or leave it sharded")
        if offload in ("params", "all") and offload_device == "nvme":
            return (f"--frozen-placement replicated keeps the whole quantized frozen base in "
                    f"each rank's memory (with --offload {offload}, the host's), and "
                    f"--offload-device nvme puts the parameter shards on NVMe: give "
                    f"--offload-device cpu, or leave the base sharded")
        return None

    def words(self) -> str:
        """What these policies change of a plain build, for the run's model line ("" none)."""
        frozen = ("" if not self.frozen_quantized else
                  f"; frozen weights held in {self.frozen_weights}, replicated on every rank "
                  f"(nothing frozen gathered)" if self.frozen_placement == "replicated" else
                  f"; frozen weights held and gathered in {self.frozen_weights}")
        return (frozen
                + ("; each layer's forward compiled (torch.compile)" if self.compile else ""))
