"""A run's output directory: one run at a time (a lock), owned by one run (its identity), and
the run's metrics file.

    OUTPUT_DIR/
        .lock                   held (flock) by the process that writes, while the run lives;
                                holds its pid, host and start time for the message a second
                                run gets
        run.json                {"run_id": ..., "created": ...}: whose directory this is
        metrics.jsonl           one JSON object per step (always valid JSON)
        checkpoints/            zerocore checkpoints, each tagged with the run id
        trainable.safetensors, tokenizer.json, hf/   the run's results

Rules (docs/decisions.md): a fresh run refuses a directory that holds another run unless
``--overwrite`` (which deletes that run's outputs, and only those names); ``--resume`` continues
the run its checkpoint belongs to; pruning touches only the run's own checkpoints (zerocore
filters by run id). The lock is an ``flock``, so the kernel releases it when its holder dies: a
lock file left by a dead process is simply taken over.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import math
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Callable

from zerocore.checkpoint import (CheckpointError, checkpoint_runs, incomplete_checkpoints,
                                 read_manifest)
from zerocore.consolidate import TRAINABLE_FILE

__all__ = ["OutputDirError", "OutputDirLock", "check_writable", "claim_output_dir",
           "find_resume_checkpoint", "warn_incomplete", "MetricsFile", "RUN_FILE", "CHECKPOINTS",
           "METRICS",
           "TRAINABLE", "HF_EXPORT", "TOKENIZER", "TOKENIZER_SHA256", "DATA_SHA256",
           "describe_os_error",
           "tokenizer_bytes", "write_tokenizer"]

LOCK_FILE = ".lock"
RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TRAINABLE = TRAINABLE_FILE  # what zerocore.consolidate --trainable-only writes
HF_EXPORT = "hf"
TOKENIZER = "tokenizer.json"
# The key of a checkpoint's extra state that holds the SHA-256 of the run's tokenizer.json.
TOKENIZER_SHA256 = "tokenizer_sha256"
# ... and the one that holds the SHA-256 of the text the run trains on (``Corpus.sha256``).
DATA_SHA256 = "data_sha256"
# Everything a run writes into its directory: what --overwrite deletes, and nothing else.
RUN_OUTPUTS = (CHECKPOINTS, METRICS, TRAINABLE, HF_EXPORT, TOKENIZER, RUN_FILE)


class OutputDirError(ValueError):
    """The output directory cannot be used as asked: in use, owned by another run, not
    writable. The message says what to do."""


def describe_os_error(e: OSError, path: Path | str) -> str:
    """``cannot write PATH: [Errno 28] No space left on device``: the path and the errno, the
    form every write error of a run takes."""
    code = f"[Errno {e.errno}] " if e.errno is not None else ""
    return f"cannot write {path}: {code}{e.strerror or e}"


def tokenizer_bytes(tokenizer: Any) -> bytes:
    """The run's tokenizer as its ``tokenizer.json`` holds it: every rank computes the same
    bytes, so every rank knows the checksum that checkpoints record."""
    return tokenizer.to_str().encode("utf-8")


def write_tokenizer(directory: Path, tokenizer: Any) -> Path:
    """``directory/tokenizer.json``, atomically: the run's tokenizer, beside its checkpoints,
    where ``neox.export``, ``neox.evaluate`` and ``neox.generate`` find it."""
    path = directory / TOKENIZER
    content = tokenizer_bytes(tokenizer)
    if path.is_file() and path.read_bytes() == content:  # a resumed run: already there
        return path
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_bytes(content)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputDirError(describe_os_error(e, path)) from None
    return path


def check_writable(directory: Path) -> None:
    """Creates ``directory`` and writes a probe file into it, so that an unwritable output
    directory is found before any data is prepared or any process started."""
    probe = directory / f".write-test-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        where = probe if probe.parent.is_dir() else directory
        raise OutputDirError(f"--output-dir {directory}: {describe_os_error(e, where)}; choose "
                             f"a writable directory") from None


class OutputDirLock:
    """An exclusive lock on an output directory for the life of a run. ``acquire`` fails at
    once, naming the holder, when another live process holds it."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns a note when a dead run's lock file was taken over."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputDirError(
                    f"{self.path.parent} is in use by another run ({_describe_holder(holder)}); "
                    f"wait for it to finish, or choose another --output-dir") from None
            raise OutputDirError(f"cannot lock {self.path}: {e}") from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        if previous:
            return f"took over the lock of a run that ended without releasing it " \
                   f"({_describe_holder(previous)})"
        return None

    def release(self) -> None:
        if self._fd is not None:
            # Emptied first: a lock file that still names a holder when it is next taken was
            # left by a process that died holding it.
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing releases the flock
            self._fd = None

    def __enter__(self) -> "OutputDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe_holder(text: str) -> str:
    try:
        d = json.loads(text)
        return f"pid {d['pid']} on {d['host']}, since {d['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def read_run_id(directory: Path) -> str | None:
    """The run id in ``directory/run.json``, or None when there is none."""
    try:
        d = json.loads((directory / RUN_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise OutputDirError(f"{directory / RUN_FILE}: unreadable ({e}); delete it if the "
                             f"directory holds no run you want to keep") from None
    run_id = d.get("run_id") if isinstance(d, dict) else None
    if not isinstance(run_id, str):
        raise OutputDirError(f"{directory / RUN_FILE}: no run id in it; delete it if the "
                             f"directory holds no run you want to keep")
    return run_id


def _atomic_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputDirError(describe_os_error(e, path)) from None


def trained_nothing(directory: Path) -> bool:
    """Whether ``directory`` holds no output of a trained step: no metrics, checkpoint (whole
    or partial), trained parameters or export. A run refused while it started (a checkpoint
    that does not fit the model, say) leaves only its ``run.json``: nothing to lose."""
    checkpoints = directory / CHECKPOINTS
    return (not any((directory / name).exists() for name in (METRICS, TRAINABLE, HF_EXPORT))
            and not (checkpoints.is_dir() and any(checkpoints.iterdir())))


def _other_runs(directory: Path, run_id: str | None, resumed_legacy: bool) -> list[str]:
    """Descriptions of the runs other than ``run_id`` whose outputs are in ``directory`` (a run
    that trained nothing there has none)."""
    found: list[str] = []
    owner = read_run_id(directory)
    if owner is not None and owner != run_id and not trained_nothing(directory):
        found.append(f"run {owner}")
    for other, paths in checkpoint_runs(directory / CHECKPOINTS).items():
        if other == run_id or (other is None and resumed_legacy):
            continue
        label = f"run {other}" if other is not None else "checkpoints of an unnamed run"
        steps = f"{paths[0].name}" + (f" .. {paths[-1].name}" if len(paths) > 1 else "")
        entry = f"{label}: {steps}"
        if f"run {other}" in found:
            found[found.index(f"run {other}")] = entry
        else:
            found.append(entry)
    if run_id is None and not found and (directory / METRICS).exists():
        found.append(f"the metrics of an earlier run ({directory / METRICS})")
    return found


def claim_output_dir(directory: Path, *, resume_run_id: str | None, resuming: bool,
                     overwrite: bool, log: Callable[[str], None]) -> str:
    """Makes ``directory`` this run's and returns the run id. Call with the lock held.

    A fresh run gets a new id and refuses a directory with another run's outputs unless
    ``overwrite`` (then they are deleted first); a resumed run keeps its checkpoint's id (a
    checkpoint from before run ids gets a new one) and refuses a directory owned by another
    run."""
    if resuming and overwrite:
        raise OutputDirError("--overwrite starts a new run and --resume continues one; give one "
                             "of them")
    run_id = (resume_run_id or read_run_id(directory) or uuid.uuid4().hex[:12]) if resuming \
        else uuid.uuid4().hex[:12]
    previous = read_run_id(directory)
    if previous is not None and previous != run_id and trained_nothing(directory):
        log(f"output: {directory} held run {previous}, which stopped before it trained a step "
            f"(only its {RUN_FILE}); this run takes the directory over")
    others = _other_runs(directory, run_id if resuming else None,
                         resumed_legacy=resuming and resume_run_id is None)
    if others and not overwrite:
        what = "; ".join(others)
        if resuming:
            raise OutputDirError(f"{directory} holds another run ({what}); resume into another "
                                 f"--output-dir")
        if not checkpoint_runs(directory / CHECKPOINTS):  # stopped before its first save
            raise OutputDirError(
                f"{directory} holds another run ({what}) that saved no checkpoint, so it cannot "
                f"be resumed; start over with --overwrite (deletes its metrics and exports), or "
                f"choose another --output-dir")
        raise OutputDirError(
            f"{directory} holds another run ({what}); continue it with --resume "
            f"{directory / CHECKPOINTS}, start over with --overwrite (deletes its checkpoints, "
            f"metrics and exports), or choose another --output-dir")
    if overwrite and others:
        for name in RUN_OUTPUTS:
            target = directory / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
        log(f"overwrite: deleted the outputs of {'; '.join(others)} in {directory}")
    warn_incomplete(directory / CHECKPOINTS, log)
    # "created" is when the run first took the directory: a resume keeps it.
    if not (resuming and _run_file(directory).get("run_id") == run_id):
        _atomic_json(directory / RUN_FILE, {
            "run_id": run_id, "created": datetime.datetime.now().isoformat(timespec="seconds")})
    return run_id


def _run_file(directory: Path) -> dict[str, Any]:
    """``run.json`` as it is (an empty dict when absent; ``read_run_id`` checked it)."""
    try:
        d = json.loads((directory / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def warn_incomplete(folder: Path, log: Callable[[str], None]) -> None:
    """Says which step directories under ``folder`` are not complete checkpoints (a save that
    did not finish, or someone else's files), and what becomes of them."""
    for step_dir, ours in incomplete_checkpoints(folder):
        log(f"warning: {step_dir} is not a complete checkpoint (no manifest or commit record); "
            + ("the next save removes it" if ours else
               "it holds files zerocore did not write and is left alone"))


def find_resume_checkpoint(path: Path, output_dir: Path | None) -> Path:
    """The checkpoint ``--resume PATH`` names: a step directory itself, or in a folder of them
    the newest of the one run they belong to (the run of ``PATH/../run.json`` when the folder
    holds several)."""
    if (path / "manifest.json").is_file():
        return path
    runs = checkpoint_runs(path)
    if not runs:
        incomplete = [str(p) for p, _ in incomplete_checkpoints(path)]
        extra = f" ({', '.join(incomplete)} lack a manifest: saves that did not finish)" \
            if incomplete else ""
        raise OutputDirError(f"--resume {path}: no checkpoint there{extra}; expected a "
                             f"step-XXXXXXXX directory with a manifest.json, or a folder of them")
    if len(runs) > 1:
        owner = None
        for candidate in (path.parent, output_dir):
            if candidate is not None and (candidate / RUN_FILE).is_file():
                owner = read_run_id(candidate)
                break
        if owner not in runs:
            listing = "; ".join(f"run {r}: newest {ps[-1].name}" for r, ps in runs.items())
            raise OutputDirError(f"--resume {path} holds checkpoints of {len(runs)} runs "
                                 f"({listing}); give the step directory to resume")
        return runs[owner][-1]
    return next(iter(runs.values()))[-1]


def checkpoint_run_id(checkpoint: Path) -> str | None:
    """The run id stored in a checkpoint's manifest (None for checkpoints before run ids). The
    checkpoint was verified by neox.finetune (or its unverifiability accepted) before the run
    was launched; only the manifest's COMMIT and fields are checked again here."""
    try:
        return read_manifest(checkpoint, allow_unverified=True).get("run_id")
    except CheckpointError as e:
        raise OutputDirError(f"--resume: {e}") from None


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile:
    """``metrics.jsonl``, written by rank 0: one JSON object per line, flushed after each, in
    step order, each step once.

    Non-finite numbers (a diverging loss) are written as ``null``, so the file stays JSON. A
    resumed run (``resume_step``: the checkpoint's step) leaves the file as it is until it
    trains a step again: then that step's line is replaced (the file rewritten, atomically),
    and only that one, so an interrupted resume loses nothing, and the lines of steps an
    earlier pass trained past the checkpoint stay until the resumed run reaches them (a newer
    checkpoint of that pass may be resumed later). Lines a crash left torn are dropped at the
    first rewrite. Write errors raise ``OutputDirError`` naming the file and the errno."""

    def __init__(self, path: Path, *, resume_step: int | None):
        self.path = path
        # A resumed run's existing lines (step, text) from its first write on, while one of
        # them has a step not yet trained again (each write rewrites the file); then None, and
        # each write appends.
        self._lines: list[tuple[int | None, str]] | None = None
        self._resuming = resume_step is not None
        self._file = None
        try:
            if not self._resuming:
                self._file = open(path, "w")
        except OSError as e:
            raise OutputDirError(describe_os_error(e, path)) from None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False)
        try:
            if self._resuming:
                self._resuming = False
                self._lines = self._existing()
            if self._lines is not None:
                self._replace(record["step"], line)
            else:
                if self._file is None:
                    self._file = open(self.path, "a")
                self._file.write(line + "\n")
                self._file.flush()
        except OSError as e:
            raise OutputDirError(describe_os_error(e, self.path)) from None

    def _existing(self) -> list[tuple[int | None, str]] | None:
        """The lines already there (None when there are none), torn ones marked None."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        lines = [(_step_of(line), line) for line in text.splitlines()]
        return lines if lines else None

    def _replace(self, step: int, line: str) -> None:
        """Writes the file again with ``line`` as step ``step``'s (in place of an earlier one,
        or after the steps before it), atomically."""
        lines = [(s, text) for s, text in self._lines if s is not None]  # torn ones dropped
        before = [x for x in lines if x[0] < step]
        after = [x for x in lines if x[0] > step]
        self._lines = before + [(step, line)] + after
        tmp = self.path.with_name(f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "w") as f:
                f.write("".join(text + "\n" for _, text in self._lines))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        if not after:  # every earlier line is behind: appends from now on
            self._lines = None
            self._file = open(self.path, "a")

    def close(self) -> None:
        try:
            if self._file is not None:
                self._file.close()
        except OSError as e:
            raise OutputDirError(describe_os_error(e, self.path)) from None


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a line a crash left torn."""
    try:
        d = json.loads(line)
        step = d.get("step") if isinstance(d, dict) else None
        return step if isinstance(step, int) else None
    except ValueError:
        return None
