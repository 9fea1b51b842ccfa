"""neox.run.run_dir: the output directory's lock, its owner run, the metrics file and how --resume
finds its checkpoint. In process, no ranks (the runs that need them are in
test_neox_faults.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from neox.run.run_dir import (CHECKPOINTS, METRICS, RUN_FILE, TRAINABLE, MetricsFile,
                              OutputDirError, OutputDirLock, check_writable, claim_output_dir,
                              find_resume_checkpoint)
from tests.support.neox_testing import EXCERPT, run_module


class Log(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def test_the_lock_is_exclusive_and_names_its_holder(tmp_path):
    first = OutputDirLock(tmp_path)
    assert first.acquire() is None
    # flock locks belong to an open file: a second open in this process conflicts like another
    # process would.
    with pytest.raises(OutputDirError, match=rf"in use by another run \(pid {os.getpid()} on "):
        OutputDirLock(tmp_path).acquire()
    first.release()
    again = OutputDirLock(tmp_path)
    assert again.acquire() is None  # released cleanly: nothing to take over
    again.release()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    # What a process killed while holding the lock leaves: the file, naming it; the kernel
    # released the flock itself.
    (tmp_path / ".lock").write_text(json.dumps({"pid": 999999, "host": "h", "since": "t"}))
    lock = OutputDirLock(tmp_path)
    note = lock.acquire()
    assert note is not None and "took over the lock" in note and "pid 999999 on h" in note
    lock.release()


def test_an_unwritable_directory_is_found_first(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputDirError, match=r"cannot write .*\[Errno 20\] Not a directory"):
        check_writable(blocker / "out")
    check_writable(tmp_path / "fine" / "deeper")
    assert list((tmp_path / "fine" / "deeper").iterdir()) == []  # the probe is gone


def test_metrics_are_json_even_when_the_loss_is_not_finite(tmp_path):
    m = MetricsFile(tmp_path / METRICS, resume_step=None)
    m.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "acc": 0.5})
    m.close()
    line = (tmp_path / METRICS).read_text()
    assert json.loads(line) == {"step": 1, "loss": None, "grad_norm": None, "acc": 0.5}


def _metrics(path: Path, steps, torn: bool = False) -> bytes:
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps]
    path.write_text("".join(lines) + ('{"step": 8, "lo' if torn else ""))  # torn by a kill
    return path.read_bytes()


def test_a_resume_that_trains_nothing_changes_no_byte(tmp_path):
    """Resumed from step 2 of a run that logged 7 steps, then stopped before its first step
    (or ending with nothing to train): the file is as it was, byte for byte."""
    path = tmp_path / METRICS
    before = _metrics(path, range(1, 8), torn=True)
    MetricsFile(path, resume_step=2).close()
    assert path.read_bytes() == before


def test_a_resumed_step_replaces_only_its_own_line(tmp_path):
    path = tmp_path / METRICS
    before = _metrics(path, range(1, 8), torn=True).decode().splitlines(keepends=True)
    m = MetricsFile(path, resume_step=2)
    m.write({"step": 3, "loss": 0.25})
    # Killed now: steps 4-7 of the earlier pass stay (their checkpoints may be resumed), the
    # torn line goes, each step once.
    assert path.read_text().splitlines(keepends=True) == \
        before[:2] + ['{"step": 3, "loss": 0.25}\n'] + before[3:7]
    for s in range(4, 10):
        m.write({"step": s, "loss": 0.5})
    m.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 10))
    assert path.read_text().splitlines(keepends=True)[:2] == before[:2]


def test_resuming_a_newer_checkpoint_after_an_interrupted_resume_loses_no_line(tmp_path):
    """The issue's sequence: resume step 2 in place, stopped after retraining step 3; then
    resume step 4 (the earlier pass's): every step once, 1-2 and 4 as first written."""
    path = tmp_path / METRICS
    before = _metrics(path, range(1, 5)).decode().splitlines(keepends=True)
    m = MetricsFile(path, resume_step=2)
    m.write({"step": 3, "loss": 0.3})
    m = MetricsFile(path, resume_step=4)
    for s in (5, 6):
        m.write({"step": s, "loss": 0.2})
    m.close()
    lines = path.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[:2] == before[:2] and lines[3] == before[3]


def test_a_metrics_write_error_names_the_file_and_errno():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    m = MetricsFile(Path("/dev/full"), resume_step=None)
    with pytest.raises(OutputDirError, match=r"cannot write /dev/full: \[Errno 28\] No space"):
        m.write({"step": 1, "loss": math.pi})


def test_a_run_that_trained_nothing_does_not_hold_its_directory(tmp_path):
    """A run refused while it started (a --resume DSDIR that does not fit the model) leaves
    only its run.json: the corrected rerun takes the directory without --overwrite, saying so;
    once a step's metrics are there, the directory is the earlier run's."""
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "0123456789ab", "created": "t"}))
    log = Log()
    run_id = claim_output_dir(tmp_path, resume_run_id=None, resuming=False, overwrite=False,
                              log=log)
    assert run_id != "0123456789ab"
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == run_id
    assert any("held run 0123456789ab, which stopped before it trained a step" in line
               for line in log), log
    (tmp_path / METRICS).write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(OutputDirError, match=f"holds another run \\(run {run_id}\\)"):
        claim_output_dir(tmp_path, resume_run_id=None, resuming=False, overwrite=False,
                         log=Log())


