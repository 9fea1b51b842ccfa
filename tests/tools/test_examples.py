"""The README's library example runs as shown and learns."""

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


def run_hf_example(name: str, out: Path) -> str:
    """Runs a Hugging Face example for 12 steps into ``out`` and checks what both promise: it
    exits 0, PEFT's reload of the adapter it exported generates the sharded model's line, and
    that line shows something (not only the newlines a greedy byte model first falls into).
    Returns its stdout."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           # this checkout's zerocore, as `pip install -e .` would give it
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name),
                           "--steps", "12", "--out", str(out)],
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


@pytest.mark.parametrize("args, phrase", [
    (["--nproc", "0"], "--nproc 0: give 1 or more processes"),
    (["--data", "no/such/file.txt"], "--data no/such/file.txt: no such file"),
    (["--seq-len", "0"], "--seq-len 0: the model has 256 positions"),
    (["--seq-len", "100000"], "--seq-len 100000: the model has 256 positions"),
    (["--batch", "0"], "--batch 0: give 1 or more sequences per process"),
    (["--lr", "nan"], "--lr nan: give a positive, finite learning rate"),
    (["--out", "OUT_UNDER_A_FILE"], "cannot write there (Not a directory)"),
], ids=["nproc-0", "no-data", "seq-len-0", "seq-len-huge", "batch-0", "lr-nan", "unwritable-out"])
def test_the_trainer_example_refuses_bad_arguments_in_one_line(tmp_path, args, phrase):
    (tmp_path / "file").write_text("x")
    args = [str(tmp_path / "file" / "out") if a == "OUT_UNDER_A_FILE" else a for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_hf_trainer.py"),
                           *args], capture_output=True, text=True, timeout=300,
                          env=_example_env(), cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], lines
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


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
