"""A fine-tuning run's checkpoints know whose they are, and a run knows its data: the hostile
tester's attacks of issue 20 (items 1-3, and the symlinked rank file of item 6) through
``neox.finetune --resume``, ``neox.export`` and ``zerocore.consolidate``.

Every attack fixes the checksums the way anyone copying files can: the manifest's files table
is recomputed from the rank files and COMMIT from the manifest (``zerocore``'s own
``commit_record``). Each is refused in one ``error:`` line, with a non-zero exit, and nothing in
the run's directory is changed:
- a manifest downgraded to format 1 (no COMMIT, no run id) or 2, an edited sampler position,
  an edited step: refused (and ``--allow-unverified`` does not let a downgrade pass);
- rank files swapped between ranks, or one taken from another run of the same shape;
- a rank file that is a symbolic link out of the checkpoint;
- forged recipe ``data``/``cache_dir`` paths: neither is opened nor created before the refusal;
- a corpus edited after the run started: the resume is refused naming the file, and goes on
  with ``--data-changed``, saying that the data order restarts;
- a checkpoint of format 2 (before rank files recorded their identity): refused unless
  ``--allow-unverified``, then resumed, with a note that its data cannot be checked.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neox import export
from neox.finetune import main as finetune_main
from neox.run.run_dir import CHECKPOINTS, METRICS
from tests.support.neox_testing import (EXCERPT, REPO, assert_clean_error, call_main, cli_env,
                                        run_module)
from zerocore import consolidate
from zerocore.checkpoint.manifest import COMMIT, MANIFEST, commit_record

SMALL = ["--cpu", "--seq-len", 16, "--batch-size", 2, "--seed", 1, "--sample-tokens", 0]
V1, V2 = "zerocore-checkpoint/1", "zerocore-checkpoint/2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs of the same shape and settings on their own copy of the excerpt (4 steps, a
    checkpoint at 2 and 4)."""
    base = tmp_path_factory.mktemp("identity")
    corpus = base / "corpus.txt"
    shutil.copyfile(EXCERPT, corpus)
    found = {"base": base, "cache": base / "cache", "corpus": corpus}
    for name in ("a", "b"):
        proc = run_module("neox.finetune", *SMALL, "--data", corpus, "--cache-dir",
                          base / "cache", "--output-dir", base / name, "--max-steps", 4,
                          "--save-every", 2)
        assert proc.returncode == 0, proc.stderr
        found[name] = base / name
    return found


def _copy(runs: dict[str, Path], where: Path, name: str = "a") -> tuple[Path, Path]:
    """A copy of run ``name``'s output directory, and its newest checkpoint."""
    out = Path(shutil.copytree(runs[name], where))
    return out, out / CHECKPOINTS / "step-00000004"


def _fix_checksums(ckpt: Path, edit=lambda m: None) -> None:
    """Edits the manifest, then recomputes its files table and COMMIT (when there is one)."""
    m = json.loads((ckpt / MANIFEST).read_text())
    edit(m)
    for f in sorted(ckpt.glob("rank-*.pt")):
        data = f.read_bytes()
        m["files"][f.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    raw = json.dumps(m, indent=1).encode()
    (ckpt / MANIFEST).write_bytes(raw)
    if (ckpt / COMMIT).exists():
        (ckpt / COMMIT).write_bytes(commit_record(raw))


def _snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}


def _downgrade_v1(ckpt: Path) -> None:
    def edit(m):
        m["format"] = V1
        m.pop("run_id")
        m.pop("save_id")
        m["extra"]["sampler"]["samples_done"] = 0  # re-train the samples already trained
    (ckpt / COMMIT).unlink()
    _fix_checksums(ckpt, edit)


def _downgrade_v2(ckpt: Path) -> None:
    def edit(m):
        m["format"] = V2
        m.pop("save_id")
        m["extra"]["sampler"]["samples_done"] = 0
    _fix_checksums(ckpt, edit)
    record = json.loads((ckpt / COMMIT).read_text())
    (ckpt / COMMIT).write_text(json.dumps({**record, "format": V2}))


def _swap(ckpt: Path) -> None:
    a, b = ckpt / "rank-00000.pt", ckpt / "rank-00001.pt"
    a.rename(ckpt / "x")
    b.rename(a)
    (ckpt / "x").rename(b)
    _fix_checksums(ckpt)


def _sampler_edited(ckpt: Path) -> None:
    _fix_checksums(ckpt, lambda m: m["extra"]["sampler"].update(samples_done=0,
                                                                 batches_done=0))


