"""The README's library example runs as shown and learns."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_mlp_example_runs_and_loss_falls():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--steps", "20",
                           "--port", "0"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], proc.stdout
    assert "measured / predicted" in proc.stdout
