"""Block lists as a user writes them (``--filter-layers``, ``--activation-checkpointing``):
inclusive ranges of 0-based block indices, as ``gpt_neox.layers.{i}`` in a checkpoint, checked
against a model's block count once it is known."""

from __future__ import annotations

import dataclasses

from neox.setting import UsageError

__all__ = ["BlockRanges", "parse_layers", "recompute_blocks", "chosen_blocks", "ALL_BLOCKS"]

# --activation-checkpointing given without a value.
ALL_BLOCKS = "all"


@dataclasses.dataclass(frozen=True)
class BlockRanges:
    """A block list as written: inclusive ranges of block indices, not yet expanded, so that
    ``0-1000000000`` costs nothing until it is checked against a model's block count."""

    text: str
    ranges: tuple[tuple[int, int], ...]
    flag: str = "--filter-layers"   # the flag that gave them, for messages

    def blocks(self, num_blocks: int) -> tuple[int, ...]:
        """The sorted, de-duplicated block indices, after checking that every range lies in
        ``0 .. num_blocks - 1``."""
        for lo, hi in self.ranges:
            if hi >= num_blocks:
                bad = f"{lo}-{hi}" if lo != hi else str(lo)
                raise UsageError(f"{self.flag} {self.text!r}: block {bad} is out of range: "
                                 f"the model has {num_blocks} blocks, numbered 0..{num_blocks - 1}"
                                 f" (0-based, as gpt_neox.layers.{{i}} in the checkpoint)")
        return tuple(sorted({i for lo, hi in self.ranges for i in range(lo, hi + 1)}))


def parse_layers(text: str | None, *, flag: str = "--filter-layers") -> BlockRanges | None:
    """``"0,1,4-6"`` -> ranges (0, 0), (1, 1), (4, 6). Negative numbers, reversed ranges and
    anything that is not a number are refused here; the upper bound is checked by
    ``BlockRanges.blocks`` once the model's block count is known."""
    if text is None:
        return None
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {part!r} is not a block index or a "
                             f"range; expected indices like '0,1,4-6'") from None
        if lo < 0:
            raise UsageError(f"{flag} {text!r}: {part!r}: block indices start at 0")
        if hi < lo:
            raise UsageError(f"{flag} {text!r}: {part!r} is a reversed range; write "
                             f"{hi}-{lo}")
        ranges.append((lo, hi))
    if not ranges:
        raise UsageError(f"{flag} is empty: give at least one block index, e.g. '0,1'")
    return BlockRanges(text, tuple(ranges), flag)


def recompute_blocks(choice: str | tuple[int, ...] | None, kept: tuple[int, ...]
                     ) -> tuple[int, ...]:
    """The kept blocks (checkpoint indices) --activation-checkpointing chooses: none, all of
    ``kept``, or the listed ones, each of which must be kept."""
    if choice is None:
        return ()
    if choice == ALL_BLOCKS:
        return kept
    missing = [b for b in choice if b not in kept]
    if missing:
        raise UsageError(f"--activation-checkpointing: block(s) {missing} are not among the "
                         f"kept blocks ({_ranges(kept)}); recompute only blocks the run keeps")
    return tuple(b for b in kept if b in choice)


def _ranges(blocks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``'0-2,5'``."""
    parts: list[str] = []
    for b in blocks:
        if parts and b == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{b}"
        else:
            parts.append(str(b))
    return ",".join(parts)


def chosen_blocks(filter_layers: str | None, recompute: str | None, num_blocks: int
                  ) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """(the kept blocks, None for all; the recomputed ones) that ``--filter-layers`` and
    ``--activation-checkpointing`` name, in a model of ``num_blocks`` blocks."""
    ranges = parse_layers(filter_layers)
    kept = ranges.blocks(num_blocks) if ranges is not None else None
    choice: str | tuple[int, ...] | None = recompute
    if recompute is not None and recompute != ALL_BLOCKS:
        choice = parse_layers(recompute, flag="--activation-checkpointing").blocks(num_blocks)
    return kept, recompute_blocks(choice, kept if kept is not None else tuple(range(num_blocks)))
