"""A checkpoint's ``manifest.json`` and its ``COMMIT`` record: what they hold, and the check
that every field is what a save writes.

The manifest describes a checkpoint (world size, every layer's flat layout, dtypes, optimizer
and loss-scaler state, the caller's extra state, a SHA-256 and size per rank file); the rank
files are verified against it. ``COMMIT``, written after the manifest and before the directory
is renamed into place, verifies the manifest the same way: its SHA-256 and size. So a manifest
edited by hand, truncated or half-copied is refused instead of loading wrong weights.

Reading does not trust a manifest whose COMMIT matches either (the record can be recomputed
after an edit): every field is checked against the schema below, and the layouts against what
``FlatLayout.build`` computes from the parameter names and shapes, which catches moved, swapped
or resized slots and a changed ``padded_numel``. Each violation is one ``CheckpointError`` line
naming the file and the field: ``.../manifest.json: layers[3].trainable.slots[1].offset: ...``.

Identity: a manifest of format 3 has a ``save_id``, random per save, and every rank file of the
save records it with its rank, world size, step, run id, a digest of the layouts and a digest of
the manifest's content (``manifest_digest``: everything but the ``files`` table, which describes
the rank files themselves). So a recomputed COMMIT does not make an edit pass: the rank files
still say what was saved (checkpoint_reader.py checks them).

Formats: ``zerocore-checkpoint/3`` (COMMIT, ``save_id``, an optional ``run_id``, rank files that
record their identity) is written. Older formats cannot be verified that way: format 2 (COMMIT,
rank files without identity) and format 1 (no COMMIT, no run id) are read only when the caller
opts in (``allow_unverified=True``; the commands' ``--allow-unverified``), with the same field
checks. A rank file that records an identity is never read under an older format's manifest (a
downgraded manifest).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from zerocore.checkpoint.errors import CheckpointError
from zerocore.engine.flat_layout import FlatLayout

FORMAT = "zerocore-checkpoint/3"
# Read only with allow_unverified, never written: format 2 has COMMIT records and run ids but its
# rank files do not record whose they are; format 1 has neither.
FORMAT_V2 = "zerocore-checkpoint/2"
FORMAT_V1 = "zerocore-checkpoint/1"
UNVERIFIED_FORMATS = {
    FORMAT_V1: "format 1: no COMMIT record, rank files that do not record whose they are",
    FORMAT_V2: "format 2: rank files that do not record which save, rank and step they are of",
}
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
# The dtypes a sharded model computes or reduces in (zerocore shards fp32/fp16/bf16 only).
DTYPE_NAMES = ("float32", "float16", "bfloat16")

_FIELDS_V1 = ("format", "step", "world_size", "param_dtype", "reduce_dtype", "include_frozen",
              "model_fingerprint", "layers", "optimizer", "loss_scaler", "extra", "files")
_OPTIONAL = {FORMAT_V1: (), FORMAT_V2: ("run_id",), FORMAT: ("run_id",)}
_REQUIRED = {FORMAT_V1: _FIELDS_V1, FORMAT_V2: _FIELDS_V1, FORMAT: _FIELDS_V1 + ("save_id",)}
_COMMIT_FIELDS = ("format", "manifest_sha256", "manifest_bytes")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
# What was edited, in the words a user needs: the files were changed after the save.
_EDITED = "the manifest was edited or damaged after the save; use another checkpoint"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def model_fingerprint(layouts: list[dict[str, Any]]) -> str:
    """Names and shapes of every parameter of every layer, independent of the world size."""
    desc = json.dumps([[None if g is None else [s[:2] for s in g["slots"]]
                        for g in (l["trainable"], l["frozen"])] for l in layouts])
    return hashlib.sha256(desc.encode()).hexdigest()


def _digest(value: Any) -> str:
    """SHA-256 of a JSON value in one canonical form: keys sorted (and made strings, as JSON
    makes them), tuples as lists, so that a value and its parsed manifest copy hash alike."""
    canonical = json.loads(json.dumps(value))
    return hashlib.sha256(json.dumps(canonical, sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()


def layout_digest(layouts: list[dict[str, Any]]) -> str:
    """The layouts a save was written for (names, shapes, offsets, padding, world size)."""
    return _digest(layouts)


def manifest_digest(manifest: dict[str, Any]) -> str:
    """Everything a manifest says except its ``files`` table (the rank files' checksums, known
    only after they are written): what each rank file records of its manifest."""
    return _digest({k: v for k, v in manifest.items() if k != "files"})


def unverified_reason(manifest: dict[str, Any]) -> str | None:
    """Why a checked manifest's checkpoint cannot be verified (its format is older than rank
    files recording their identity), or None when it can."""
    return UNVERIFIED_FORMATS.get(manifest.get("format"))


def commit_record(manifest_bytes: bytes) -> bytes:
    """The COMMIT file's content for a manifest serialised as ``manifest_bytes``."""
    return json.dumps({"format": FORMAT,
                       "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
                       "manifest_bytes": len(manifest_bytes)}, indent=1).encode()


