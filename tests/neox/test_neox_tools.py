"""The command-line tools work on each other's outputs, offline: a fine-tuning run's output
directory, its checkpoints and their exports are accepted by neox.evaluate, neox.generate and
neox.export; every flag an error message tells the user to pass exists."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from neox import evaluate, export
from neox.commands.finetune import build_parser as finetune_parser
from neox.generate import main as generate_main
from neox.run.run_dir import CHECKPOINTS, METRICS, TOKENIZER
from tests.support.neox_testing import (EXCERPT, REPO, call_main, run_module,
                                        tiny_shakespeare)
from tests.support.small_disk import small_disk  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A short run of the built-in default (from scratch) on the excerpt, 2 ranks."""
    root = tmp_path_factory.mktemp("run")
    proc = run_module("neox.finetune", "--cpu", "--data", EXCERPT, "--cache-dir", root / "cache",
                      "--seq-len", 32, "--batch-size", 4, "--max-steps", 6, "--output-dir",
                      root / "out", "--sample-tokens", 0)
    assert proc.returncode == 0, proc.stderr
    return root / "out"


def _val_loss(out: Path) -> float:
    lines = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    return [r for r in lines if "val_loss" in r][-1]["val_loss"]


@pytest.mark.e2e
def test_evaluate_a_run_on_its_own_validation_windows(run, capsys):
    proc = call_main(evaluate.main, capsys, "--checkpoint", run, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["text"] == "the run's validation windows"
    assert result["corpus"] == str(EXCERPT) and result["checked_against_the_run"] is True
    assert "step-00000006" in result["model"]
    # The same fp32 weights and windows, unsharded here and sharded over 2 ranks in the run:
    # only the order of float additions differs (a few ulps of the mean loss).
    assert result["loss"] == pytest.approx(_val_loss(run), rel=1e-5)


def _loaded(tmp_path, data, sha):
    """What neox.evaluate knows of a run whose recipe reads ``data`` (None: tiny_shakespeare,
    from a cache and a data directory of this test) and whose checkpoint recorded ``sha``."""
    from neox.run.inference import Loaded
    from neox.run.recipe import DataConfig, Recipe

    recipe = Recipe(data=DataConfig(data=data, cache_dir=str(tmp_path / "cache"),
                                    data_dir=str(tmp_path / "data")))
    return Loaded(None, None, None, "RUN/checkpoints/step-00000006", recipe, sha)


def test_evaluate_refuses_a_run_text_that_changed(tmp_path):
    from neox.data import load_corpus
    from neox.run.evaluation import run_corpus

    text = tmp_path / "notes.txt"
    text.write_text("the text the run trained on\n" * 50)
    sha = load_corpus(text, cache_dir=tmp_path, data_dir=None, log=lambda *a: None).sha256
    assert run_corpus(_loaded(tmp_path, str(text), sha)).sha256 == sha
    text.write_text("another text\n" * 50)
    with pytest.raises(ValueError, match=r"the run of RUN/checkpoints/step-00000006 trained on "
                                         r"a text with sha256 \w{12}\.\.\., and .*notes.txt "
                                         r"\(sha256 \w{12}\.\.\.\) is another"):
        run_corpus(_loaded(tmp_path, str(text), sha))


def test_evaluate_finds_the_offline_fallback_a_run_trained_on(tmp_path):
    """The run fell back to the pydoc texts offline; this machine's cache now holds
    tiny_shakespeare: the run's own text is the fallback, not the corpus found."""
    from neox.data import offline_corpus
    from neox.run.evaluation import run_corpus

    tiny_shakespeare(tmp_path / "cache")
    fallback = offline_corpus()
    assert run_corpus(_loaded(tmp_path, None, fallback.sha256)).text == fallback.text
    found = run_corpus(_loaded(tmp_path, None, None))  # no digest recorded: what is there
    assert found.name == "tiny_shakespeare"
    with pytest.raises(ValueError, match="is another"):
        run_corpus(_loaded(tmp_path, None, "0" * 64))


@pytest.mark.e2e
def test_evaluate_says_which_text_and_refuses_another(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    shutil.copy(EXCERPT, text)
    out = tmp_path / "out"
    proc = run_module("neox.finetune", "--cpu", "--data", text, "--cache-dir", tmp_path / "c",
                      "--seq-len", 16, "--batch-size", 2, "--max-steps", 2, "--output-dir", out,
                      "--sample-tokens", 0, "--nproc", 1)
    assert proc.returncode == 0, proc.stderr
    proc = call_main(evaluate.main, capsys, "--checkpoint", out)
    assert proc.returncode == 0, proc.stderr
    assert f"tokens of the run's validation windows: {text} (sha256 " in proc.stdout
    assert "the text the run trained on (its sha256 checked)" in proc.stdout
    text.write_text(text.read_text().upper())
    proc = call_main(evaluate.main, capsys, "--checkpoint", out)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{text} (sha256 " in proc.stderr and "is another" in proc.stderr


@pytest.mark.e2e
def test_generate_from_a_run_and_from_one_of_its_checkpoints(run, capsys):
    for where in (run, run / CHECKPOINTS / "step-00000006"):
        proc = call_main(generate_main, capsys, "--checkpoint", where, "--prompt", "ROMEO:",
                         "--max-new-tokens", 8)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("ROMEO:")


@pytest.mark.e2e
def test_the_built_in_runs_output_is_the_default(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = call_main(generate_main, capsys, "--max-new-tokens", 4)
    assert proc.returncode == 2
    assert "pass --checkpoint DIR" in proc.stderr and "--model PRESET" in proc.stderr
    shutil.copytree(run, tmp_path / "runs" / "neox-finetune")
    proc = call_main(generate_main, capsys, "--prompt", "To be", "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("To be")


@pytest.mark.e2e
def test_an_export_carries_the_tokenizer_and_the_tools_accept_it(run, tmp_path, capsys):
    ckpt = run / CHECKPOINTS / "step-00000006"
    assert call_main(export.main, capsys, ckpt, tmp_path / "hf").returncode == 0
    assert (tmp_path / "hf" / TOKENIZER).read_bytes() == (run / TOKENIZER).read_bytes()
    proc = call_main(evaluate.main, capsys, EXCERPT, "--checkpoint", tmp_path / "hf",
                     "--seq-len", 32, "--max-windows", 4, "--json")
    assert proc.returncode == 0, proc.stderr
    proc = call_main(generate_main, capsys, "--checkpoint", tmp_path / "hf", "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr
    # Moved away from its run, the checkpoint exports without a tokenizer and says so.
    lone = Path(shutil.copytree(ckpt, tmp_path / "elsewhere" / "a" / "step-00000006"))
    (run / TOKENIZER).rename(run / "tokenizer.moved")
    try:
        proc = call_main(export.main, capsys, lone, tmp_path / "bare")
    finally:
        (run / "tokenizer.moved").rename(run / TOKENIZER)
    assert proc.returncode == 0 and "pass --tokenizer FILE" in proc.stdout
    assert not (tmp_path / "bare" / TOKENIZER).exists()


@pytest.mark.e2e
def test_trainable_only_export_uses_the_models_own_names(run, tmp_path, capsys):
    ckpt = run / CHECKPOINTS / "step-00000006"
    proc = call_main(export.main, capsys, ckpt, tmp_path / "t", "--trainable-only")
    assert proc.returncode == 0, proc.stderr
    trained = load_file(tmp_path / "t" / "trainable.safetensors")
    assert call_main(export.main, capsys, ckpt, tmp_path / "hf").returncode == 0
    full = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        full.update(load_file(f))
    # From scratch every weight is trained: the same names as the Hugging Face export, and the
    # same fp32 masters.
    assert sorted(trained) == sorted(full)
    assert all(n.startswith(("gpt_neox.", "embed_out.")) for n in trained)


# -- every flag an error message suggests exists -------------------------------------------------

def _flags_of(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


# "pass --tokenizer FILE", "use --trainable-only", "resume it with --resume", "or --overwrite": a
# flag named as advice.
SUGGESTION = re.compile(r"(?:pass|use|with|give|or)\s+(--[a-z][a-z0-9-]*)")


def test_every_flag_an_error_message_suggests_exists(capsys):
    # The flags every tool documents in --help.
    helps = []
    for tool, main in _tool_mains().items():
        if tool == "neox.finetune":
            continue  # its parser is read whole below
        try:
            main(["--help"])
        except SystemExit:
            pass
        helps.append(capsys.readouterr().out)
    known = _flags_of(finetune_parser()) | set(re.findall(r"--[a-z][a-z0-9-]*", "\n".join(helps)))
    suggested = {}
    for path in sorted((REPO / "neox").rglob("*.py")) + sorted((REPO / "zerocore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in SUGGESTION.findall(node.value):
                    suggested.setdefault(flag, f"{path.relative_to(REPO)}:{node.lineno}")
    assert suggested, "the pattern finds the suggestions"
    unknown = {flag: where for flag, where in suggested.items() if flag not in known}
    assert not unknown, f"messages suggest flags no tool has: {unknown}"


# -- every writer on a full disk: one line naming the path and the reason -------------------------
# (The checkpoint writer's own full-disk tests are in test_checkpoint_manifest.py.)

def _one_error_line(proc, path_prefix: str, reason: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: cannot write {path_prefix}"), lines[0]
    assert lines[0].endswith(reason), lines[0]


def _leftovers(root: Path) -> list[str]:
    """Temporary files or directories a failed write left behind."""
    return sorted(p.name for p in root.rglob("*") if ".tmp" in p.name or ".partial" in p.name)


@pytest.mark.e2e
def test_export_on_a_full_disk_is_one_line(run, small_disk, capsys):
    ckpt = run / CHECKPOINTS / "step-00000006"
    for extra in ((), ("--trainable-only",), ("--lora", "separate")):
        out = small_disk.root / "hf"
        with small_disk.full():
            proc = call_main(export.main, capsys, ckpt, out, *extra)
        _one_error_line(proc, str(out), small_disk.reason)
        assert _leftovers(small_disk.root) == [], extra


@pytest.mark.e2e
def test_an_export_that_fails_leaves_the_earlier_one(run, small_disk, capsys):
    from safetensors.torch import save_file
    import torch
    out = small_disk.root / "t"
    out.mkdir()
    save_file({"x": torch.ones(4)}, str(out / "trainable.safetensors"))
    before = (out / "trainable.safetensors").read_bytes()
    with small_disk.full():
        proc = call_main(export.main, capsys, run / CHECKPOINTS / "step-00000006", out,
                         "--trainable-only", "--overwrite")
    _one_error_line(proc, str(out / "trainable.safetensors"), small_disk.reason)
    assert (out / "trainable.safetensors").read_bytes() == before
    assert _leftovers(small_disk.root) == []


@pytest.mark.e2e
def test_consolidate_on_a_full_disk_is_one_line(run, small_disk, capsys):
    from zerocore import consolidate
    for extra in ((), ("--trainable-only",)):
        out = small_disk.root / "out"
        with small_disk.full():
            proc = call_main(consolidate.main, capsys, run / CHECKPOINTS, out, *extra)
        _one_error_line(proc, str(small_disk.root / ".out.tmp-")
                        if extra else str(out), small_disk.reason)
        assert not out.exists() and _leftovers(small_disk.root) == [], extra


def test_the_runs_trainable_file_on_a_full_disk_keeps_the_earlier_one(small_disk):
    """save_trainable is what a run writes at its end (neox.run.save.write_trainable)."""
    import torch
    from zerocore.checkpoint import CheckpointWriteError
    from zerocore.consolidate import save_trainable
    path = small_disk.root / "trainable.safetensors"
    save_trainable(path, [(0, {"bias": torch.ones(3)})])
    before = path.read_bytes()
    with small_disk.full(), pytest.raises(CheckpointWriteError) as raised:
        save_trainable(path, [(0, {"weight": torch.ones(64, 1024)})])
    assert str(raised.value) == f"cannot write {path}: {small_disk.reason}"
    assert path.read_bytes() == before and _leftovers(small_disk.root) == []


def test_metrics_on_a_full_disk_is_one_line(small_disk):
    from neox.run.run_dir import MetricsFile, OutputDirError
    metrics = MetricsFile(small_disk.root / METRICS, resume_step=None)
    metrics.write({"step": 1, "loss": 1.0})
    with small_disk.full(), pytest.raises(OutputDirError) as raised:
        metrics.write({"step": 2, "note": "x" * (2 * 65536)})
    assert str(raised.value) == f"cannot write {small_disk.root / METRICS}: {small_disk.reason}"
    assert (small_disk.root / METRICS).read_text().splitlines()[0] == \
        '{"step": 1, "loss": 1.0}'


def test_write_error_takes_any_librarys_exception(tmp_path):
    """safetensors keeps only the text of the OS error; torch's zip writer not even that."""
    from safetensors import SafetensorError
    from zerocore.checkpoint.durable_io import write_error
    e = SafetensorError("Error while serializing: I/O error: No space left on device "
                        "(os error 28)")
    made = write_error("write", tmp_path / "x", e)
    assert isinstance(made, OSError) and made.errno == 28
    assert str(made) == f"cannot write {tmp_path / 'x'}: [Errno 28] No space left on device"
    made = write_error("write", tmp_path / "y", RuntimeError("[enforce fail at inline_container"
                                                             ".cc:626] . unexpected pos 64\nmore"))
    assert str(made) == (f"cannot write {tmp_path / 'y'}: RuntimeError: [enforce fail at "
                         f"inline_container.cc:626] . unexpected pos 64")
    assert write_error("write", tmp_path / "z", made) is made


# -- the edges of neox.evaluate and neox.generate: one line each ----------------------------------

def _one_line_error(proc, phrase: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("main", [evaluate.main, generate_main], ids=["evaluate", "generate"])
def test_a_device_that_is_not_there_is_one_line(run, main, capsys):
    proc = call_main(main, capsys, "--checkpoint", run, "--device", "tpu")
    _one_line_error(proc, "--device tpu: not a device these tools run on; use cpu, cuda")
    import torch
    if not torch.cuda.is_available():
        proc = call_main(main, capsys, "--checkpoint", run, "--device", "cuda")
        _one_line_error(proc, "--device cuda: " + ("this torch" if torch.version.cuda is None
                                                   else "no CUDA GPU is visible"))


@pytest.mark.e2e
def test_evaluate_refuses_windows_beyond_the_models_positions(run, capsys):
    from neox.run.trained import run_checkpoint, run_settings
    positions = run_settings(run_checkpoint(run))[1].max_position_embeddings
    proc = call_main(evaluate.main, capsys, EXCERPT, "--checkpoint", run, "--seq-len",
                     positions + 1)
    _one_line_error(proc, f"--seq-len {positions + 1} exceeds the model's {positions} positions")


@pytest.mark.e2e
def test_a_negative_temperature_is_refused(run, capsys):
    proc = call_main(generate_main, capsys, "--checkpoint", run, "--temperature", "-0.5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --temperature: must be >= 0, got -0.5" in proc.stderr
    from neox.run.sampling import choose_token
    import torch
    with pytest.raises(ValueError, match="must be >= 0"):
        choose_token(torch.zeros(1, 4), temperature=-1.0, top_k=0, generator=None)


# -- every flag of every tool is documented -------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(main, monkeypatch):
    """The parser a tool's main builds (stopped as it parses, before it does anything)."""
    import argparse

    def capture(self, *args, **kwargs):
        raise _Parsed(self)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        try:
            main([])
        except _Parsed as got:
            return got.parser
    raise AssertionError(f"{main} parsed no arguments")


def _tool_mains():
    from neox import finetune, plan
    from zerocore import __main__ as zerocore_main, consolidate, from_deepspeed, selftest
    return {"neox.finetune": finetune.main, "neox.evaluate": evaluate.main,
            "neox.generate": generate_main, "neox.export": export.main, "neox.plan": plan.main,
            "zerocore": zerocore_main.main, "zerocore.consolidate": consolidate.main,
            "zerocore.from_deepspeed": from_deepspeed.main, "zerocore.selftest": selftest.main}


def test_every_flag_of_every_tool_has_help_and_neox_shows_defaults(monkeypatch):
    import argparse
    from neox.commands.flags import HelpFormatter
    undocumented, no_default = [], []
    for tool, main in _tool_mains().items():
        parser = _parser_of(main, monkeypatch)
        for action in parser._actions:
            name = "/".join(action.option_strings) or action.dest
            if not action.help or action.help == argparse.SUPPRESS:
                undocumented.append(f"{tool} {name}")
            if tool.startswith("neox.") and action.option_strings and action.default not in (
                    None, False, argparse.SUPPRESS):
                # neox's formatter adds "(default: ...)" unless the help says it already.
                shown = HelpFormatter("x")._get_help_string(action) \
                    if issubclass(parser.formatter_class, HelpFormatter) else action.help
                if "default" not in shown:
                    no_default.append(f"{tool} {name}")
    assert not undocumented, f"flags without help: {undocumented}"
    assert not no_default, f"flags whose --help does not show their default: {no_default}"


def test_python_m_zerocore_has_help(capsys):
    from zerocore.__main__ import main
    proc = call_main(main, capsys, "--help")
    assert proc.returncode == 0 and "usage: python -m zerocore" in proc.stdout
    assert "zerocore._C" not in proc.stdout  # --help only: nothing was run
