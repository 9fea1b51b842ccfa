"""python -m neox.export rebuilds the fine-tuned model from a checkpoint alone: the same weights
as the run's own --export-hf, and with --lora separate an adapter that PEFT applies to the base to
give the merged model's logits."""

import glob

import pytest
import torch
from safetensors.torch import load_file

from neox import export
from tests.support.neox_testing import EXCERPT, call_main, run_module


def _export(*args):
    """``python -m neox.export ARGS`` in this process."""
    assert export.main([str(a) for a in args]) == 0


def _tensors(directory):
    out = {}
    for f in glob.glob(f"{directory}/*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    # A large learning rate so the adapters move far from their start (B = 0) in a few steps.
    proc = run_module("neox.finetune", "--finetune", "lora", "--max-steps", 3, "--lr", 0.05,
                      "--seq-len", 16, "--batch-size", 2, "--nproc", 2, "--export-hf",
                      "--filter-layers", "0,2", "--data", EXCERPT, "--cache-dir", tmp / "cache",
                      "--output-dir", tmp / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


@pytest.mark.e2e
def test_offline_export_equals_the_runs_own_export(lora_run):
    ckpt = lora_run / "run" / "checkpoints" / "step-00000003"
    _export(ckpt, lora_run / "merged")
    mine, theirs = _tensors(lora_run / "merged"), _tensors(lora_run / "run" / "hf")
    assert mine.keys() == theirs.keys() and not any("lora" in k for k in mine)
    for k in mine:
        # The same fp32 masters merged by the same function: bit for bit.
        assert torch.equal(mine[k], theirs[k]), k


@pytest.mark.e2e
def test_separate_adapter_applies_in_peft(lora_run):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    ckpt = lora_run / "run" / "checkpoints" / "step-00000003"
    _export(ckpt, lora_run / "separate", "--lora", "separate")
    merged = transformers.GPTNeoXForCausalLM.from_pretrained(lora_run / "run" / "hf").eval()
    base = transformers.GPTNeoXForCausalLM.from_pretrained(lora_run / "separate").eval()
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, plain = merged(ids).logits, base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, lora_run / "separate" / "adapter").eval()
        got = adapted(ids).logits
    assert (want - plain).abs().max() > 1e-2  # the adapters matter
    # fp32: W x + s B (A x) against (W + s B A) x, a different summation order.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_export_of_a_non_neox_checkpoint_is_a_clear_error(tmp_path, capsys):
    r = call_main(export.main, capsys, tmp_path / "none", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "none" in r.stderr


def _snapshot(root):
    """Every file under ``root`` with its bytes."""
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.e2e
@pytest.mark.parametrize("over, trainable_only", [
    *((over, only) for over in ("run", "checkpoint", "inside-checkpoint") for only in (0, 1)),
    ("tokenizer", 0)])  # (--trainable-only writes no tokenizer)
def test_an_export_onto_its_input_is_refused_and_deletes_nothing(lora_run, tmp_path, capsys,
                                                                 over, trainable_only):
    """neox.export RUN RUN --overwrite, CKPT CKPT --overwrite, an output inside the checkpoint,
    an output holding the --tokenizer given: one line, exit 2, every file as it was."""
    run = lora_run / "run"
    ckpt = run / "checkpoints" / "step-00000003"
    source, out, extra = {"run": (run, run, []), "checkpoint": (ckpt, ckpt, []),
                          "inside-checkpoint": (run, ckpt / "export", []),
                          "tokenizer": (ckpt, tmp_path, ["--tokenizer", tmp_path / "t.json"])
                          }[over]
    if over == "tokenizer":
        (tmp_path / "t.json").write_bytes((run / "tokenizer.json").read_bytes())
    before = _snapshot(run), _snapshot(tmp_path)
    r = call_main(export.main, capsys, source, out, "--overwrite", *extra,
                  *(["--trainable-only"] if trainable_only else []))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "choose an output directory outside it (nothing was written)" in r.stderr
    assert (_snapshot(run), _snapshot(tmp_path)) == before


def test_the_base_weights_are_inputs_too(tmp_path):
    """An output that holds the base weights (pretrained --checkpoint of the run) is refused
    like one that holds the checkpoint; one beside them, or inside the run's directory, is
    not."""
    from neox.run.export import refuse_output_over_inputs
    from neox.run.run_dir import OutputDirError

    run, base = tmp_path / "run", tmp_path / "models" / "pythia"
    ckpt = run / "checkpoints" / "step-00000003"
    for d in (ckpt, base):
        d.mkdir(parents=True)
    with pytest.raises(OutputDirError, match=r"models contains the base weights \("):
        refuse_output_over_inputs(tmp_path / "models", ckpt, {"the base weights": base})
    with pytest.raises(OutputDirError, match=r"pythia is the base weights \("):
        refuse_output_over_inputs(base, ckpt, {"the base weights": base})
    refuse_output_over_inputs(tmp_path / "models" / "exported", ckpt, {"the base weights": base})
    refuse_output_over_inputs(run / "exported", ckpt)
