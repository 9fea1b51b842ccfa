"""The README's library example runs as shown and learns."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
