"""TEMPORARY: stand-ins for zerocore entry points being added concurrently. Deleted when they
land."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch.distributed as dist

import zerocore
from zerocore.checkpoint import MANIFEST, list_checkpoints

T = TypeVar("T")


class PeerError(Exception):
    pass


def run_agreed(fn: Callable[[], T], *, group=None) -> T:
    error = None
    result = None
    try:
        result = fn()
    except Exception as e:
        error = e
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if error is None else str(error), group=group)
    if any(m is not None for m in messages):
        rank = dist.get_rank(group)
        if error is not None and messages.index(str(error)) == rank:
            raise error
        raise PeerError(f"rank(s) {[r for r, m in enumerate(messages) if m is not None]} failed")
    return result  # type: ignore[return-value]


def checkpoint_runs(root: Path) -> dict[str | None, list[Path]]:
    out: dict[str | None, list[Path]] = {}
    for p in list_checkpoints(Path(root)):
        rid = json.loads((p / MANIFEST).read_text()).get("extra", {}).get("run_id")
        out.setdefault(rid, []).append(p)
    return out


def incomplete_checkpoints(root: Path) -> list[tuple[Path, bool]]:
    root = Path(root)
    if not root.is_dir():
        return []
    return [(p, True) for p in root.iterdir() if re.match(r"^step-\d+$", p.name)
            and not (p / MANIFEST).is_file()]


def iter_full_states(model, trainable_only=False, to_rank=None):
    for layer in model.layers:
        yield layer.index, layer.full_state(trainable_only=trainable_only)


def save_checkpoint(root, step, model, optimizer, *, run_id=None, extra=None, **kw):
    extra = dict(extra or {}, run_id=run_id)
    return zerocore.save_checkpoint(root, step, model, optimizer, extra=extra, **kw)
