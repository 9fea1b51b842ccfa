"""``neox.finetune --resume DSDIR``: a DeepSpeed ZeRO-3 run of a GPT-NeoX model continued by
neox, end to end on 2 gloo ranks, from the DeepSpeed fixtures of tests/fixtures/deepspeed (made
by DeepSpeed 0.19.8; no DeepSpeed needed here).

The fixtures' model (vocabulary 64, hidden 16, 2 blocks, rotary_pct 0.5) is no neox preset, so
it is given as pretrained weights: a Hugging Face directory of the run's initial model (the base
the DeepSpeed run started from: transformers' initialisation under seed 0, as make_fixtures.py
builds it), with a character tokenizer of fewer than 64 ids and a text of those characters.
- a full fine-tuning run resumed for 0 more steps saves the DeepSpeed run's state, bitwise:
  its trained weights (against zero_to_fp32's output), Adam's moments and step, the step count;
- a LoRA run continues 2 steps from the DeepSpeed run's step 3, with its optimizer settings;
- what the flags train must be what the DeepSpeed run trained (the refusal says which flags
  would), the LoRA alpha must be the run's, the base weights must be the run's, and a damaged
  DeepSpeed file is refused before any process starts; each in one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neox.run import from_deepspeed as nds
from neox.config import NeoXConfig
from neox.finetune import main as finetune_main
from neox.finetune_modes import FinetuneMode
from neox.model import layer_specs
from neox.run.run_dir import CHECKPOINTS, METRICS, TRAINABLE
from tests.support.deepspeed_files import CRAFT_FROM, CRAFTED, crafted_checkpoint
from tests.support.neox_testing import EXCERPT, assert_clean_error, call_main, run_module
from zerocore.checkpoint import open_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
SMALL = ["--cpu", "--seq-len", 8, "--batch-size", 2, "--sample-tokens", 0]
LORA_FLAGS = ["--finetune", "lora", "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets",
              "query_key_value,dense_4h_to_h"]


def info(name: str) -> dict:
    return json.loads((FIXTURES / name / "fixture.json").read_text())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The base model (and one of other weights), the tokenizer and the text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    base = tmp_path_factory.mktemp("neox-from-ds")
    config = info("full_fp32_ws2")["model_config"]
    for seed, where in ((0, "hf"), (1, "hf-other")):
        torch.manual_seed(seed)
        GPTNeoXForCausalLM(GPTNeoXConfig(**config)).save_pretrained(str(base / where))
    text = re.sub(r"[^a-z ]+", " ", EXCERPT.read_text().lower())
    (base / "corpus.txt").write_text(text)
    chars = sorted(set(text))
    assert len(chars) <= config["vocab_size"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.save(str(base / "tokenizer.json"))
    return {"hf": base / "hf", "hf-other": base / "hf-other", "cache": base / "cache",
            "corpus": base / "corpus.txt", "tokenizer": base / "tokenizer.json", "base": base}


def flags(inputs: dict[str, Path], name: str, out: Path, *extra) -> list:
    return [*SMALL, "--checkpoint", inputs["hf"], "--tokenizer", inputs["tokenizer"],
            "--data", inputs["corpus"], "--cache-dir", inputs["cache"], "--output-dir", out,
            "--resume", FIXTURES / name / "ckpt", *extra]


def names(name: str, mode: FinetuneMode) -> tuple[list, object]:
    """The neox layer specs of the fixture's model, and DeepSpeed's name of a neox parameter."""
    config = NeoXConfig.from_hf_dict({"model_type": "gpt_neox", **info(name)["model_config"]})
    specs = layer_specs(config)
    ckpt = nds.DeepSpeedCheckpoint(FIXTURES / name / "ckpt")
    return specs, nds.namer(ckpt, specs, mode)


@pytest.mark.e2e
def test_full_run_resumed_holds_deepspeeds_state(inputs, tmp_path):
    out = tmp_path / "out"
    proc = run_module("neox.finetune", *flags(inputs, "full_fp32_ws2", out, "--finetune", "full",
                                              "--max-steps", 3, "--nproc", 2))
    assert proc.returncode == 0, proc.stderr
    log = proc.stdout
    assert "resume: --lr 0.01: the DeepSpeed run's" in log
    assert "resume: --betas 0.9,0.95: the DeepSpeed run's" in log
    assert re.search(r"resumed the DeepSpeed run of \S+ at step 3 \(DeepSpeed 0\.19\.8, 2 ranks",
                     log), log
    assert "the sampler starts at the beginning of epoch 0" in log
    assert "training 0 steps" in log

    ref = load_file(str(FIXTURES / "full_fp32_ws2" / "zero_to_fp32.safetensors"))
    specs, ds_name = names("full_fp32_ws2", FinetuneMode("full"))
    trained = load_file(str(out / TRAINABLE))  # layers.<i>.<neox name>
    got = {ds_name(int(k.split(".")[1]), k.split(".", 2)[2]): v for k, v in trained.items()}
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k

    ckpt = out / CHECKPOINTS / "step-00000003"
    reader = open_checkpoint(ckpt)
    assert reader.manifest["step"] == 3
    ds = nds.DeepSpeedCheckpoint(FIXTURES / "full_fp32_ws2" / "ckpt")
    checked = 0
    for i in range(len(specs)):
        layout = reader.layout(i, "exp_avg")
        assert reader.rank_data(0)["layers"][i]["step"] == 3.0
        for what in ("exp_avg", "exp_avg_sq"):
            flat = reader.read(i, what, 0, layout.padded_numel)
            for s in layout.slots:
                want = ds.read(ds_name(i, s.name), what).reshape(-1)
                assert torch.equal(flat[s.offset:s.offset + s.numel], want), (i, s.name, what)
                checked += 1
    assert checked == 2 * len(ref)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["lora_fp32_ws2", "lora_bf16_ws2"])
def test_lora_run_continues(inputs, tmp_path, name):
    """In fp32 either way: a bf16 run's frozen copy is the base rounded to bf16, which the
    check accepts (the model's fp32 base rounds to it)."""
    out = tmp_path / "out"
    proc = run_module("neox.finetune", *flags(inputs, name, out, *LORA_FLAGS,
                                              "--max-steps", 5, "--nproc", 2))
    assert proc.returncode == 0, proc.stderr
    assert "at step 3" in proc.stdout and "training 2 steps" in proc.stdout
    lines = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [4, 5]
    # lr: the DeepSpeed run's (neox's default is 3e-4). The loss only has to be a sane number:
    # near ln 64 = 4.16 for a 64-token vocabulary (DeepSpeed's were 4.15-4.20); 10 is far above.
    assert all(r["lr"] == 0.01 and 0 < r["loss"] < 10 for r in steps)
    # The adapters moved on from the DeepSpeed run's; the rest was not trained.
    ref = load_file(str(FIXTURES / name / "zero_to_fp32.safetensors"))
    _, ds_name = names(name, FinetuneMode("lora", lora_rank=4, lora_alpha=8,
                                                      lora_targets=("query_key_value",
                                                                    "dense_4h_to_h")))
    trained = load_file(str(out / TRAINABLE))
    assert len(trained) == 8
    for k, v in trained.items():
        before = ref[ds_name(int(k.split(".")[1]), k.split(".", 2)[2])]
        assert v.shape == before.shape and not torch.equal(v, before), k


@pytest.mark.parametrize("name, extra, phrase", [
    ("full_fp32_ws2", ["--finetune", "lora"],
     "the flags (--finetune lora) train 8 parameters, the DeepSpeed run trained 28"),
    ("full_fp32_ws2", ["--finetune", "biases"], "give the model and mode the run trained: "
                                               "--finetune full"),
    ("lora_fp32_ws2", ["--finetune", "full"],
     "--finetune lora --lora-rank 4 --lora-alpha 8 --lora-targets dense_4h_to_h,query_key_value"),
    ("lora_fp32_ws2", [*LORA_FLAGS[:5], 16, *LORA_FLAGS[6:]],
     "the DeepSpeed run's LoRA alpha was 8 (its adapter_config.json), --lora-alpha 16 here"),
    ("lora_fp32_ws2", [*LORA_FLAGS, "--data-changed"],
     "--data-changed applies to a neox checkpoint"),
])
def test_refused_before_launch(inputs, tmp_path, capsys, name, extra, phrase):
    proc = call_main(finetune_main, capsys, *flags(inputs, name, tmp_path / "out", *extra))
    assert_clean_error(proc, phrase)
    assert not (tmp_path / "out").exists()


def test_damaged_deepspeed_file_refused_before_launch(inputs, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "full_fp32_ws2" / "ckpt", ckpt)
    f = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    args = flags(inputs, "full_fp32_ws2", tmp_path / "out", "--finetune", "full")
    args[args.index("--resume") + 1] = ckpt
    proc = call_main(finetune_main, capsys, *args)
    assert_clean_error(proc, f"--resume: {f}: not a complete torch file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_every_crafted_deepspeed_file_is_one_line_on_resume(inputs, tmp_path, capsys, case):
    """The fuzzed files of tests/support/deepspeed_files.py, as zerocore.from_deepspeed is
    tried on them (tests/checkpoints): refused before any process starts, in one line, exit 2,
    the output directory untouched."""
    ckpt = crafted_checkpoint(tmp_path, case)
    args = flags(inputs, CRAFT_FROM, tmp_path / "out", *LORA_FLAGS)
    args[args.index("--resume") + 1] = ckpt
    proc = call_main(finetune_main, capsys, *args)
    assert_clean_error(proc, f"--resume: {ckpt / 'global_step3'}")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "RecursionError" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_other_base_weights_refused(inputs, tmp_path):
    """LoRA over weights that are not the DeepSpeed run's base: the frozen weights the run
    trained against differ, found when the model is built; one line, nothing trained, and
    nothing that stands in the way of the corrected run."""
    out = tmp_path / "out"
    args = flags(inputs, "lora_fp32_ws2", out, *LORA_FLAGS, "--nproc", 1)
    args[args.index("--checkpoint") + 1] = inputs["hf-other"]
    proc = run_module("neox.finetune", *args)
    assert_clean_error(proc, "differs from the model's: the base weights given are not the ones "
                             "the DeepSpeed run trained on")
    assert not (out / CHECKPOINTS).exists() or not list((out / CHECKPOINTS).iterdir())
    # The corrected rerun needs no --overwrite: the refused run trained nothing there.
    args[args.index("--checkpoint") + 1] = inputs["hf"]
    proc = run_module("neox.finetune", *args, "--max-steps", 3)
    assert proc.returncode == 0, proc.stderr
    assert "which stopped before it trained a step" in proc.stdout
