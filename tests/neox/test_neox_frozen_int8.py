"""``--frozen-weights int8`` in neox.finetune and neox.plan: the run holds and gathers its frozen
weights in int8 (half the all-gather bytes of fp32's quarter, here in fp32: a quarter), learns
like the unquantized run, and its Hugging Face export carries the unquantized base weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from neox.plan import main as plan_main
from neox.run.run_dir import HF_EXPORT
from tests.support.neox_testing import (BPE512, EXCERPT, call_main, gathered_mib, run_losses,
                                        run_module)

RUN = ("--cpu", "--data", EXCERPT, "--tokenizer", BPE512, "--seq-len", 32, "--batch-size", 4,
       "--sample-tokens", 0, "--nproc", 2, "--finetune", "lora", "--max-steps", 4,
       "--export-hf")


def _export(out: Path) -> dict:
    tensors = {}
    for f in sorted((out / HF_EXPORT).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.e2e
def test_int8_run_learns_alike_gathers_less_and_exports_the_base(tmp_path):
    runs = {}
    for name, extra in (("compute", ()), ("int8", ("--frozen-weights", "int8"))):
        proc = run_module("neox.finetune", *RUN, "--cache-dir", tmp_path / "cache",
                          "--output-dir", tmp_path / name, *extra)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (proc.stdout, run_losses(tmp_path / name), gathered_mib(proc.stdout),
                      _export(tmp_path / name))
    plain, int8 = runs["compute"], runs["int8"]
    assert "frozen weights held and gathered in int8" in int8[0]
    # A quarter of fp32's bytes for the frozen weights (plus scales); the LoRA adapters stay
    # fp32 and are gathered too, so a little over a quarter in all.
    assert int8[2] < 0.3 * plain[2]
    # The quantization moves each frozen weight by at most half its block's scale; the losses
    # of this tiny random model move by far less than their own step-to-step change.
    assert len(int8[1]) == len(plain[1]) == 4
    for a, b in zip(int8[1], plain[1]):
        assert abs(a - b) < 0.02 * abs(b)
    # The export: the base's frozen weights exactly (unquantized); LoRA merged only where the
    # adapters were, which trained alike but not bitwise.
    frozen = [k for k in plain[3] if "dense_4h_to_h.weight" in k or "embed_in" in k]
    assert frozen
    for k in frozen:
        assert (int8[3][k] == plain[3][k]).all(), k


def test_plan_counts_int8(capsys):
    def planned(*extra):
        proc = call_main(plan_main, capsys, "--model", "pythia-70m", "--finetune", "lora",
                         "--gpus", "8", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["plan"]
    plain, int8 = planned(), planned("--frozen-weights", "int8")
    # bf16 on GPUs: the frozen shards and the gathers of frozen weights about halve
    assert 0.5 < (int8["state"]["parameter shards, frozen"]
                  / plain["state"]["parameter shards, frozen"]) < 0.55
    assert int8["all_gather_bytes"] < 0.56 * plain["all_gather_bytes"]
