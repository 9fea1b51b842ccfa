"""Reading a sharded checkpoint: verifying its rank files and reading byte ranges of the flat
groups out of them, for a load at any world size and for consolidation.

``open_checkpoint(path)`` does everything a reader needs before trusting a checkpoint: the
manifest and its COMMIT record (``read_manifest``), the size and SHA-256 of every rank file
(``verify_files``; a rank file that is a symbolic link is refused: it may point out of the
checkpoint), each rank file's identity against the manifest (``check_identity``: the save id,
rank, world size, step, run id, layout digest and manifest digest it recorded when it was
written, so a file of another rank, run or save, or a manifest edited with its checksums
recomputed, is refused), and its contents against the manifest's layouts (layers present;
masters and Adam moments 1-D fp32 of padded_numel / world_size elements; frozen shards likewise,
in param_dtype, when the checkpoint holds them; an RNG state). The identity is checked before
any tensor of the file is used. It returns a ``ShardReader``; every failure is one
``CheckpointError`` naming the file (and the layer or the field). Rank files are memory-mapped:
checking them reads their headers, not their data.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Iterator

import torch

from zerocore.checkpoint.errors import CheckpointError, weights_only_failure
from zerocore.checkpoint.manifest import (FORMAT, MANIFEST, UNVERIFIED_FORMATS, check_manifest,
                                          layout_digest, manifest_digest, rank_file,
                                          read_manifest)
from zerocore.engine.flat_layout import FlatLayout

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Which flat group each tensor of a rank file's layer entry belongs to.
GROUP_OF = {"master": "trainable", "exp_avg": "trainable", "exp_avg_sq": "trainable",
            "frozen": "frozen"}
# The key of a rank file (format 3) that records whose it is (``identity_record``).
IDENTITY = "identity"
_IDENTITY_FIELDS = ("format", "save_id", "rank", "world_size", "step", "run_id", "layout_sha256",
                    "manifest_sha256")


def identity_record(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """What rank ``rank``'s file of the save that ``manifest`` describes records about itself
    (``manifest`` without its ``files`` table suffices: the save writes it before them)."""
    return {"format": manifest["format"], "save_id": manifest["save_id"], "rank": rank,
            "world_size": manifest["world_size"], "step": manifest["step"],
            "run_id": manifest.get("run_id"), "layout_sha256": layout_digest(manifest["layers"]),
            "manifest_sha256": manifest_digest(manifest)}


def _own_file(f: Path, world_size: int) -> None:
    """A rank file that is there and is a regular file of the checkpoint, not a link."""
    if f.is_symlink():
        try:
            target = f"to {f.readlink()}"
        except OSError:
            target = "unreadable"
        raise CheckpointError(f"{f}: a symbolic link ({target}), not a rank file of this "
                              f"checkpoint; zerocore writes rank files, never links: copy the "
                              f"checkpoint's own files")
    if not f.is_file():
        raise CheckpointError(f"{f}: rank file missing (the checkpoint was written by "
                              f"{world_size} ranks)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_files(path: str | Path, manifest: dict[str, Any], ranks: list[int] | None = None
                 ) -> None:
    """Checks presence, size and SHA-256 of the rank files (all, or the listed ranks) against a
    manifest that ``read_manifest`` returned."""
    for r in ranks if ranks is not None else range(manifest["world_size"]):
        name = rank_file(r)
        f = Path(path) / name
        want = manifest["files"][name]
        _own_file(f, manifest["world_size"])
        try:
            size = f.stat().st_size
            digest = _sha256(f) if size == want["bytes"] else None
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read ({e})") from None
        if size != want["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes, the manifest says {want['bytes']}: the "
                                  f"file is truncated or was replaced")
        if digest != want["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch: the file is corrupt")


def _expect_tensor(t: Any, dtype: torch.dtype, numel: int | None, where: str) -> None:
    """A 1-D tensor of ``dtype`` with ``numel`` elements (any number when None)."""
    if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != dtype
            or (numel is not None and t.numel() != numel)):
        found = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                 else type(t).__name__)
        size = "" if numel is None else f" of {numel} elements"
        raise CheckpointError(f"{where} is {found}, expected 1-D {dtype}{size}; the rank file "
                              f"does not match its manifest")


def check_identity(data: dict[str, Any], manifest: dict[str, Any], file: Path, rank: int
                   ) -> None:
    """Checks what rank file ``file`` (of rank ``rank``) records about itself against its
    (checked) manifest; raises CheckpointError naming the file and what differs."""
    fmt = manifest["format"]
    if fmt in UNVERIFIED_FORMATS:
        if IDENTITY in data:  # only a format-3 save writes one: its manifest was downgraded
            raise CheckpointError(f"{file}: records the save it belongs to (format {FORMAT!r}), "
                                  f"but the manifest is of {fmt!r}: the manifest was edited "
                                  f"after the save; use another checkpoint")
        return
    got = data.get(IDENTITY)
    if not isinstance(got, dict) or set(got) != set(_IDENTITY_FIELDS):
        raise CheckpointError(f"{file}: records no valid identity (which save, rank and step it "
                              f"is of), which every rank file of a {fmt!r} checkpoint does: it "
                              f"is not this checkpoint's file; use the checkpoint's own files")
    want = identity_record(manifest, rank)
    # In the order that names the likeliest cause first: a file of another save (another run,
    # another step of this run), a file of another rank, then what the manifest says.
    if got["save_id"] != want["save_id"]:
        raise CheckpointError(f"{file}: belongs to another save (save id {got['save_id']!s:.12}"
                              f"..., step {got['step']}, run {got['run_id']!r}; the manifest's "
                              f"is {want['save_id'][:12]}...): a rank file of another run or "
                              f"checkpoint was copied in; use the checkpoint's own files")
    if (got["rank"], got["world_size"]) != (rank, want["world_size"]):
        raise CheckpointError(f"{file}: is rank {got['rank']}'s file of {got['world_size']}, "
                              f"not rank {rank}'s of {want['world_size']}: rank files were "
                              f"swapped or renamed; use the checkpoint's own files")
    for key, what in (("step", "step"), ("run_id", "run id"), ("format", "format"),
                      ("layout_sha256", "layouts (their digest)"),
                      ("manifest_sha256", "manifest content (its digest)")):
        if got[key] != want[key]:
            shown = (lambda v: f"{v[:12]}..." if key.endswith("sha256") and isinstance(v, str)
                     else repr(v))
            raise CheckpointError(f"{file}: was saved with {what} {shown(got[key])}, but the "
                                  f"manifest says {shown(want[key])}: the manifest was edited "
                                  f"after the save; use another checkpoint")


def check_rank_data(data: Any, manifest: dict[str, Any], file: Path, rank: int) -> None:
    """Checks an unpickled rank file (of rank ``rank``) against its (checked) manifest: its
    identity first, then its contents; raises CheckpointError naming the file and the layer."""
    world = manifest["world_size"]
    keys_wanted = {"layers", "rng"} | ({IDENTITY} if manifest["format"] == FORMAT else set())
    if isinstance(data, dict):
        check_identity(data, manifest, file, rank)
    if not isinstance(data, dict) or set(data) != keys_wanted:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{file}: holds {keys}, expected {sorted(keys_wanted)}: not a "
                              f"zerocore rank file")
    layers = data["layers"]
    n_layers = len(manifest["layers"])
    if not isinstance(layers, dict) or set(layers) != set(range(n_layers)):
        found = sorted(layers) if isinstance(layers, dict) else type(layers).__name__
        raise CheckpointError(f"{file}: holds layers {found}, the manifest has {n_layers} "
                              f"(0 .. {n_layers - 1})")
    frozen_dtype = DTYPES[manifest["param_dtype"]]
    for i, saved in enumerate(manifest["layers"]):
        entry = layers[i]
        want: dict[str, tuple[torch.dtype, int]] = {}
        if saved["trainable"] is not None:
            n = saved["trainable"]["padded_numel"] // world
            want.update(master=(torch.float32, n), exp_avg=(torch.float32, n),
                        exp_avg_sq=(torch.float32, n))
        if manifest["include_frozen"] and saved["frozen"] is not None:
            want["frozen"] = (frozen_dtype, saved["frozen"]["padded_numel"] // world)
        keys = set(want) | ({"step"} if saved["trainable"] is not None else set())
        if not isinstance(entry, dict) or set(entry) != keys:
            found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise CheckpointError(f"{file}: layer {i} holds {found}, the manifest's layout "
                                  f"needs {sorted(keys)}")
        for key, (dtype, numel) in want.items():
            _expect_tensor(entry[key], dtype, numel, f"{file}: layer {i}: {key!r}")
        if "step" in keys and (type(entry["step"]) not in (int, float)
                               or not math.isfinite(entry["step"]) or entry["step"] < 0):
            raise CheckpointError(f"{file}: layer {i}: optimizer step {entry['step']!r} is not "
                                  f"a finite count")
    rng = data["rng"]
    if not isinstance(rng, dict) or "torch" not in rng or not set(rng) <= {"torch", "cuda"}:
        raise CheckpointError(f"{file}: no RNG state (expected 'torch' and optionally 'cuda')")
    _expect_tensor(rng["torch"], torch.uint8, torch.get_rng_state().numel(),
                   f"{file}: RNG state 'torch'")
    if "cuda" in rng:  # its size is the CUDA generator's, unknown without a GPU
        _expect_tensor(rng["cuda"], torch.uint8, None, f"{file}: RNG state 'cuda'")


class ShardReader:
    """Ranges of the unsharded flat groups of a checkpoint, read out of its rank files
    (memory-mapped, so only the needed bytes are read). Use ``open_checkpoint`` to get one whose
    files are verified; ``manifest`` is the checkpoint's, checked."""

    def __init__(self, path: str | Path, manifest: dict[str, Any]):
        self.path, self.manifest = Path(path), manifest
        self.world_size: int = manifest["world_size"]
        self._files: dict[int, dict[str, Any]] = {}

    def rank_data(self, r: int) -> dict[str, Any]:
        """Rank r's file, unpickled (tensors memory-mapped) and checked against the manifest."""
        if r not in self._files:
            f = self.path / rank_file(r)
            _own_file(f, self.world_size)  # also for callers that verified the files earlier
            try:
                data = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001  (unpickling raises many kinds)
                raise CheckpointError(f"{f}: cannot be read as a rank file "
                                      f"({weights_only_failure(e)}); the checkpoint is damaged "
                                      f"or was changed — use another one") from None
            check_rank_data(data, self.manifest, f, r)
            self._files[r] = data
        return self._files[r]

    def check_all(self) -> None:
        """Unpickles and checks every rank file (headers only)."""
        for r in range(self.world_size):
            self.rank_data(r)

    def layout(self, layer: int, key: str) -> FlatLayout:
        """The saved layout of the group that ``key`` (master, exp_avg, exp_avg_sq, frozen) of
        ``layer`` belongs to."""
        return FlatLayout.from_dict(self.manifest["layers"][layer][GROUP_OF[key]])

    def read_as(self, layer: int, key: str, layout: FlatLayout, lo: int, hi: int
                ) -> torch.Tensor:
        """Elements [lo, hi) of ``key``'s flat vector laid out as ``layout`` (the same
        parameters, possibly at other offsets: an int8 frozen group puts each on a block
        boundary), as fp32; padding is zeros."""
        saved = {s.name: s.offset for s in self.layout(layer, key).slots}
        out = torch.zeros(hi - lo)
        for s in layout.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                at = saved[s.name] - s.offset
                out[a - lo:b - lo] = self.read(layer, key, a + at, b + at)
        return out

    def read(self, layer: int, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the unsharded flat vector stored under ``key``, as fp32;
        elements past the saved padded size (the padding of a larger world size) are zeros."""
        n_old = self.layout(layer, key).shard_numel
        parts = []
        pos = lo
        while pos < hi:
            r = pos // n_old if n_old else self.world_size
            if r >= self.world_size:
                parts.append(torch.zeros(hi - pos))
                break
            end = min(hi, (r + 1) * n_old)
            t = self.rank_data(r)["layers"][layer][key]
            parts.append(t[pos - r * n_old:end - r * n_old].float())
            pos = end
        return torch.cat(parts) if parts else torch.zeros(0)

    def full_layers(self, *, trainable_only: bool, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(layer index, {parameter name: full tensor}) for each layer. Trainable parameters
        come from the fp32 masters; ``dtype`` casts them (default fp32), and the frozen ones
        (default: the training dtype they were saved in)."""
        manifest = self.manifest
        frozen_dtype = DTYPES[manifest["param_dtype"]]
        for index, saved in enumerate(manifest["layers"]):
            out: dict[str, torch.Tensor] = {}
            kinds = [("trainable", "master", dtype or torch.float32)]
            if not trainable_only:
                if saved["frozen"] is not None and not manifest["include_frozen"]:
                    raise CheckpointError(
                        f"{self.path}: the checkpoint holds no frozen weights (they are the base "
                        f"model's); use --trainable-only, or export through the application "
                        f"with the base model")
                kinds.append(("frozen", "frozen", dtype or frozen_dtype))
            for group, key, out_dtype in kinds:
                if saved[group] is None:
                    continue
                layout = self.layout(index, key)
                flat = self.read(index, key, 0, layout.padded_numel)
                for s in layout.slots:
                    out[s.name] = (flat[s.offset:s.offset + s.numel].view(s.shape)
                                   .to(out_dtype).clone())
            yield index, out


def open_checkpoint(path: str | Path, *, allow_unverified: bool = False) -> ShardReader:
    """Opens and fully verifies a checkpoint directory: manifest and COMMIT record, every rank
    file's size, SHA-256, identity and contents. Raises ``CheckpointError``; returns a
    ``ShardReader`` (``reader.manifest`` is the checked manifest). ``allow_unverified``: read a
    checkpoint of a format older than rank-file identities (``read_manifest``)."""
    manifest = read_manifest(path, allow_unverified=allow_unverified)
    verify_files(path, manifest)
    reader = ShardReader(path, manifest)
    reader.check_all()
    return reader


def iter_full_layers(ckpt: str | Path, *, trainable_only: bool, dtype: torch.dtype | None = None,
                     manifest: dict[str, Any] | None = None, allow_unverified: bool = False
                     ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """``ShardReader.full_layers`` of a checkpoint directory, everything verified first
    (``open_checkpoint``). A caller that passes ``manifest`` has verified the files' checksums
    itself; its fields and the files' identities and contents are checked here all the same."""
    ckpt = Path(ckpt)
    if manifest is None:
        reader = open_checkpoint(ckpt, allow_unverified=allow_unverified)
    else:
        manifest = check_manifest(manifest, ckpt / MANIFEST)
        if manifest["format"] in UNVERIFIED_FORMATS and not allow_unverified:
            read_manifest(ckpt, allow_unverified=False)  # refuses it, in the same words
        reader = ShardReader(ckpt, manifest)
        reader.check_all()
    yield from reader.full_layers(trainable_only=trainable_only, dtype=dtype)
