"""The directories under a checkpoint root: which are checkpoints, of which run, which are
leftovers, and how they are removed.

    root/
        step-00000100/                 a committed checkpoint (formats 3 and 2: it has a
                                       COMMIT record; format 1: a manifest)
        step-00000101.tmp-1a2b3c4d/    a save in progress, or killed: never loaded
        step-00000097.deleting-…/      a deletion in progress, or killed: never loaded
        step-00000102/                 without a manifest (or, formats 3/2, without COMMIT): an
                                       incomplete checkpoint, never loaded

Only a ``step-XXXXXXXX`` directory with a manifest and (formats 3, 2) a COMMIT record is a
checkpoint. An incomplete one is a leftover when every entry in it is a file zerocore writes
(``rank-NNNNN.pt``, ``manifest.json``, ``COMMIT``): the next save removes it. Anything else in it
(another file, a directory, a link) means it is not zerocore's: it is left alone and reported
(``incomplete_checkpoints``). Directories are removed by first renaming them out of the
``step-XXXXXXXX`` namespace (atomic), then deleting them, so a kill during a deletion never leaves
a partial checkpoint under a final name.

Runs: a checkpoint saved with a ``run_id`` belongs to that run; one saved without (or in format
1) to the run ``None``. A checkpoint whose manifest cannot be read belongs to no run that the
listings can name: it is listed (so that loading it reports the damage) but never pruned.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from zerocore.checkpoint.manifest import COMMIT, FORMAT, FORMAT_V2, MANIFEST, peek_manifest

STEP_DIR = re.compile(r"^step-(\d+)$")
# Leftovers of a save that was killed (``step-X.tmp-<nonce>``) or of a deletion that was
# (``step-X.deleting-<nonce>``): never loaded, removed by the next save.
LEFTOVER_DIR = re.compile(r"^step-\d+\.(tmp|deleting)-[0-9a-f]+$")
# The only names zerocore writes into a step directory.
_OWN_FILE = re.compile(r"^(rank-\d{5}\.pt|manifest\.json|COMMIT)$")
# The run of a checkpoint whose manifest cannot be read (never equal to a run id or None).
UNKNOWN_RUN: Any = object()


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class IncompleteCheckpoint(NamedTuple):
    """A ``step-XXXXXXXX`` directory that is not a checkpoint (see the module docstring)."""

    path: Path
    ours: bool  # only files zerocore writes: the next save removes it; else it is left alone


def is_complete(path: Path) -> bool:
    """A manifest, and a COMMIT record unless the manifest is of format 1. (A manifest that
    cannot be parsed counts as complete: loading it reports the damage, and nothing removes
    it.)"""
    if not (path / MANIFEST).is_file():
        return False
    if (path / COMMIT).is_file():
        return True
    manifest = peek_manifest(path)
    return not (isinstance(manifest, dict) and manifest.get("format") in (FORMAT, FORMAT_V2))


def holds_only_our_files(path: Path) -> bool:
    try:
        return all(_OWN_FILE.match(e.name) and e.is_file(follow_symlinks=False)
                   for e in os.scandir(path))
    except OSError:
        return False


def run_of(path: Path) -> Any:
    """The run id stored in a checkpoint's manifest, None when it has none, ``UNKNOWN_RUN``
    when the manifest cannot be read."""
    manifest = peek_manifest(path)
    if not isinstance(manifest, dict):
        return UNKNOWN_RUN
    run_id = manifest.get("run_id")
    return run_id if run_id is None or isinstance(run_id, str) else UNKNOWN_RUN


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def list_checkpoints(root: str | Path, run_id: str | None = None) -> list[Path]:
    """Committed checkpoints under root, oldest first; only run ``run_id``'s when given."""
    found = [p for _, p in _step_dirs(Path(root)) if is_complete(p)]
    if run_id is not None:
        found = [p for p in found if run_of(p) == run_id]
    return found


def latest_checkpoint(root: str | Path, run_id: str | None = None) -> Path | None:
    """The committed checkpoint of the highest step under root (of run ``run_id`` when given),
    or None."""
    found = list_checkpoints(root, run_id)
    return found[-1] if found else None


def checkpoint_runs(root: str | Path) -> dict[str | None, list[Path]]:
    """{run id: its committed checkpoints, oldest first} for the runs whose checkpoints are
    under root; None is the run of checkpoints saved without a run id. Checkpoints whose
    manifest cannot be read are in none (``list_checkpoints`` lists them)."""
    runs: dict[str | None, list[Path]] = {}
    for path in list_checkpoints(root):
        run = run_of(path)
        if run is not UNKNOWN_RUN:
            runs.setdefault(run, []).append(path)
    return runs


def same_run_checkpoints(root: Path, run_id: str | None) -> list[Path]:
    """Committed checkpoints of run ``run_id`` exactly (None: those saved without a run id)."""
    return [p for p in list_checkpoints(root) if run_of(p) == run_id]


def incomplete_checkpoints(root: str | Path) -> list[IncompleteCheckpoint]:
    """``step-XXXXXXXX`` directories under root that are not checkpoints (no manifest, or a
    format-3 or -2 manifest without its COMMIT record), oldest first, each with whether it holds
    only files zerocore writes (then the next save removes it) or not (then it is left alone)."""
    return [IncompleteCheckpoint(p, holds_only_our_files(p))
            for _, p in _step_dirs(Path(root)) if not is_complete(p)]


def aside_name(path: Path) -> Path:
    """Where ``path`` goes before it is deleted: outside the ``step-XXXXXXXX`` namespace."""
    return path.with_name(f"{path.name}.deleting-{uuid.uuid4().hex[:8]}")


def leftovers(root: Path) -> list[Path]:
    """What a save removes once it has committed: temporary and half-deleted directories, and
    incomplete step directories holding only zerocore's files."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if LEFTOVER_DIR.match(p.name)]
    return sorted(found) + [c.path for c in incomplete_checkpoints(root) if c.ours]


def remove_tree(path: Path) -> None:
    """Deletes a directory already renamed out of the checkpoint namespace (best effort: what
    cannot be deleted stays outside the namespace, never loaded, and is retried next save)."""
    shutil.rmtree(path, ignore_errors=True)
