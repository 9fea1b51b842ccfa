"""Checkpoints that cannot be loaded wrong: the COMMIT record, the manifest's schema, the rank
files' contents, incomplete step directories, and write errors during a save.

- Every edit of ``manifest.json`` is refused twice over: as it is (its COMMIT record no longer
  matches) and with the COMMIT record recomputed after the edit, as an attacker or a careless
  script would (the schema check must find it). Each refusal is one ``CheckpointError`` line
  naming the file and the field, from ``read_manifest``, ``iter_full_layers`` (what neox.export
  uses), ``python -m zerocore.consolidate`` (exit 2, one ``error:`` line, nothing written) and
  ``load_checkpoint`` on every rank at world sizes 2 and 3 (the same message everywhere, the
  model untouched).
- Rank files whose SHA-256 and size match the manifest but whose contents do not (not a
  pickle, a tensor of the wrong size or dtype, a layer or the RNG state missing) are refused
  naming the file and the layer.
- Every rank file records whose it is; with every checksum recomputed, a downgrade to format 1
  or 2, swapped rank files, a rank file of another run (or of another save without any run id),
  an edited step or extra state and a rank file that is a symlink out of the checkpoint are all
  refused in one line, by every reader. Formats 1 (the recorded fixture) and 2 load only with
  ``allow_unverified``, with the same field checks.
- Incomplete step directories are never loaded, are reported, and are removed by the next save
  only when they hold nothing but files zerocore writes.
- Write errors (ENOSPC, EIO) injected into each step of a save on some ranks of a 2-rank group,
  and a real full tmpfs: one ``CheckpointWriteError`` line naming the path and the errno on
  every rank, no temporary directory left, the previous checkpoint still loads.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from zerocore.checkpoint import durable_io
from zerocore.checkpoint import (COMMIT, FORMAT, MANIFEST, CheckpointError, CheckpointWriteError,
                                 incomplete_checkpoints, iter_full_layers, latest_checkpoint,
                                 list_checkpoints, open_checkpoint, read_manifest)
from zerocore.consolidate import main as consolidate_main

REPO = Path(__file__).resolve().parents[2]
FIXTURE_V1 = REPO / "tests" / "fixtures" / "recipe_v0_lora"
FORMAT_V1, FORMAT_V2 = "zerocore-checkpoint/1", "zerocore-checkpoint/2"

D_IN, HIDDEN, D_OUT = 13, 31, 7   # odd sizes: padding inside and at the end of every group
LR = 1e-2


# -- the model, on every rank ------------------------------------------------------------------


def make_layers(seed: int) -> list[nn.Module]:
    """Trainable (two slots: weight and bias), frozen-weight/trainable-bias, fully frozen and
    trainable layers; ``seed`` draws the weights."""
    torch.manual_seed(seed)
    bias_only = nn.Linear(HIDDEN, HIDDEN)
    bias_only.weight.requires_grad_(False)
    frozen = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
    frozen.requires_grad_(False)
    return [nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU()), nn.Sequential(bias_only, nn.GELU()),
            frozen, nn.Linear(HIDDEN, D_OUT)]


def build(seed: int = 0):
    model = zerocore.shard(make_layers(seed))
    optimizer = zerocore.optim.AdamW(model.trainable_shards(), lr=LR, weight_decay=0.1)
    scaler = zerocore.LossScaler(model.group, dynamic=False)
    return model, optimizer, scaler


def full_states(model: zerocore.ShardedSequential) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": t for i, state in model.iter_full_states() for name, t in state.items()}


def save_trained(rank: int, world_size: int, root: str, steps: list[int],
                 run_id: str | None = None, keep_last: int = 3) -> dict[str, torch.Tensor]:
    """Two training steps, then a checkpoint (frozen shards included) at each of ``steps``;
    returns the full parameters that were saved."""
    model, optimizer, scaler = build()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, D_IN, generator=g)
        F.mse_loss(model(x), torch.zeros(4, D_OUT)).backward()
        scaler.step(optimizer)
        optimizer.zero_grad()
    for step in steps:
        zerocore.save_checkpoint(root, step, model, optimizer, scaler=scaler,
                                 extra={"step": step}, include_frozen=True, run_id=run_id,
                                 keep_last=keep_last)
    return full_states(model)


def _snapshot(model, optimizer, scaler) -> list[Any]:
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [v.clone() for st in optimizer.state.values() for v in st.values()]
    return [tensors, torch.get_rng_state(), scaler.state_dict(),
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]]


def _same(a: list[Any], b: list[Any]) -> bool:
    return (len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
            and torch.equal(a[1], b[1]) and a[2:] == b[2:])


def try_loads(rank: int, world_size: int, paths: list[str], allow_unverified: bool = False
              ) -> list[dict[str, Any]]:
    """Loads each path into a fresh model whose every value differs from the checkpoint's;
    for each, the error message (None if it loaded), whether a failed load left everything as
    it was, and the full parameters after a successful one."""
    out = []
    for path in paths:
        model, optimizer, scaler = build(seed=5)
        torch.manual_seed(7)
        before = _snapshot(model, optimizer, scaler)
        try:
            extra = zerocore.load_checkpoint(path, model, optimizer, scaler=scaler,
                                             allow_unverified=allow_unverified)
        except CheckpointError as e:
            out.append({"message": str(e), "type": type(e).__name__,
                        "unchanged": _same(before, _snapshot(model, optimizer, scaler))})
            continue
        out.append({"message": None, "extra": extra, "full": full_states(model)})
    return out


# -- editing a checkpoint as a user or a script would --------------------------------------------


def recommit(path: Path) -> None:
    """Rewrites COMMIT for the manifest as it now is (written here, not by zerocore, as an
    attacker would)."""
    raw = (path / MANIFEST).read_bytes()
    fmt = json.loads(raw).get("format")
    (path / COMMIT).write_text(json.dumps({"format": fmt if fmt == FORMAT_V2 else FORMAT,
                                           "manifest_sha256": hashlib.sha256(raw).hexdigest(),
                                           "manifest_bytes": len(raw)}))


def edit_manifest(path: Path, edit: Callable[[dict[str, Any]], Any], *, commit: bool) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if commit:
        recommit(path)


def _set(*keys_and_value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets manifest[k1][k2]... = value."""
    *keys, value = keys_and_value

    def edit(m: dict[str, Any]) -> None:
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value
    return edit