def peek_manifest(path: Path) -> Any:
    """The parsed ``manifest.json`` of a checkpoint directory, unverified, or None when it is
    absent or not JSON. For listing checkpoints (format, run id), never for loading them."""
    try:
        return json.loads((Path(path) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None


def read_manifest(path: str | Path, *, allow_unverified: bool = False) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``, verified: its COMMIT record and every
    field (see the module docstring). Raises ``CheckpointError`` naming the file and the field.
    A checkpoint of an older format (``UNVERIFIED_FORMATS``) is refused unless
    ``allow_unverified``. The rank files are not read here (``verify_files``,
    ``open_checkpoint``)."""
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    for own in (mf, path / COMMIT):
        if own.is_symlink():  # zerocore writes files, never links; one may point anywhere
            raise CheckpointError(f"{own}: a symbolic link, not the file a save writes; copy "
                                  f"the checkpoint's own files")
    if not mf.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; the checkpoint is incomplete (a save that "
                              f"did not finish leaves only a .tmp directory) — use an earlier one")
    try:
        raw = mf.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{mf}: cannot read ({e})") from None
    commit = path / COMMIT
    has_commit = commit.is_file()
    committed = _check_commit(commit, raw) if has_commit else None
    try:
        manifest = json.loads(raw)
    except ValueError as e:  # invalid JSON or UTF-8
        raise CheckpointError(f"{mf}: unreadable manifest ({e})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if has_commit and fmt != committed:
        raise CheckpointError(f"{mf}: format: {_show(fmt)}, but its {COMMIT} record is of "
                              f"{committed!r}: {_EDITED}")
    if not has_commit and fmt != FORMAT_V1:
        raise CheckpointError(f"{path}: no {COMMIT} record; the checkpoint is incomplete (its "
                              f"save did not finish, or it was copied in part) — use an earlier "
                              f"one")
    check_manifest(manifest, mf)
    if fmt in UNVERIFIED_FORMATS and not allow_unverified:
        raise CheckpointError(
            f"{path}: cannot be verified ({UNVERIFIED_FORMATS[fmt]}), so a swapped, foreign or "
            f"edited file would load unnoticed; if you trust it, pass --allow-unverified "
            f"(library: allow_unverified=True)")
    return manifest


def _check_commit(commit: Path, manifest_bytes: bytes) -> str:
    """Checks a COMMIT record against the manifest's bytes; returns the format it records."""
    try:
        record = json.loads(commit.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{commit}: unreadable COMMIT record ({e}); the checkpoint is "
                              f"damaged — use another one") from None
    try:
        _keys(record, "", _COMMIT_FIELDS)
        if record["format"] not in (FORMAT, FORMAT_V2):  # format 1 had no COMMIT
            raise _Invalid("format", f"expected {FORMAT!r}, got {_show(record['format'])}")
        digest = _text(record["manifest_sha256"], "manifest_sha256")
        if not _HEX64.match(digest):
            raise _Invalid("manifest_sha256", f"not a SHA-256 hex digest: {_show(digest)}")
        size = _int(record["manifest_bytes"], "manifest_bytes", 0)
    except _Invalid as e:
        raise CheckpointError(f"{commit}: {e.field}: {e.problem}; the COMMIT record is damaged "
                              f"— use another checkpoint") from None
    mf = commit.with_name(MANIFEST)
    if len(manifest_bytes) != size:
        raise CheckpointError(f"{mf}: {len(manifest_bytes)} bytes, its {COMMIT} record says "
                              f"{size}: {_EDITED}")
    if hashlib.sha256(manifest_bytes).hexdigest() != digest:
        raise CheckpointError(f"{mf}: SHA-256 differs from its {COMMIT} record's: {_EDITED}")
    return record["format"]


# -- the schema ----------------------------------------------------------------------------------


class _Invalid(Exception):
    """One violation: the field's path in the JSON (``layers[3].frozen.padded_numel``) and what
    is wrong with it."""

    def __init__(self, field: str, problem: str):
        super().__init__(field, problem)
        self.field, self.problem = field, problem


def _show(value: Any) -> str:
    """A value as it appears in the JSON file, shortened."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _keys(d: Any, field: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(d, dict):
        raise _Invalid(field or "(top level)", f"expected an object, got {_show(d)}")
    for key in required:
        if key not in d:
            raise _Invalid(_join(field, key), "missing")
    for key in d:
        if key not in required and key not in optional:
            raise _Invalid(_join(field, key), "unknown field (zerocore does not write it)")


def _int(value: Any, field: str, minimum: int) -> int:
    # type() and not isinstance(): JSON true is a Python bool, an int subclass, and is not a
    # world size.
    if type(value) is not int or value < minimum:
        raise _Invalid(field, f"expected an integer >= {minimum}, got {_show(value)}")
    return value


def _number(value: Any, field: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _Invalid(field, f"expected a finite number, got {_show(value)}")
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(field, f"expected a string, got {_show(value)}")
    return value


def _boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(field, f"expected true or false, got {_show(value)}")
    return value


def _array(value: Any, field: str, min_len: int = 0) -> list[Any]:
    if not isinstance(value, list) or len(value) < min_len:
        what = "a list" if min_len == 0 else f"a list of at least {min_len}"
        raise _Invalid(field, f"expected {what}, got {_show(value)}")
    return value


def _finite_everywhere(value: Any, field: str) -> None:
    """JSON values whose every number is finite (json reads NaN and Infinity)."""
    if isinstance(value, float):
        _number(value, field)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_everywhere(v, f"{field}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite_everywhere(v, _join(field, k))


def _check_layout(d: Any, field: str, world_size: int) -> list[str]:
    """A flat group's layout, recomputed from its names and shapes; returns the names."""
    _keys(d, field, ("world_size", "padded_numel", "slots"), ("block",))
    ws = _int(d["world_size"], f"{field}.world_size", 1)
    multiple = _int(d.get("block", 1), f"{field}.block", 1)
    if ws != world_size:
        raise _Invalid(f"{field}.world_size", f"{ws}, but the manifest's world_size is "
                                              f"{world_size}")
    named: list[tuple[str, tuple[int, ...]]] = []
    offsets: list[int] = []
    seen: set[str] = set()
    for i, slot in enumerate(_array(d["slots"], f"{field}.slots", 1)):
        at = f"{field}.slots[{i}]"
        if not isinstance(slot, list) or len(slot) != 3:
            raise _Invalid(at, f"expected [name, shape, offset], got {_show(slot)}")
        name = _text(slot[0], f"{at}.name")
        if name in seen:
            raise _Invalid(f"{at}.name", f"{name!r} appears twice")
        seen.add(name)
        shape = tuple(_int(n, f"{at}.shape[{j}]", 0)
                      for j, n in enumerate(_array(slot[1], f"{at}.shape")))
        named.append((name, shape))
        offsets.append(_int(slot[2], f"{at}.offset", 0))
    want = FlatLayout.build(named, world_size, block=multiple)
    for i, (slot, offset) in enumerate(zip(want.slots, offsets)):
        if offset != slot.offset:
            raise _Invalid(f"{field}.slots[{i}].offset",
                           f"{offset}, but a layout of these names and shapes puts {slot.name!r} "
                           f"at {slot.offset} (slots moved, swapped or resized)")
    padded = _int(d["padded_numel"], f"{field}.padded_numel", 0)
    if padded != want.padded_numel:
        raise _Invalid(f"{field}.padded_numel",
                       f"{padded}, but these shapes at world size {world_size} take "
                       f"{want.padded_numel}")
    return [n for n, _ in named]


def _check_layers(layers: Any, world_size: int) -> None:
    for i, layer in enumerate(_array(layers, "layers", 1)):
        at = f"layers[{i}]"
        _keys(layer, at, ("trainable", "frozen"))
        trainable: set[str] = set()
        for group in ("trainable", "frozen"):
            if layer[group] is not None:
                names = _check_layout(layer[group], f"{at}.{group}", world_size)
                if group == "trainable":
                    trainable = set(names)
                elif trainable & set(names):
                    raise _Invalid(f"{at}.frozen", f"parameters {sorted(trainable & set(names))} "
                                                   f"are also trainable")


def _check_optimizer(opt: Any) -> None:
    _keys(opt, "optimizer", ("class", "param_groups"))
    _text(opt["class"], "optimizer.class")
    for i, group in enumerate(_array(opt["param_groups"], "optimizer.param_groups", 1)):
        at = f"optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise _Invalid(at, f"expected an object, got {_show(group)}")
        if "params" in group:
            raise _Invalid(f"{at}.params", "unknown field (zerocore does not write it)")
        for key in ("lr", "eps", "weight_decay"):  # what the loaded optimizer computes with
            if key in group:
                _number(group[key], f"{at}.{key}")
        if "betas" in group:
            betas = _array(group["betas"], f"{at}.betas", 2)
            if len(betas) != 2:
                raise _Invalid(f"{at}.betas", f"expected [beta1, beta2], got {_show(betas)}")
        _finite_everywhere(group, at)


def _check_loss_scaler(state: Any) -> None:
    """What ``LossScaler.load_state_dict`` reads, checked before any shard is modified."""
    if state is None:
        return
    _keys(state, "loss_scaler", ("loss_scale", "hysteresis_left", "good_steps", "dynamic"))
    if _number(state["loss_scale"], "loss_scaler.loss_scale") <= 0:
        raise _Invalid("loss_scaler.loss_scale", f"expected > 0, got {_show(state['loss_scale'])}")
    _int(state["hysteresis_left"], "loss_scaler.hysteresis_left", 0)
    _int(state["good_steps"], "loss_scaler.good_steps", 0)
    _boolean(state["dynamic"], "loss_scaler.dynamic")


def _check_files(files: Any, world_size: int) -> None:
    names = [rank_file(r) for r in range(world_size)]
    if not isinstance(files, dict):
        raise _Invalid("files", f"expected an object, got {_show(files)}")
    for name in names:
        if name not in files:
            raise _Invalid("files", f"no entry for {name} (world_size is {world_size})")
    for name in files:
        if name not in names:
            raise _Invalid(f"files.{name}", f"unexpected entry (world_size is {world_size}, "
                                            f"files are {names[0]} .. {names[-1]})")
        at = f"files.{name}"
        _keys(files[name], at, ("sha256", "bytes"))
        if not _HEX64.match(_text(files[name]["sha256"], f"{at}.sha256")):
            raise _Invalid(f"{at}.sha256", f"not a SHA-256 hex digest: "
                                           f"{_show(files[name]['sha256'])}")
        _int(files[name]["bytes"], f"{at}.bytes", 0)


def check_manifest(manifest: Any, where: str | Path) -> dict[str, Any]:
    """Checks every field of a parsed manifest (see the module docstring); returns it. Raises
    ``CheckpointError`` naming ``where`` (the manifest file) and the first bad field."""
    try:
        _keys(manifest, "", ("format",), _REQUIRED[FORMAT] + ("run_id",))
        fmt = manifest["format"]
        if fmt not in _OPTIONAL:
            raise _Invalid("format", f"{_show(fmt)} is not a format this zerocore reads "
                                     f"({FORMAT_V1!r}, {FORMAT_V2!r}, {FORMAT!r})")
        _keys(manifest, "", _REQUIRED[fmt], _OPTIONAL[fmt])
        _int(manifest["step"], "step", 0)
        world_size = _int(manifest["world_size"], "world_size", 1)
        for key in ("param_dtype", "reduce_dtype"):
            if manifest[key] not in DTYPE_NAMES:
                raise _Invalid(key, f"expected one of {', '.join(DTYPE_NAMES)}, got "
                                    f"{_show(manifest[key])}")
        _boolean(manifest["include_frozen"], "include_frozen")
        _check_layers(manifest["layers"], world_size)
        fingerprint = _text(manifest["model_fingerprint"], "model_fingerprint")
        if fingerprint != model_fingerprint(manifest["layers"]):
            raise _Invalid("model_fingerprint", "differs from the fingerprint of the layers' "
                                                "names and shapes")
        _check_optimizer(manifest["optimizer"])
        _check_loss_scaler(manifest["loss_scaler"])
        if not isinstance(manifest["extra"], dict):
            raise _Invalid("extra", f"expected an object, got {_show(manifest['extra'])}")
        _check_files(manifest["files"], world_size)
        if "run_id" in manifest:
            _text(manifest["run_id"], "run_id")
        if "save_id" in manifest and not _SAVE_ID.match(_text(manifest["save_id"], "save_id")):
            raise _Invalid("save_id", f"expected 32 hex digits, got {_show(manifest['save_id'])}")
    except _Invalid as e:
        raise CheckpointError(f"{where}: {e.field}: {e.problem}; {_EDITED}") from None
    return manifest