# -- ownership, with real checkpoints ------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A complete 4-step run of 1 rank with a checkpoint every 2 steps."""
    root = tmp_path_factory.mktemp("run")
    proc = run_module("neox.finetune", "--cpu", "--nproc", 1, "--data", EXCERPT, "--cache-dir",
                      root / "cache", "--seq-len", 16, "--batch-size", 2, "--max-steps", 4,
                      "--save-every", 2, "--output-dir", root / "out")
    assert proc.returncode == 0, proc.stderr
    return root / "out"


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    return Path(shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock")))


@pytest.mark.e2e
def test_a_fresh_run_refuses_another_runs_directory(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path / "out")
    owner = json.loads((out / RUN_FILE).read_text())["run_id"]
    with pytest.raises(OutputDirError, match=rf"holds another run \(run {owner}: step-00000002 "
                                             rf"\.\. step-00000004\); continue it with --resume"):
        claim_output_dir(out, resume_run_id=None, resuming=False, overwrite=False, log=Log())


@pytest.mark.e2e
def test_overwrite_deletes_only_the_runs_outputs(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    log = Log()
    run_id = claim_output_dir(out, resume_run_id=None, resuming=False, overwrite=True, log=log)
    assert not (out / CHECKPOINTS).exists() and not (out / METRICS).exists()
    assert not (out / TRAINABLE).exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / RUN_FILE).read_text())["run_id"] == run_id
    assert any("overwrite: deleted the outputs of run" in line for line in log)


@pytest.mark.e2e
def test_resume_keeps_the_run_and_refuses_overwrite(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path / "out")
    owner = json.loads((out / RUN_FILE).read_text())["run_id"]
    assert claim_output_dir(out, resume_run_id=owner, resuming=True, overwrite=False,
                            log=Log()) == owner
    with pytest.raises(OutputDirError, match="give one of them"):
        claim_output_dir(out, resume_run_id=owner, resuming=True, overwrite=True, log=Log())
    with pytest.raises(OutputDirError, match="resume into another --output-dir"):
        claim_output_dir(out, resume_run_id="0123456789ab", resuming=True, overwrite=False,
                         log=Log())


@pytest.mark.e2e
def test_resume_finds_the_newest_checkpoint_of_the_run(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path / "out")
    ckpts = out / CHECKPOINTS
    assert find_resume_checkpoint(ckpts, None) == ckpts / "step-00000004"
    assert find_resume_checkpoint(ckpts / "step-00000002", None) == ckpts / "step-00000002"
    # A step directory without a manifest (a save that did not finish) is never picked.
    (ckpts / "step-00000009").mkdir()
    assert find_resume_checkpoint(ckpts, None) == ckpts / "step-00000004"


def test_resume_from_an_empty_folder_says_why(tmp_path):
    (tmp_path / "step-00000003").mkdir()
    with pytest.raises(OutputDirError, match=r"no checkpoint there \(.*step-00000003 lack a "
                                             r"manifest"):
        find_resume_checkpoint(tmp_path, None)


def test_cuda_ranks_get_expandable_segments_unless_the_user_chose():
    from neox.run.launch import cuda_environment
    assert cuda_environment({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert cuda_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}


@pytest.mark.e2e
def test_resume_keeps_the_created_time(finished_run, tmp_path):
    """run.json's "created" is when the run first took the directory; resuming (even a resume
    that is refused later, in the ranks) does not rewrite it."""
    out = _copy(finished_run, tmp_path / "out")
    owner = json.loads((out / RUN_FILE).read_text())["run_id"]
    (out / RUN_FILE).write_text(json.dumps({"run_id": owner, "created": "2026-01-01T00:00:00"}))
    claim_output_dir(out, resume_run_id=owner, resuming=True, overwrite=False, log=Log())
    assert json.loads((out / RUN_FILE).read_text()) == {"run_id": owner,
                                                        "created": "2026-01-01T00:00:00"}


def test_a_run_killed_before_its_first_checkpoint_is_not_offered_to_resume(tmp_path):
    """What a run killed before its first save leaves: run.json and metrics, no checkpoint.
    --resume could not continue it, so the refusal offers --overwrite only; that works."""
    out = tmp_path / "out"
    out.mkdir()
    (out / RUN_FILE).write_text(json.dumps({"run_id": "0123456789ab", "created": "t"}))
    (out / METRICS).write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(OutputDirError) as raised:
        claim_output_dir(out, resume_run_id=None, resuming=False, overwrite=False, log=Log())
    message = str(raised.value)
    assert "saved no checkpoint" in message and "--overwrite" in message, message
    assert "--resume" not in message, message
    claim_output_dir(out, resume_run_id=None, resuming=False, overwrite=True, log=Log())
    assert not (out / METRICS).exists()