def _swap_offsets(m: dict[str, Any]) -> None:
    slots = m["layers"][0]["trainable"]["slots"]
    slots[0][2], slots[1][2] = slots[1][2], slots[0][2]


def _move_offset(m: dict[str, Any]) -> None:
    m["layers"][0]["trainable"]["slots"][1][2] += 16


def _grow_padding(m: dict[str, Any]) -> None:
    m["layers"][0]["trainable"]["padded_numel"] += 32


def _resize_slot(m: dict[str, Any]) -> None:
    m["layers"][3]["trainable"]["slots"][1][1] = [D_OUT + 1]


def _extra_file(m: dict[str, Any]) -> None:
    m["files"]["rank-00002.pt"] = m["files"]["rank-00000.pt"]


# name: (edit, what the message must name after the field's path)
EDITS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "world_size-2-to-1": (_set("world_size", 1),
                          "layers[0].trainable.world_size: 2, but the manifest's world_size is 1"),
    "world_size-0": (_set("world_size", 0), "world_size: expected an integer >= 1, got 0"),
    "world_size-negative": (_set("world_size", -1), "world_size: expected an integer >= 1"),
    "world_size-3": (_set("world_size", 3), "layers[0].trainable.world_size: 2"),
    "world_size-true": (_set("world_size", True),
                        "world_size: expected an integer >= 1, got true"),
    "world_size-string": (_set("world_size", "2"),
                          'world_size: expected an integer >= 1, got "2"'),
    "step-string": (_set("step", "4"), 'step: expected an integer >= 0, got "4"'),
    "step-float": (_set("step", 4.0), "step: expected an integer >= 0, got 4.0"),
    "layers-missing": (lambda m: m.pop("layers"), "layers: missing"),
    "layers-empty": (_set("layers", []), "layers: expected a list of at least 1"),
    "group-not-object": (_set("layers", 0, "trainable", 5),
                         "layers[0].trainable: expected an object"),
    "padded_numel-changed": (_grow_padding, "layers[0].trainable.padded_numel: "),
    "padded_numel-string": (_set("layers", 2, "frozen", "padded_numel", "1024"),
                            "layers[2].frozen.padded_numel: expected an integer"),
    "offset-moved": (_move_offset, "layers[0].trainable.slots[1].offset: "),
    "offsets-swapped": (_swap_offsets, "layers[0].trainable.slots[0].offset: "),
    "offset-string": (_set("layers", 0, "trainable", "slots", 1, 2, "416"),
                      "layers[0].trainable.slots[1].offset: expected an integer"),
    "slot-resized": (_resize_slot, "model_fingerprint: differs"),
    "slot-name-twice": (_set("layers", 0, "trainable", "slots", 1, 0, "0.weight"),
                        "layers[0].trainable.slots[1].name: '0.weight' appears twice"),
    "frozen-name-also-trainable": (_set("layers", 1, "frozen", "slots", 0, 0, "0.bias"),
                                   "layers[1].frozen: parameters ['0.bias'] are also trainable"),
    "layout-world_size": (_set("layers", 1, "frozen", "world_size", 1),
                          "layers[1].frozen.world_size: 1, but the manifest's world_size is 2"),
    "fingerprint-changed": (_set("model_fingerprint", "0" * 64), "model_fingerprint: differs"),
    "param_dtype-unknown": (_set("param_dtype", "float64"), "param_dtype: expected one of"),
    "include_frozen-string": (_set("include_frozen", "yes"),
                              "include_frozen: expected true or false"),
    "lr-nan": (_set("optimizer", "param_groups", 0, "lr", math.nan),
               "optimizer.param_groups[0].lr: expected a finite number, got NaN"),
    "lr-string": (_set("optimizer", "param_groups", 0, "lr", "0.01"),
                  "optimizer.param_groups[0].lr: expected a finite number"),
    "betas-short": (_set("optimizer", "param_groups", 0, "betas", [0.9]),
                    "optimizer.param_groups[0].betas: expected a list of at least 2"),
    "param_groups-empty": (_set("optimizer", "param_groups", []),
                           "optimizer.param_groups: expected a list of at least 1"),
    "loss_scaler-list": (_set("loss_scaler", []), "loss_scaler: expected an object"),
    "loss_scale-string": (_set("loss_scaler", "loss_scale", "1.0"),
                          "loss_scaler.loss_scale: expected a finite number"),
    "extra-list": (_set("extra", []), "extra: expected an object"),
    "files-missing-rank": (lambda m: m["files"].pop("rank-00001.pt"),
                           "files: no entry for rank-00001.pt (world_size is 2)"),
    "files-extra-rank": (_extra_file, "files.rank-00002.pt: unexpected entry"),
    "sha256-not-hex": (_set("files", "rank-00000.pt", "sha256", "xyz"),
                       "files.rank-00000.pt.sha256: not a SHA-256"),
    "bytes-string": (_set("files", "rank-00001.pt", "bytes", "100"),
                     "files.rank-00001.pt.bytes: expected an integer"),
    "run_id-number": (_set("run_id", 5), "run_id: expected a string"),
    "unknown-field": (_set("surprise", 1), "surprise: unknown field"),
    "format-unknown": (_set("format", "zerocore-checkpoint/9"), "format: "),
}


