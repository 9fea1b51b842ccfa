"""The README's library example runs as shown and learns."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.processes import RUN_MARK, left_after, marked
from tests.support.two_nodes import run_two_nodes
from zerocore.tools.job import QGZ_LOSS_RTOL

# Each test runs an example as a user would, in its own processes.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_train_mlp_example_runs_and_loss_falls():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_mlp.py"),
                           "--steps", "20", "--port", "0"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], proc.stdout
    assert "measured / predicted" in proc.stdout


def run_hf_example(name: str, out: Path, *extra: str) -> str:
    """Runs a Hugging Face example for 12 steps into ``out`` and checks what both promise: it
    exits 0, PEFT's reload of the adapter it exported generates the sharded model's line, and
    that line shows something (not only the newlines a greedy byte model first falls into).
    Returns its stdout."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           # this checkout's zerocore, as `pip install -e .` would give it
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name),
                           "--steps", "12", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same as the sharded model's: True" in proc.stdout, proc.stdout
    line = re.search(r"reloaded by peft: '(.*)'", proc.stdout).group(1)
    continuation = line.encode().decode("unicode_escape")[len("ROMEO:\n"):]
    assert len(set(continuation) - set(" \n\t")) >= 5, line
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    return proc.stdout


def test_finetune_hf_lora_example(tmp_path):
    """The transformers + PEFT LoRA example trains under shard_model, exports the adapter, and
    PEFT's reload generates what the sharded model generated."""
    stdout = run_hf_example("finetune_hf_lora.py", tmp_path / "out")
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], stdout


def test_finetune_hf_trainer_example(tmp_path):
    """The Trainer example (ShardedTrainer, LoRA, offload, gradient checkpointing) trains on 2
    gloo processes, keeps a checkpoint, and PEFT's reload of its adapter generates what the
    sharded model generated."""
    stdout = run_hf_example("finetune_hf_trainer.py", tmp_path / "out")
    losses = [float(x) for x in re.search(r"losses every 5 steps: (.*)", stdout)
              .group(1).split()]
    assert len(losses) >= 2 and losses[-1] < losses[0], stdout
    # Trainer's last checkpoint (save_total_limit=1 removed step 6's), with zerocore's sharded
    # checkpoint inside, committed.
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-12"]
    assert (tmp_path / "out" / "checkpoint-12" / "zerocore" / "step-00000012" / "COMMIT").is_file()
    assert re.search(r"^peak RSS per rank: \d+ MiB, \d+ MiB$", stdout, re.M), stdout


def test_finetune_hf_trainer_example_from_a_model_directory(tmp_path):
    """--model DIR: a Hugging Face directory (here the example's own base, saved in several
    files) loaded by zerocore.hf_pretrained as ShardedTrainer shards it; it trains and PEFT's
    reload of the adapter onto that directory generates what the sharded model generated."""
    spec = importlib.util.spec_from_file_location(
        "finetune_hf_trainer", ROOT / "examples" / "finetune_hf_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.base_model().save_pretrained(tmp_path / "model", max_shard_size="200KB")
    assert (tmp_path / "model" / "model.safetensors.index.json").is_file()
    stdout = run_hf_example("finetune_hf_trainer.py", tmp_path / "out", "--model",
                            str(tmp_path / "model"))
    assert re.search(r"^peak RSS per rank: \d+ MiB, \d+ MiB$", stdout, re.M), stdout


# qgZ's stated bound on real training (QGZ_LOSS_RTOL, zerocore/tools/job.py; docs/decisions.md,
# "qgZ"): each step's loss within 1% of the exact run's. Measured here: 2e-5 (the last printed
# digit).


def example_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.search(r"losses every 1 steps: (.*)", stdout).group(1).split()]


def test_the_trainer_example_under_two_torchrun_agents_hsdp_and_qgz(tmp_path):
    """Two torchrun agents of 2 ranks on this machine, as two nodes: --hybrid hsdp with the
    cross-node gradients in int8 (qgZ). It finishes, says its layout, its replicas end bitwise
    equal, PEFT's reload of the adapter generates what the sharded model does, and its losses
    are the flat job's (one process, the same 16 rows a micro-batch: Trainer hands each rank its
    part of the same global batch) within qgZ's bound."""
    steps = ["--steps", "4", "--log-every", "1"]
    agents = run_two_nodes([ROOT / "examples" / "finetune_hf_trainer.py", *steps, "--hybrid",
                            "hsdp", "--quantize-gradients", "int8", "--out", tmp_path / "hsdp"],
                           timeout=600, env=_example_env())
    assert agents.codes == [0, 0], agents.output[-6000:]
    printed = agents.output
    said = [line for line in printed.splitlines() if line.startswith("layout:")]
    assert len(said) == 1 and said[0].startswith("layout: HSDP 2x2: "), said
    assert "replicas bitwise equal: True" in printed
    assert "same as the sharded model's: True" in printed
    flat = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_hf_trainer.py"),
                           *steps, "--nproc", "1", "--batch", "16", "--out",
                           str(tmp_path / "flat")],
                          capture_output=True, text=True, timeout=600, env=_example_env())
    assert flat.returncode == 0, flat.stderr[-3000:]
    got, want = example_losses(printed), example_losses(flat.stdout)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert abs(g - w) <= QGZ_LOSS_RTOL * w, (got, want)


def test_example_help_shows_the_whole_description():
    for name in ("train_mlp.py", "finetune_hf_lora.py", "finetune_hf_trainer.py"):
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--help"],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert proc.returncode == 0, proc.stderr
        first_paragraph = (ROOT / "examples" / name).read_text().split('"""')[1].split("\n\n")[0]
        assert " ".join(first_paragraph.split()) in " ".join(proc.stdout.split()), proc.stdout