def _step_edited(ckpt: Path) -> None:
    _fix_checksums(ckpt, lambda m: (m.update(step=6), m["extra"].update(step=6)))
    ckpt.rename(ckpt.with_name("step-00000006"))


def _symlinked(ckpt: Path) -> None:
    outside = ckpt.parent.parent / "rank-00001.pt"
    (ckpt / "rank-00001.pt").rename(outside)
    (ckpt / "rank-00001.pt").symlink_to(outside)


ATTACKS = {
    # name: (attack, what the refusal names after the checkpoint's path)
    "downgrade-v1": (_downgrade_v1, ": cannot be verified (format 1"),
    "downgrade-v2": (_downgrade_v2, ": cannot be verified (format 2"),
    "swapped": (_swap, "/rank-00000.pt: is rank 1's file of 2, not rank 0's"),
    "sampler-edited": (_sampler_edited, "/rank-00000.pt: was saved with manifest content"),
    "step-edited": (_step_edited, "/rank-00000.pt: was saved with step 4, but the manifest "
                                  "says 6"),
    "symlinked": (_symlinked, "/rank-00001.pt: a symbolic link (to "),
}


def _refused_by_every_tool(capsys, ckpt: Path, out: Path, phrase: str, *flags: str) -> None:
    """Resume, export (full and --trainable-only) and consolidate refuse ``ckpt`` in one line
    holding ``phrase``, exit 2, before anything is written."""
    # The checkpoint itself: given its parent, --resume would pick the newest complete one,
    # which after a downgrade (no COMMIT) is the untouched step 2.
    resume = call_main(finetune_main, capsys, "--resume", ckpt, "--output-dir", out,
                       "--max-steps", 6, *flags)
    assert_clean_error(resume, phrase)
    assert resume.returncode == 2 and "Distributed:" not in resume.stdout  # no rank started
    for tool, argv in ((export.main, [ckpt, out.parent / "hf"]),
                       (export.main, [ckpt, out.parent / "hf", "--trainable-only"]),
                       (consolidate.main, [ckpt, out.parent / "plain", "--trainable-only"])):
        proc = call_main(tool, capsys, *argv, *flags)
        assert_clean_error(proc, phrase)
        assert proc.returncode == 2
    assert not (out.parent / "hf").exists() and not (out.parent / "plain").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attacked_checkpoint_is_refused_by_resume_export_and_consolidate(runs, tmp_path,
                                                                            capsys, attack):
    out, ckpt = _copy(runs, tmp_path / "out")
    edit, phrase = ATTACKS[attack]
    edit(ckpt)
    if attack == "step-edited":
        ckpt = ckpt.with_name("step-00000006")
    before = _snapshot(out)
    _refused_by_every_tool(capsys, ckpt, out, f"{ckpt}{phrase}")
    if attack.startswith("downgrade"):
        # Opting in accepts an old format, not a downgraded one: the rank files say so.
        _refused_by_every_tool(capsys, ckpt, out, f"{ckpt}/rank-00000.pt: records the save "
                                                  f"it belongs to", "--allow-unverified")
    assert _snapshot(out) == before  # nothing written, nothing lost


@pytest.mark.e2e
def test_a_rank_file_of_another_run_of_the_same_shape_is_refused(runs, tmp_path, capsys):
    out, ckpt = _copy(runs, tmp_path / "out")
    shutil.copyfile(runs["b"] / CHECKPOINTS / ckpt.name / "rank-00001.pt", ckpt / "rank-00001.pt")
    _fix_checksums(ckpt)
    run_b = json.loads((runs["b"] / "run.json").read_text())["run_id"]
    before = _snapshot(out)
    _refused_by_every_tool(capsys, ckpt, out, f"{ckpt}/rank-00001.pt: belongs to another save")
    proc = call_main(finetune_main, capsys, "--resume", ckpt, "--output-dir", out)
    assert f"run {run_b!r}" in proc.stderr
    assert _snapshot(out) == before


