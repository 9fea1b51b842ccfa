"""Shared by the neox test files: a transformers GPT-NeoX with every parameter random, and the
test data."""

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import neox.data
from neox.run.run_dir import METRICS


def random_hf_model(transformers, seed: int = 0, **config):
    """A GPTNeoXForCausalLM in eval mode, weights N(0, 0.2) and layer-norm gains around 1 (so
    that every parameter matters to the logits), built from ``config`` (GPTNeoXConfig keys)."""
    torch.manual_seed(seed)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm.weight" in name or "layer_norm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


# -- test data ------------------------------------------------------------------------------------
# What lives in the repository (tests/data/README.md): enough for every test to run on a fresh
# clone without ../shared and without network.
DATA = Path(__file__).resolve().parents[1] / "data"
EXCERPT = DATA / "shakespeare_excerpt.txt"   # 39,908 bytes of tiny_shakespeare
BPE512 = DATA / "bpe512.json"                # a byte-level BPE of 512 tokens trained on it
TINY_SHAKESPEARE_GZ = DATA / "tiny_shakespeare.txt.gz"  # the whole corpus, gzipped (434 KB)


def tiny_shakespeare(directory: Path) -> Path:
    """``directory/tiny_shakespeare.txt``, the corpus the built-in run downloads, from the
    repository's copy (checked against the checksum the run checks it with)."""
    content = gzip.decompress(TINY_SHAKESPEARE_GZ.read_bytes())
    assert hashlib.sha256(content).hexdigest() == neox.data.TINY_SHAKESPEARE_SHA256
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / neox.data.TINY_SHAKESPEARE_FILE
    path.write_bytes(content)
    return path

# The big shared files, when present: the full corpus and the GPT-NeoX-20B tokenizer. CI hides
# them (NEOX_DATA_DIR pointing nowhere) for the main run, to prove the suite stands alone, and
# runs the tests marked shared_data separately with them visible.
SHARED_DATA_DIR = Path(os.environ.get("NEOX_DATA_DIR") or neox.data.default_data_dir())
SHAKESPEARE = SHARED_DATA_DIR / "tiny_shakespeare.txt"
NEOX_TOKENIZER = SHARED_DATA_DIR / "gpt-neox-20b-tokenizer.json"
shared_data = [pytest.mark.shared_data, pytest.mark.skipif(
    not (SHAKESPEARE.is_file() and NEOX_TOKENIZER.is_file()),
    reason=f"shared test data not found in {SHARED_DATA_DIR}")]


def with_shared_data(fn):
    """Marks a test that needs the shared data (and skips it when absent)."""
    for mark in shared_data:
        fn = mark(fn)
    return fn


# -- running the command-line tools ---------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 600


def cli_env() -> dict[str, str]:
    """The environment for a CLI subprocess: this checkout importable, and no torchrun variables
    (under torchrun neox.finetune would join that group instead of starting its own ranks)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(var, None)
    return env


def run_module(module: str, *args, timeout: float = CLI_TIMEOUT_S,
               **kwargs) -> subprocess.CompletedProcess:
    """``python -m module args...`` from the repository root, output captured."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def start_module(module: str, *args, **kwargs) -> subprocess.Popen:
    """The same, started in the background (its output in pipes)."""
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=REPO,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def assert_clean_error(proc: subprocess.CompletedProcess, phrase: str) -> None:
    """A non-zero exit, exactly one error line on stderr carrying ``phrase``, no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr
    assert phrase in errors[0], proc.stderr


def call_main(main, capture, *args) -> subprocess.CompletedProcess:
    """A tool's ``main(argv)`` in this process, its output read from the pytest capture fixture
    ``capture`` (capsys; capfd when the tool may start processes whose output matters). For
    checks that end before any process would start, a subprocess only adds its start-up."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors and --help
        code = e.code
    out, err = capture.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def run_losses(out: Path) -> list[float]:
    """The losses a neox.finetune run in ``out`` logged, step by step (its metrics file)."""
    return [json.loads(line)["loss"] for line in (out / METRICS).read_text().splitlines()
            if "loss" in json.loads(line)]


def gathered_mib(stdout: str) -> float:
    """The MiB a neox.finetune run all-gathered over its steps (its collectives table)."""
    return float(re.search(r"all-gather\s+([\d.]+)", stdout).group(1))