def _example_env(**more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **more}


@pytest.fixture(scope="module")
def trainer_example():
    """examples/finetune_hf_trainer.py imported as a module, as its rank processes import it."""
    spec = importlib.util.spec_from_file_location(
        "finetune_hf_trainer", ROOT / "examples" / "finetune_hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFUSALS = [
    (["--nproc", "0"], "--nproc 0: give 1 or more processes"),
    (["--data", "no/such/file.txt"], "--data no/such/file.txt: no such file"),
    (["--seq-len", "0"], "--seq-len 0: the model has 256 positions"),
    (["--seq-len", "100000"], "--seq-len 100000: the model has 256 positions"),
    (["--batch", "0"], "--batch 0: give 1 or more sequences per process"),
    (["--lr", "nan"], "--lr nan: give a positive, finite learning rate"),
    (["--out", "OUT_UNDER_A_FILE"], "cannot write there (Not a directory)"),
    (["--quantize-gradients", "int8"], "--quantize-gradients int8 quantizes the gradients' "
                                       "all-reduce across nodes, which only --hybrid has"),
    (["--hybrid", "hpz"], "--hybrid hpz lays the ranks out in nodes: "
                          "run under torchrun --nnodes N (N >= 2)"),
]
REFUSAL_IDS = ["nproc-0", "no-data", "seq-len-0", "seq-len-huge", "batch-0", "lr-nan",
               "unwritable-out", "qgz-flat", "hybrid-one-machine"]


def _refusal_args(tmp_path: Path, args: list[str]) -> list[str]:
    (tmp_path / "file").write_text("x")
    return [str(tmp_path / "file" / "out") if a == "OUT_UNDER_A_FILE" else a for a in args]


def _assert_refused(rc: int, out: str, err: str, phrase: str, tmp_path: Path) -> None:
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], lines
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


@pytest.mark.parametrize("args, phrase", REFUSALS, ids=REFUSAL_IDS)
def test_the_trainer_example_refuses_bad_arguments_in_one_line(trainer_example, tmp_path,
                                                               monkeypatch, capsys, args, phrase):
    """The example's own main(), in this process: each of its checks refuses in one line before
    any process starts or anything is written. (Importing transformers and peft costs about
    10 s a process, so one case runs as a user runs it, below.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun
    rc = trainer_example.main(_refusal_args(tmp_path, args))
    captured = capsys.readouterr()
    _assert_refused(rc, captured.out, captured.err, phrase, tmp_path)


def test_the_trainer_example_refuses_in_one_line_as_a_command(tmp_path):
    """One refusal through the script itself: exit 2, one line on stderr, nothing written."""
    args, phrase = REFUSALS[-1]
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_hf_trainer.py"),
                           *_refusal_args(tmp_path, args)], capture_output=True, text=True,
                          timeout=300, env=_example_env(), cwd=tmp_path)
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, phrase, tmp_path)


# Seconds the example's processes may outlive it (neox.finetune's bound, tests/neox).
ORPHAN_DEADLINE_S = 2.0


def test_the_trainer_examples_processes_go_with_it(tmp_path):
    """SIGKILL of the example once its processes train: none is left 2 s later."""
    mark = uuid.uuid4().hex
    main = subprocess.Popen([sys.executable, str(ROOT / "examples" / "finetune_hf_trainer.py"),
                             "--steps", "1000", "--out", str(tmp_path / "out")],
                            env=_example_env(**{RUN_MARK: mark}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        # rank 0 saves the base weights once the process group exists, before training
        while not (tmp_path / "out" / "base" / "config.json").is_file():
            assert main.poll() is None and time.monotonic() < deadline, main.communicate()
            time.sleep(0.05)
        assert len(marked(mark)) >= 3  # the example and its 2 processes
        main.send_signal(signal.SIGKILL)
        main.wait()
        left = left_after(mark, ORPHAN_DEADLINE_S)
    finally:
        if main.poll() is None:
            main.kill()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"{len(left)} processes outlived the example by {ORPHAN_DEADLINE_S} s"


def _rank_pid(marker: str, mark: str, rank: int) -> int | None:
    """The pid of rank ``rank`` started by ``zerocore.tools.rank_processes`` with ``marker``
    (its command line: python -c BOOTSTRAP marker launcher fd rank ...), if running."""
    for pid in marked(mark):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[3:4] == [marker.encode()] and argv[6:7] == [str(rank).encode()]:
            return pid
    return None


def test_a_killed_process_of_the_trainer_example_is_one_line_on_the_other(tmp_path):
    """SIGKILL of process 1 once the example trains: process 0 says in one line that it lost
    it, with no traceback (the launcher names the killed one), and the example exits non-zero."""
    mark = uuid.uuid4().hex
    main = subprocess.Popen([sys.executable, str(ROOT / "examples" / "finetune_hf_trainer.py"),
                             "--steps", "1000", "--log-every", "1", "--out",
                             str(tmp_path / "out")],
                            env=_example_env(**{RUN_MARK: mark}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # Trainer prints each step's logged loss (disable_tqdm): the processes train.
        while "'loss'" not in main.stdout.readline():
            assert main.poll() is None, main.communicate()
        victim = _rank_pid("hf-trainer-rank", mark, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        _, err = main.communicate(timeout=300)
    finally:
        if main.poll() is None:
            main.kill()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert main.returncode != 0, err
    assert "Traceback" not in err, err
    lost = [line for line in err.splitlines() if "lost contact" in line]
    assert len(lost) == 1 and lost[0].startswith("error (rank 0): lost contact with another "
                                                 "process ("), err
    assert f"error: rank 1 (pid {victim}) was killed by SIGKILL" in err, err