# Run in a subprocess with an audit hook: every file the launcher process opens, and every
# directory it creates, under the forged paths is reported.
_WATCHED = """
import os, sys
forged = [os.path.abspath(p) for p in sys.argv[1:3]]
def hook(event, args):
    if event in ("open", "os.mkdir", "os.listdir", "os.scandir") and args and \\
            isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if any(path.startswith(f) for f in forged):
            sys.stderr.write(f"TOUCHED {event} {path}\\n")
sys.addaudithook(hook)
from neox.finetune import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.e2e
def test_forged_recipe_paths_are_not_opened_before_the_checkpoint_is_verified(runs, tmp_path):
    out, ckpt = _copy(runs, tmp_path / "out")
    forged_data = tmp_path / "forged.txt"
    forged_data.write_text(EXCERPT.read_text()[:20000])
    forged_cache = tmp_path / "forged-cache"

    def forge(m):
        m["extra"]["recipe"]["data"].update(data=str(forged_data), cache_dir=str(forged_cache))
    _fix_checksums(ckpt, forge)
    before = _snapshot(out)
    argv = [_WATCHED, forged_data, forged_cache, "--resume", ckpt, "--output-dir", out,
            "--max-steps", 6]
    proc = subprocess.run([sys.executable, "-c", *map(str, argv)],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert "TOUCHED" not in proc.stderr, proc.stderr
    assert_clean_error(proc, f"{ckpt}/rank-00000.pt: was saved with manifest content")
    assert proc.returncode == 2 and "Distributed:" not in proc.stdout
    assert not forged_cache.exists()
    assert _snapshot(out) == before


@pytest.mark.e2e
def test_a_changed_corpus_is_refused_on_resume_unless_told(runs, tmp_path):
    out, ckpt = _copy(runs, tmp_path / "out")
    corpus = runs["corpus"]
    original = corpus.read_bytes()
    try:
        corpus.write_text(original.decode().replace("the", "THE"))
        before = _snapshot(out)
        refused = run_module("neox.finetune", "--resume", out / CHECKPOINTS, "--output-dir", out,
                             "--max-steps", 6)
        assert_clean_error(refused, f"the training data changed: {corpus} (sha256 ")
        assert "--data-changed" in refused.stderr
        assert "tokenizer:" not in refused.stdout  # refused before anything was derived from it
        after = _snapshot(out)
        assert {k: v for k, v in after.items() if k != "run.json"} == \
            {k: v for k, v in before.items() if k != "run.json"}
        accepted = run_module("neox.finetune", "--resume", out / CHECKPOINTS, "--output-dir",
                              out, "--max-steps", 6, "--data-changed")
    finally:
        corpus.write_bytes(original)
    assert accepted.returncode == 0, accepted.stderr
    assert f"data: --data-changed: {corpus} differs from the text the run trained on" in \
        accepted.stdout
    assert "the data order restarts at the beginning of the current epoch" in accepted.stdout
    assert f"tokenizer: {out / 'tokenizer.json'}" in accepted.stdout  # the run's own
    assert f"resumed from {ckpt} at step 4 (epoch 0, batch 0)" in accepted.stdout
    steps = [json.loads(line)["step"] for line in (out / METRICS).read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5, 6]
    new = json.loads((out / CHECKPOINTS / "step-00000006" / MANIFEST).read_text())
    assert new["extra"]["data_sha256"] != json.loads((ckpt / MANIFEST).read_text())[
        "extra"]["data_sha256"]


def test_data_changed_and_allow_unverified_need_resume(capsys, tmp_path):
    for flag in ("--data-changed", "--allow-unverified"):
        proc = call_main(finetune_main, capsys, *SMALL, "--output-dir", tmp_path / "out", flag)
        assert_clean_error(proc, f"{flag} applies to --resume only")
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_a_format_2_checkpoint_resumes_only_when_asked(runs, tmp_path, capsys):
    """As zerocore wrote them before rank files recorded their identity, and neox before it
    recorded the data's digest."""
    out, ckpt = _copy(runs, tmp_path / "out")
    for f in ckpt.glob("rank-*.pt"):
        data = torch.load(f, weights_only=True)
        del data["identity"]
        torch.save(data, f)

    def edit(m):
        m["format"] = V2
        m.pop("save_id")
        m["extra"].pop("data_sha256")
    _fix_checksums(ckpt, edit)
    record = json.loads((ckpt / COMMIT).read_text())
    (ckpt / COMMIT).write_text(json.dumps({**record, "format": V2}))
    refused = call_main(finetune_main, capsys, "--resume", ckpt, "--output-dir", out,
                        "--max-steps", 6)
    assert_clean_error(refused, f"{ckpt}: cannot be verified (format 2")
    assert "--allow-unverified" in refused.stderr
    proc = run_module("neox.finetune", "--resume", ckpt, "--output-dir", out, "--max-steps", 6,
                      "--allow-unverified")
    assert proc.returncode == 0, proc.stderr
    assert f"note: {ckpt} cannot be verified (format 2" in proc.stdout
    assert "records no digest of its training data" in proc.stdout
    assert f"resumed from {ckpt} at step 4" in proc.stdout
    # What it saves is of the current format, verified.
    assert json.loads((out / CHECKPOINTS / "step-00000006" / MANIFEST).read_text())[
        "format"] == "zerocore-checkpoint/3"