def _rank_data_edit(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def edit(f: Path) -> None:
        data = torch.load(f, weights_only=True)
        fn(data)
        torch.save(data, f)
    return edit


def _write_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda f: f.write_bytes(data)


def _unsafe_pickle(f: Path) -> None:
    data = torch.load(f, weights_only=True)
    data["rng"]["when"] = datetime.date(2026, 1, 1)  # a class weights_only refuses to load
    torch.save(data, f)


# name: (rank, edit of the file, what the message must name after the file's path)
RANK_EDITS: dict[str, tuple[int, Callable[[Path], None], str]] = {
    "not-a-pickle": (1, _write_bytes(b"not a rank file"), "cannot be read as a rank file"),
    "unsafe-pickle": (0, _unsafe_pickle, "cannot be read as a rank file"),
    "master-short": (0, _rank_data_edit(lambda d: d["layers"][0].update(
        master=d["layers"][0]["master"][:-1])), "layer 0: 'master' is torch.float32 of shape"),
    "exp_avg-fp16": (1, _rank_data_edit(lambda d: d["layers"][3].update(
        exp_avg=d["layers"][3]["exp_avg"].half())), "layer 3: 'exp_avg' is torch.float16"),
    "master-2d": (0, _rank_data_edit(lambda d: d["layers"][1].update(
        master=d["layers"][1]["master"].view(1, -1))), "layer 1: 'master' is"),
    "frozen-fp64": (1, _rank_data_edit(lambda d: d["layers"][2].update(
        frozen=d["layers"][2]["frozen"].double())), "layer 2: 'frozen' is torch.float64"),
    "layer-missing": (0, _rank_data_edit(lambda d: d["layers"].pop(3)),
                      "holds layers [0, 1, 2], the manifest has 4"),
    "moment-missing": (1, _rank_data_edit(lambda d: d["layers"][0].pop("exp_avg_sq")),
                       "layer 0 holds ['exp_avg', 'master', 'step']"),
    "rng-missing": (0, _rank_data_edit(lambda d: d.pop("rng")), "holds ['identity', 'layers']"),
    "step-nan": (1, _rank_data_edit(lambda d: d["layers"][0].update(step=math.nan)),
                 "layer 0: optimizer step nan"),
}


def edit_rank_file(path: Path, rank: int, edit: Callable[[Path], None]) -> Path:
    """Edits a rank file, then makes the manifest and COMMIT agree with it (size, SHA-256)."""
    f = path / f"rank-{rank:05d}.pt"
    edit(f)
    data = f.read_bytes()
    edit_manifest(path, _set("files", f.name, {"sha256": hashlib.sha256(data).hexdigest(),
                                               "bytes": len(data)}), commit=True)
    return f


@pytest.fixture(scope="module")
def good(worlds, tmp_path_factory) -> dict[str, Any]:
    """A checkpoint saved by 2 ranks (frozen shards included), and what it holds."""
    root = tmp_path_factory.mktemp("good")
    saved = worlds(2).run(save_trained, str(root), [4], "run-a")[0]
    return {"path": latest_checkpoint(root), "full": saved}


def _copy(good: dict[str, Any], where: Path) -> Path:
    return Path(shutil.copytree(good["path"], where / good["path"].name))


def _assert_one_line(message: str, *parts: str) -> None:
    assert "\n" not in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def _consolidate_in_process(path: Path, out: Path, capsys) -> str:
    """``python -m zerocore.consolidate PATH OUT --trainable-only``'s code, in this process: it
    must refuse with exit code 2 and one ``error:`` line, writing nothing."""
    capsys.readouterr()
    code = consolidate_main([str(path), str(out), "--trainable-only"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists() and not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    return err[len("error: "):].strip()


# -- the manifest ------------------------------------------------------------------------------


@pytest.mark.parametrize("commit", [False, True], ids=["commit-left", "commit-recomputed"])
@pytest.mark.parametrize("case", list(EDITS))
def test_edited_manifest_is_refused(good, tmp_path, capsys, case, commit):
    """Read without ranks: read_manifest, iter_full_layers (neox.export) and the consolidate
    command all refuse, naming the manifest and (once COMMIT is recomputed) the field."""
    path = _copy(good, tmp_path)
    edit, field = EDITS[case]
    edit_manifest(path, edit, commit=commit)
    mf = str(path / MANIFEST)
    # Left as it was, COMMIT no longer matches: that is found first. Recomputed, the field is.
    expected = [mf, field] if commit else [mf, "COMMIT record"]
    with pytest.raises(CheckpointError) as e:
        read_manifest(path)
    _assert_one_line(str(e.value), *expected)
    with pytest.raises(CheckpointError) as again:
        next(iter_full_layers(path, trainable_only=True))
    assert str(again.value) == str(e.value)
    assert _consolidate_in_process(path, tmp_path / "out", capsys) == str(e.value)


@pytest.mark.parametrize("case", list(RANK_EDITS))
def test_rank_file_that_does_not_match_its_manifest_is_refused(good, tmp_path, capsys, case):
    """SHA-256 and size agree with the manifest (recomputed), the contents do not."""
    path = _copy(good, tmp_path)
    rank, edit, problem = RANK_EDITS[case]
    f = edit_rank_file(path, rank, edit)
    read_manifest(path)  # the manifest itself is consistent
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    _assert_one_line(str(e.value), f"{f}: ", problem)
    with pytest.raises(CheckpointError) as again:
        next(iter_full_layers(path, trainable_only=True))
    assert str(again.value) == str(e.value)
    assert _consolidate_in_process(path, tmp_path / "out", capsys) == str(e.value)


class _Payload:
    """A pickled object whose loading would run a command (create a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_payload_rank_file_is_refused_without_torchs_advice(good, tmp_path, capsys):
    """A rank file carrying a payload, its checksum recomputed: refused in one line that names
    what it would have run, without torch's advice to load it with weights_only=False (what
    must not be done with such a file); nothing ran."""
    path = _copy(good, tmp_path)
    marker = tmp_path / "it-ran"
    f = edit_rank_file(path, 1, _rank_data_edit(lambda d: d.update(x=_Payload(marker))))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    message = str(e.value)
    _assert_one_line(message, f"{f}: cannot be read as a rank file (refused: it holds pickled "
                              f"objects that loading would have to import and run")
    assert "posix.system" in message and "nothing in it was run" in message
    assert "weights_only" not in message and "likely succeed" not in message, message
    assert _consolidate_in_process(path, tmp_path / "out", capsys) == message
    assert not marker.exists()


def test_commit_record_itself_damaged_or_missing(good, tmp_path):
    path = _copy(good, tmp_path)
    (path / COMMIT).write_text("{")
    with pytest.raises(CheckpointError, match=re.escape(f"{path / COMMIT}: unreadable COMMIT")):
        read_manifest(path)
    (path / COMMIT).write_text(json.dumps({"format": "zerocore-checkpoint/2",
                                           "manifest_sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=re.escape(f"{path / COMMIT}: manifest_bytes: "
                                                        f"missing")):
        read_manifest(path)
    (path / COMMIT).unlink()
    with pytest.raises(CheckpointError, match="no COMMIT record; the checkpoint is incomplete"):
        read_manifest(path)
    # Without its COMMIT a format-2 checkpoint is incomplete: not listed, but reported.
    assert list_checkpoints(tmp_path) == []
    assert incomplete_checkpoints(tmp_path) == [(path, True)]


@pytest.mark.e2e
def test_commandline_consolidate_refuses_with_one_line(good, tmp_path):
    """The real command, for two of the edits above: exit code 2, one line, nothing written."""
    zero = _copy(good, tmp_path / "zero")
    edit_manifest(zero, _set("world_size", 0), commit=True)
    garbage = _copy(good, tmp_path / "garbage")
    f = edit_rank_file(garbage, 1, _write_bytes(b"\x00" * 64))
    for path, text in ((zero, "world_size: expected an integer >= 1, got 0"),
                       (garbage, f"{f}: cannot be read as a rank file")):
        out = path.parent / "out"
        proc = subprocess.run([sys.executable, "-m", "zerocore.consolidate", str(path),
                               str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert text in proc.stderr
        assert not out.exists()


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda n: f"load-at-ws{n}")
def test_every_rank_refuses_the_same_way(worlds, good, tmp_path, world_size):
    """Each edit with COMMIT recomputed, each rank-file edit: every rank raises the same
    CheckpointError and nothing is modified; the good checkpoint loads, values intact."""
    paths, expected = [], []
    for case, (edit, field) in EDITS.items():
        path = _copy(good, tmp_path / f"manifest-{case}")
        edit_manifest(path, edit, commit=True)
        paths.append(str(path))
        expected.append([str(path / MANIFEST), field])
    for case, (rank, edit, problem) in RANK_EDITS.items():
        path = _copy(good, tmp_path / f"rank-{case}")
        f = edit_rank_file(path, rank, edit)
        paths.append(str(path))
        expected.append([f"{f}: ", problem])
    results = worlds(world_size).run(try_loads, paths + [str(good["path"])], timeout=600)
    for i, (path, parts) in enumerate(zip(paths, expected)):
        messages = {res[i]["message"] for res in results}
        assert len(messages) == 1, f"{path}: the ranks disagree: {messages}"
        for r, res in enumerate(results):
            assert res[i]["message"] is not None, f"rank {r} loaded {path}"
            _assert_one_line(res[i]["message"], *parts)
            assert res[i]["type"] == "CheckpointError"
            assert res[i]["unchanged"], f"rank {r}: a refused load modified the model ({path})"
    ok = [res[-1] for res in results]
    assert all(res["message"] is None and res["extra"] == {"step": 4} for res in ok)
    for name, t in good["full"].items():  # bitwise: the loaded values are the saved values
        assert torch.equal(ok[0]["full"][name], t), name


# -- identity: formats that cannot be verified, rank files of another rank, run or save --------
#
# The attacker of these tests fixes every checksum: the manifest's files table and COMMIT are
# recomputed after each edit (``edit_rank_file``, ``recommit``), so only the rank files'
# identities can tell.

UNVERIFIED = "cannot be verified"


def _as_format_1(m: dict[str, Any]) -> None:
    m["format"] = FORMAT_V1
    m.pop("run_id", None)
    m.pop("save_id", None)


def _strip_identity(path: Path, fmt: str) -> None:
    """``path`` as the zerocore before rank-file identities wrote it: format ``fmt`` (1 or 2),
    rank files without identity, checksums (and for format 2 the COMMIT) recomputed."""
    for rank in range(2):
        edit_rank_file(path, rank, _rank_data_edit(lambda d: d.pop("identity")))
    edit_manifest(path, _as_format_1 if fmt == FORMAT_V1 else
                  (lambda m: (m.update(format=FORMAT_V2), m.pop("save_id"))), commit=True)
    if fmt == FORMAT_V1:
        (path / COMMIT).unlink()


def _refusals(path: Path, capsys, **kwargs: Any) -> str:
    """The one-line refusal of ``path`` by open_checkpoint, iter_full_layers and the
    consolidate command, which must be the same; returns it."""
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path, **kwargs)
    _assert_one_line(str(e.value))
    with pytest.raises(CheckpointError) as again:
        next(iter_full_layers(path, trainable_only=True, **kwargs))
    assert str(again.value) == str(e.value)
    capsys.readouterr()
    argv = [str(path), str(path.parent / "out"), "--trainable-only"]
    argv += ["--allow-unverified"] if kwargs.get("allow_unverified") else []
    assert consolidate_main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {e.value}\n" and not (path.parent / "out").exists()
    return str(e.value)


def test_old_formats_load_only_when_asked(worlds, good, tmp_path, capsys):
    """Formats 1 (the recorded fixture) and 2 (before rank-file identities) cannot be verified:
    refused in one line saying how to opt in; with allow_unverified they load, values intact,
    with the same field checks."""
    # The fixture, written before COMMIT records existed, through what neox.export calls.
    manifest = read_manifest(FIXTURE_V1, allow_unverified=True)
    assert manifest["format"] == FORMAT_V1 and not (FIXTURE_V1 / COMMIT).exists()
    with pytest.raises(CheckpointError, match=f"{UNVERIFIED}.*--allow-unverified"):
        read_manifest(FIXTURE_V1)
    layers = dict(iter_full_layers(FIXTURE_V1, trainable_only=True, allow_unverified=True))
    assert len(layers) == len(manifest["layers"])
    assert sum(len(t) for t in layers.values()) > 0
    paths = {}
    for name, fmt in (("v1", FORMAT_V1), ("v2", FORMAT_V2)):
        paths[name] = _copy(good, tmp_path / name)
        _strip_identity(paths[name], fmt)
        refusal = _refusals(paths[name], capsys)
        assert refusal.startswith(f"{paths[name]}: {UNVERIFIED} (format {fmt[-1]}")
        assert "--allow-unverified" in refusal and "allow_unverified=True" in refusal
        capsys.readouterr()
        assert consolidate_main([str(paths[name]), str(tmp_path / f"{name}-out"),
                                 "--trainable-only", "--allow-unverified"]) == 0
        assert "note: " in capsys.readouterr().out
        assert list_checkpoints(tmp_path / name) == [paths[name]]
    # ... and edited: the same field checks; a run id is not a format-1 field.
    edited = _copy(good, tmp_path / "v1-edited")
    _strip_identity(edited, FORMAT_V1)
    edit_manifest(edited, _grow_padding, commit=False)
    with_run = _copy(good, tmp_path / "v1-run")
    _strip_identity(with_run, FORMAT_V1)
    edit_manifest(with_run, lambda m: m.update(run_id="run-a"), commit=False)
    order = [paths["v1"], paths["v2"], edited, with_run, paths["v1"]]
    results = worlds(2).run(try_loads, [str(p) for p in order[:4]], True)
    refused = worlds(2).run(try_loads, [str(order[4])])
    for res, no in zip(results, refused):
        assert res[0]["message"] is None and res[0]["extra"] == {"step": 4}
        assert res[1]["message"] is None and res[1]["extra"] == {"step": 4}
        _assert_one_line(res[2]["message"], str(edited / MANIFEST),
                         "layers[0].trainable.padded_numel: ")
        _assert_one_line(res[3]["message"], str(with_run / MANIFEST), "run_id: unknown field")
        _assert_one_line(no[0]["message"], UNVERIFIED, "allow_unverified=True")
        assert no[0]["unchanged"]
    for name, t in good["full"].items():
        assert torch.equal(results[0][0]["full"][name], t), name
        assert torch.equal(results[0][1]["full"][name], t), name


def _downgrade_v1(path: Path) -> None:
    """The hostile tester's downgrade: format 1, no run id (nor save id), no COMMIT."""
    edit_manifest(path, lambda m: (_as_format_1(m), m["extra"].update(step=2)), commit=False)
    (path / COMMIT).unlink()


def _downgrade_v2(path: Path) -> None:
    edit_manifest(path, lambda m: (m.update(format=FORMAT_V2), m.pop("save_id"),
                                   m["extra"].update(step=2)), commit=True)


def _swap_ranks(path: Path) -> None:
    a, b = path / "rank-00000.pt", path / "rank-00001.pt"
    a.rename(path / "tmp.pt")
    b.rename(a)
    (path / "tmp.pt").rename(b)
    for f in (a, b):
        edit_rank_file(path, int(f.stem[-5:]), lambda _: None)


def _edit_step(path: Path) -> Path:
    edit_manifest(path, _set("step", 6), commit=True)
    return Path(shutil.move(path, path.with_name("step-00000006")))


def _edit_extra(path: Path) -> None:
    edit_manifest(path, _set("extra", "step", 2), commit=True)


def _symlink_out(path: Path) -> None:
    outside = path.parent / "elsewhere.pt"
    shutil.move(path / "rank-00001.pt", outside)
    (path / "rank-00001.pt").symlink_to(outside)


@pytest.fixture(scope="module")
def other_run(worlds, tmp_path_factory) -> dict[str, Path]:
    """Checkpoints of the same shape and step as ``good``: of another run, and two saved
    through the library without any run id (their save ids tell them apart)."""
    out = {}
    for name, run_id in (("run-b", "run-b"), ("no-id-1", None), ("no-id-2", None)):
        root = tmp_path_factory.mktemp(name)
        worlds(2).run(save_trained, str(root), [4], run_id)
        out[name] = latest_checkpoint(root)
    return out


def _foreign(source: Path) -> Callable[[Path], None]:
    return lambda f: shutil.copyfile(source / f.name, f)


def test_unverifiable_and_foreign_rank_files_are_refused(worlds, good, other_run, tmp_path,
                                                         capsys):
    """Each attack with every checksum recomputed: refused in one line naming the rank file and
    what it records, by open_checkpoint, iter_full_layers, the consolidate command and
    load_checkpoint on every rank (nothing modified); --allow-unverified does not let a
    downgraded manifest pass either."""
    cases: dict[str, tuple[Path, list[str]]] = {}

    def case(name: str, attack: Callable[[Path], Any], *parts: str, source: Path | None = None
             ) -> None:
        path = Path(shutil.copytree(source or good["path"],
                                    tmp_path / name / (source or good["path"]).name))
        path = attack(path) or path
        cases[name] = (path, [p.format(path=path) for p in parts])

    case("downgrade-v1", _downgrade_v1, "{path}: " + UNVERIFIED, "--allow-unverified")
    case("downgrade-v2", _downgrade_v2, "{path}: " + UNVERIFIED, "--allow-unverified")
    case("swapped", _swap_ranks, "{path}/rank-00000.pt: is rank 1's file of 2, not rank 0's",
         "swapped")
    case("other-run", lambda p: edit_rank_file(p, 1, _foreign(other_run["run-b"])) and None,
         "{path}/rank-00001.pt: belongs to another save", "run 'run-b'")
    case("no-run-id", lambda p: edit_rank_file(p, 0, _foreign(other_run["no-id-2"])) and None,
         "{path}/rank-00000.pt: belongs to another save", "run None",
         source=other_run["no-id-1"])
    case("step-edited", _edit_step, "{path}/rank-00000.pt: was saved with step 4, but the "
         "manifest says 6")
    case("extra-edited", _edit_extra, "{path}/rank-00000.pt: was saved with manifest content "
         "(its digest)", "edited after the save")
    case("symlink", _symlink_out, "{path}/rank-00001.pt: a symbolic link (to ", "elsewhere.pt")
    for name, (path, parts) in cases.items():
        _assert_one_line(_refusals(path, capsys), *parts)
    for name in ("downgrade-v1", "downgrade-v2"):  # opting in does not let the downgrade pass
        path, _ = cases[name]
        _assert_one_line(_refusals(path, capsys, allow_unverified=True),
                         f"{path}/rank-00000.pt: records the save it belongs to", "edited")
    names = list(cases)
    world = worlds(2)
    for allow in (False, True):
        results = world.run(try_loads, [str(cases[n][0]) for n in names], allow, timeout=600)
        for i, name in enumerate(names):
            messages = {res[i]["message"] for res in results}
            assert len(messages) == 1 and None not in messages, (name, messages)
            for res in results:
                assert res[i]["unchanged"] and res[i]["type"] == "CheckpointError", name
            if not allow or not name.startswith("downgrade"):
                _assert_one_line(results[0][i]["message"], *cases[name][1])
    # Neither checkpoint of the pair saved without a run id was harmed: each loads alone.
    ok = world.run(try_loads, [str(other_run["no-id-1"]), str(other_run["no-id-2"])])
    assert all(r["message"] is None for res in ok for r in res)


def save_with_nan_lr(rank: int, world_size: int, root: str) -> str | None:
    model, optimizer, scaler = build()
    optimizer.param_groups[0]["lr"] = math.nan
    try:
        zerocore.save_checkpoint(root, 1, model, optimizer, scaler=scaler)
    except ValueError as e:
        return str(e)
    return None


def test_save_refuses_what_loading_would_refuse(worlds, tmp_path):
    """A NaN learning rate would make a checkpoint that no load accepts: refused on every rank
    before anything is written."""
    messages = worlds(2).run(save_with_nan_lr, str(tmp_path / "root"))
    assert all(m is not None and "NaN or infinite" in m for m in messages), messages
    assert not (tmp_path / "root").exists()


# -- incomplete step directories -----------------------------------------------------------------


def save_at(rank: int, world_size: int, root: str, step: int) -> str | None:
    """Saves ``step`` of an untrained model; the error message if it was refused."""
    model, optimizer, scaler = build()
    try:
        zerocore.save_checkpoint(root, step, model, optimizer, scaler=scaler)
    except CheckpointError as e:
        return str(e)
    return None


def test_incomplete_step_directories(worlds, good, tmp_path):
    root = tmp_path / "root"
    complete = _copy(good, root)                                 # step 4, run-a
    ours = {}
    ours["rank-files-only"] = root / "step-00000006"             # killed before its manifest
    shutil.copytree(complete, ours["rank-files-only"])
    (ours["rank-files-only"] / MANIFEST).unlink()
    (ours["rank-files-only"] / COMMIT).unlink()
    ours["no-commit"] = root / "step-00000007"                   # format 2 without COMMIT
    shutil.copytree(complete, ours["no-commit"])
    (ours["no-commit"] / COMMIT).unlink()
    ours["empty"] = root / "step-00000008"
    ours["empty"].mkdir()
    ours["for-replacing"] = root / "step-00000002"
    ours["for-replacing"].mkdir()
    (ours["for-replacing"] / "rank-00000.pt").write_bytes(b"half")
    foreign = {}
    foreign["a-note"] = root / "step-00000009"
    foreign["a-note"].mkdir()
    (foreign["a-note"] / "notes.txt").write_text("mine")
    foreign["a-subdirectory"] = root / "step-00000010"
    (foreign["a-subdirectory"] / "rank-00000.pt").mkdir(parents=True)

    report = dict(incomplete_checkpoints(root))
    assert report == {**{p: True for p in ours.values()}, **{p: False for p in foreign.values()}}
    assert list_checkpoints(root) == [complete] and latest_checkpoint(root) == complete
    for path in [*ours.values(), *foreign.values()]:
        with pytest.raises(CheckpointError, match="incomplete"):
            read_manifest(path)

    world = worlds(2)
    # A step directory holding files that are not zerocore's is not replaced.
    refusals = world.run(save_at, str(root), 9)
    assert len(set(refusals)) == 1 and refusals[0] is not None
    _assert_one_line(refusals[0], str(foreign["a-note"]), "files zerocore did not write")
    assert sorted(os.listdir(foreign["a-note"])) == ["notes.txt"]
    # One holding only zerocore's files is a leftover: replaced by a save of its step, and the
    # others removed by the next save; the foreign ones stay, and are still reported.
    assert world.run(save_at, str(root), 2) == [None, None]
    assert sorted(p.name for p in root.iterdir()) == [
        "step-00000002", "step-00000004", "step-00000009", "step-00000010"]
    assert [c.path for c in incomplete_checkpoints(root)] == list(foreign.values())
    assert (foreign["a-note"] / "notes.txt").read_text() == "mine"
    open_checkpoint(root / "step-00000002")


# -- write errors ------------------------------------------------------------------------------


class _DiskFullFile:
    """A file whose writes fail with ``error`` once ``room`` bytes were written, after writing
    what still fits (as a full disk does)."""

    def __init__(self, f: Any, error: OSError, room: int):
        self._f, self._error, self._room = f, error, room

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._room:
            self._f.write(data[:self._room])
            self._room = 0
            raise self._error
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> "_DiskFullFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def inject(op: str, pattern: str, code: int) -> contextlib.AbstractContextManager:
    """Makes one kind of filesystem operation on paths matching ``pattern`` fail with errno
    ``code``, in this process, for the duration of the context."""
    error = OSError(code, os.strerror(code))
    match = re.compile(pattern).search
    if op == "write":
        def fake_open(path, mode="r", *args, **kwargs):
            f = open(path, mode, *args, **kwargs)
            # Room for 64 bytes: every file a save writes is larger, COMMIT included.
            return _DiskFullFile(f, error, room=64) if match(str(path)) else f
        return mock.patch.object(durable_io, "open", fake_open, create=True)
    real = {"fsync": os.fsync, "rename": os.rename, "mkdir": os.mkdir}[op]

    def fake(*args, **kwargs):
        where = _fd_path(args[0]) if op == "fsync" else str(args[0])
        if match(where):
            raise error
        return real(*args, **kwargs)
    return mock.patch(f"os.{op}", fake)


# name: (operation, pattern of the path it fails on, errno, failing ranks, save keep_last,
#        what the message must say after the path)
FAULTS = {
    "rank-file-on-rank-1": ("write", r"/rank-00001\.pt$", errno.ENOSPC, {1}, 3,
                            r"cannot write {tmp}/rank-00001\.pt: \[Errno 28\] No space left"),
    "rank-file-on-every-rank": ("write", r"/rank-\d+\.pt$", errno.ENOSPC, {0, 1}, 3,
                                r"cannot write {tmp}/rank-0000\d\.pt: \[Errno 28\] No space"),
    "manifest": ("write", r"/manifest\.json$", errno.ENOSPC, {0}, 3,
                 r"cannot write {tmp}/manifest\.json: \[Errno 28\] No space left on device"),
    "commit": ("write", r"/COMMIT$", errno.ENOSPC, {0}, 3,
               r"cannot write {tmp}/COMMIT: \[Errno 28\] No space left on device"),
    "fsync-rank-file": ("fsync", r"/rank-00001\.pt$", errno.EIO, {1}, 3,
                        r"cannot write {tmp}/rank-00001\.pt: \[Errno 5\] Input/output error"),
    "fsync-directory": ("fsync", r"\.tmp-[0-9a-f]+$", errno.EIO, {0}, 3,
                        r"cannot flush directory {tmp}: \[Errno 5\] Input/output error"),
    "mkdir": ("mkdir", r"\.tmp-", errno.ENOSPC, {0}, 3,
              r"cannot create directory {tmp}: \[Errno 28\] No space left on device"),
    "rename-commit": ("rename", r"\.tmp-[0-9a-f]+$", errno.ENOSPC, {0}, 3,
                      r"cannot rename {tmp} to {root}/step-00000002: \[Errno 28\]"),
    "fsync-root-after-rename": ("fsync", r"/ckpt$", errno.EIO, {0}, 3,
                                r"cannot flush directory {root}: \[Errno 5\]"),
}


def save_with_fault(rank: int, world_size: int, root: str, step: int, fault: str
                    ) -> dict[str, Any]:
    """Saves step 1, then ``step`` with the fault injected on its failing ranks; returns what
    the second save raised, and whether the latest checkpoint then still loads."""
    op, pattern, code, ranks, keep_last, _ = {**FAULTS, **AFTER_COMMIT_FAULTS}[fault]
    model, optimizer, scaler = build()
    zerocore.save_checkpoint(root, 1, model, optimizer, scaler=scaler, extra={"step": 1})
    with inject(op, pattern, code) if rank in ranks else contextlib.nullcontext():
        try:
            zerocore.save_checkpoint(root, step, model, optimizer, scaler=scaler,
                                     extra={"step": step}, keep_last=keep_last)
            raised = None
        except Exception as e:  # noqa: BLE001  (what was raised is what is tested)
            raised = e
    latest = latest_checkpoint(root)
    extra = zerocore.load_checkpoint(latest, model, optimizer, scaler=scaler)
    return {"type": type(raised).__name__, "message": str(raised),
            "write_error": isinstance(raised, CheckpointWriteError),
            "os_error": isinstance(raised, OSError), "errno": getattr(raised, "errno", None),
            "loaded": extra}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_write_error_is_one_line_on_every_rank(worlds, tmp_path, fault):
    root = tmp_path / "ckpt"
    results = worlds(2).run(save_with_fault, str(root), 2, fault)
    _, _, code, ranks, _, text = FAULTS[fault]
    want = re.compile(text.format(tmp=re.escape(str(root)) + r"/step-00000002\.tmp-[0-9a-f]{8}",
                                  root=re.escape(str(root))))
    for r, res in enumerate(results):
        assert res["write_error"] and res["os_error"], f"rank {r}: {res['type']}: {res['message']}"
        assert "\n" not in res["message"] and want.search(res["message"]), res["message"]
        assert "step 2 was not saved" in res["message"]
        # The failing ranks keep the errno; the others learnt of it in the message only.
        assert res["errno"] == (code if r in ranks else None), r
        assert res["loaded"] == {"step": 1}, "the previous checkpoint loads"
    assert sorted(os.listdir(root)) == ["step-00000001"], "no temporary directory left"


# Faults in a save of the step that already exists (same run: it is replaced), and after the
# commit (keep_last=1 prunes step 1).
AFTER_COMMIT_FAULTS = {
    "replacing-same-step": ("rename", r"\.tmp-[0-9a-f]+$", errno.EIO, {0}, 3, ""),
    "pruning": ("rename", r"/step-00000001$", errno.EACCES, {0}, 1, ""),
}


def test_failed_replacement_puts_the_old_checkpoint_back(worlds, tmp_path):
    root = tmp_path / "ckpt"
    results = worlds(2).run(save_with_fault, str(root), 1, "replacing-same-step")
    for res in results:
        _assert_one_line(res["message"], "cannot rename", f"to {root / 'step-00000001'}: "
                                                          f"[Errno 5]", "step 1 was not saved")
        assert res["write_error"] and res["loaded"] == {"step": 1}
    assert sorted(os.listdir(root)) == ["step-00000001"]
    open_checkpoint(root / "step-00000001")


def test_failed_pruning_says_the_checkpoint_was_saved(worlds, tmp_path):
    root = tmp_path / "ckpt"
    results = worlds(2).run(save_with_fault, str(root), 2, "pruning")
    for res in results:
        assert res["write_error"], res["message"]
        _assert_one_line(res["message"], f"cannot rename {root / 'step-00000001'} to",
                         "[Errno 13] Permission denied", f"{root / 'step-00000002'} was saved")
        assert res["loaded"] == {"step": 2}
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (we may be root in a container that allows it), or a skip."""
    where = tmp_path / "ckpt"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def save_until_full(rank: int, world_size: int, root: str, room: int) -> dict[str, Any]:
    """Saves step 1, fills the disk until ``room`` bytes are left (rank 0), saves step 2 (which
    does not fit), then frees the space and loads the latest checkpoint."""
    model, optimizer, scaler = build()
    zerocore.save_checkpoint(root, 1, model, optimizer, scaler=scaler, extra={"step": 1})
    filler = Path(root).parent / "filler"

    def fill() -> None:
        if rank == 0:
            st = os.statvfs(root)
            with open(filler, "wb") as f:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - room))
    zerocore.run_agreed(fill)
    try:
        zerocore.save_checkpoint(root, 2, model, optimizer, scaler=scaler, extra={"step": 2})
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = e
    zerocore.run_agreed(lambda: filler.unlink() if rank == 0 else None)
    extra = zerocore.load_checkpoint(latest_checkpoint(root), model, optimizer, scaler=scaler)
    return {"message": str(raised), "write_error": isinstance(raised, CheckpointWriteError),
            "loaded": extra}


def test_real_full_disk(worlds, small_tmpfs):
    """A tmpfs with room for a few pages, less than a rank file: the save fails on a real
    ENOSPC, on whichever rank or file it hits first."""
    root = small_tmpfs / "checkpoints"
    results = worlds(2).run(save_until_full, str(root), 8192)
    print("the full disk, as each rank reports it:", *(res["message"] for res in results),
          sep="\n  ")
    for res in results:
        assert res["write_error"], res["message"]
        _assert_one_line(res["message"], f"cannot write {root}/step-00000002.tmp-",
                         "[Errno 28] No space left on device", "step 2 was not saved")
        assert res["loaded"] == {"step": 1}
    assert sorted(os.listdir(root)) == ["step-00000001"]
