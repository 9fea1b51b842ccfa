"""neox.run.recipe: the typed, versioned run recipe that checkpoints store, and the old form
(``vars(args)``) that checkpoints stored before it, still exported bit for bit."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerocore
from neox import export
from neox.commands.finetune import build_parser
from neox.commands.flags import explicit_flags
from neox.finetune_modes import FinetuneMode
from neox.run.recipe import (RECIPE_VERSION, DataConfig, LayoutConfig, ModelRecipe, OffloadConfig,
                             OptimConfig, OutputConfig, Recipe, RecipeError, ShardingConfig,
                             TrainingConfig, recipe_from_checkpoint, recipe_from_flags)
from neox.setting import UsageError, setting_of

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "recipe_v0_lora"


def _recipe() -> Recipe:
    return Recipe(
        model=ModelRecipe(checkpoint="/weights/pythia", preset="tiny", seed=3,
                          filter_layers=(0, 2, 5),
                          finetune=FinetuneMode("lora", lora_rank=4, lora_alpha=8.0,
                                                lora_targets=("query_key_value",), seed=3),
                          dtype="bf16"),
        data=DataConfig(data="/text.txt", seq_len=64, val_fraction=0.2),
        optim=OptimConfig(lr=1e-3, warmup=10, weight_decay=0.1, clip=0.5, betas=(0.8, 0.95),
                          eps=1e-6),
        training=TrainingConfig(batch_size=4, grad_accum=2, epochs=3, max_steps=100,
                                eval_every=10, seed=3),
        offload=OffloadConfig(offload_optimizer=True),
        output=OutputConfig(output_dir="out", save_every=5, keep_last=2, export_hf=True))


def test_round_trip_through_json():
    recipe = _recipe()
    stored = json.loads(json.dumps(recipe.to_dict()))
    assert stored["version"] == RECIPE_VERSION
    assert Recipe.from_dict(stored) == recipe


@pytest.mark.parametrize("edit, phrase", [
    (lambda d: d.update(version=99), "recipe.version: 99"),
    (lambda d: d.pop("optim"), "recipe.optim: missing"),
    (lambda d: d["optim"].update(lr="fast"), "recipe.optim: lr must be"),
    (lambda d: d["optim"].update(lr=float("inf")), "recipe.optim: lr must be"),
    (lambda d: d["loop"].update(batch_size=0), "recipe.loop: batch_size must be >= 1"),
    (lambda d: d["loop"].update(batch_size=True), "recipe.loop: batch_size must be >= 1"),
    (lambda d: d["model"].update(filter_layers=[0, -1]), "recipe.model: filter_layers"),
    (lambda d: d["model"]["finetune"].update(mode="everything"), "unknown fine-tuning mode"),
    (lambda d: d["model"]["finetune"].update(lora_rank=0), "LoRA rank must be"),
    (lambda d: d["data"].update(colour="red"), "recipe.data: unknown fields ['colour']"),
    (lambda d: d["output"].pop("keep_last"), "recipe.output: missing fields ['keep_last']"),
])
def test_from_dict_names_what_is_wrong(edit, phrase):
    d = _recipe().to_dict()
    edit(d)
    with pytest.raises(RecipeError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        Recipe.from_dict(d)


def test_flags_become_the_recipe():
    argv = ["--finetune", "lora", "--lora-targets", "query_key_value, dense_4h_to_h",
            "--lr", "0.01", "--betas", "0.8", "0.9", "--seed", "7", "--batch-size", "3"]
    args = build_parser().parse_args(argv)
    recipe = recipe_from_flags(vars(args), {"filter_layers": (1,)})
    assert recipe.model.finetune == FinetuneMode("lora", lora_targets=("query_key_value",
                                                                       "dense_4h_to_h"), seed=7)
    assert recipe.model.filter_layers == (1,) and recipe.training.seed == 7
    assert recipe.optim.lr == 0.01 and recipe.optim.betas == (0.8, 0.9)
    assert recipe.training.batch_size == 3
    assert explicit_flags(build_parser(), argv) == {"finetune", "lora_targets", "lr", "betas",
                                                    "seed", "batch_size"}


def test_the_recipe_is_what_the_checkpoint_stores_not_the_flags():
    # A checkpoint's recipe reads back whatever the flags are called now.
    recipe = _recipe()
    extra = {"recipe": recipe.to_dict(), "config": {"vocab_size": 64, "hidden_size": 8,
                                                    "num_hidden_layers": 6,
                                                    "num_attention_heads": 2,
                                                    "intermediate_size": 16}}
    got, config = recipe_from_checkpoint(extra, "ckpt")
    assert got == recipe and config.num_hidden_layers == 6
    with pytest.raises(RecipeError, match="ckpt: not a checkpoint of neox.finetune"):
        recipe_from_checkpoint({"step": 3}, "ckpt")


def test_old_checkpoints_read_as_a_recipe():
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    recipe, config = recipe_from_checkpoint(manifest["extra"], "fixture")
    assert recipe.model == ModelRecipe(
        checkpoint=None, preset="tiny", seed=5, filter_layers=(0, 2),
        finetune=FinetuneMode("lora", lora_rank=2, lora_alpha=16.0,
                              lora_targets=("query_key_value", "dense_4h_to_h"), seed=5))
    assert recipe.training.max_steps == 3 and recipe.data.seq_len == 32
    assert config.vocab_size == 1664
    broken = dict(manifest["extra"], args=dict(manifest["extra"]["args"]))
    del broken["args"]["lora_targets"]
    with pytest.raises(RecipeError, match="'lora_targets' is missing"):
        recipe_from_checkpoint(broken, "fixture")


def _digests(directory: Path) -> dict[str, str]:
    out = {}
    files = sorted(glob.glob(f"{directory}/*.safetensors")) + sorted(
        glob.glob(f"{directory}/adapter/*.safetensors"))
    for f in files:
        for k, t in load_file(f).items():
            out[k] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()
                                    .tobytes()).hexdigest()
    return out


@pytest.mark.parametrize("lora", ["merged", "separate"])
def test_a_checkpoint_from_before_the_recipe_still_exports_bit_for_bit(tmp_path, capsys,
                                                                        lora):
    # The fixture was written by neox.finetune before the recipe existed; its export then was
    # recorded tensor by tensor (tests/fixtures/recipe_v0_lora/README.md).
    ckpt = tmp_path / "step-00000003"
    shutil.copytree(FIXTURE, ckpt)
    want = json.loads((FIXTURE / "export_sha256.json").read_text())[lora]
    # Format 1 cannot be verified (its rank files do not record whose they are): refused in
    # one line that says how to opt in, then exported as asked.
    assert export.main([str(ckpt), str(tmp_path / "refused"), "--lora", lora]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be verified" in err and "--allow-unverified" in err
    assert not (tmp_path / "refused").exists()
    assert export.main([str(ckpt), str(tmp_path / "out"), "--lora", lora,
                        "--allow-unverified"]) == 0
    assert "cannot be verified (format 1" in capsys.readouterr().out
    assert _digests(tmp_path / "out") == want


def test_a_flag_declared_once_reaches_the_recipe_and_its_checks():
    # --sample-temperature is one declaration (OutputConfig.sample_temperature) and its use.
    args = build_parser().parse_args(["--finetune", "full", "--sample-temperature", "0"])
    assert recipe_from_flags(vars(args)).output.sample_temperature == 0.0
    assert Recipe().output.sample_temperature == 0.8 and RECIPE_VERSION >= 3
    bad = build_parser().parse_args(["--finetune", "full", "--sample-temperature", "-1"])
    with pytest.raises(ValueError, match=r"^--sample-temperature must be a finite number >= 0"):
        recipe_from_flags(vars(bad))
    # Recipes of version 2 (before it) load with the temperature runs had then.
    d = Recipe().to_dict()
    del d["output"]["sample_temperature"]
    with pytest.raises(RecipeError, match=r"missing fields \['sample_temperature'\]"):
        Recipe.from_dict(d)
    d["version"] = 2
    assert Recipe.from_dict(d).output.sample_temperature == 0.8


def test_compile_is_one_declaration_too():
    # --compile (ShardingConfig.compile): the flag, the recipe, version 4; older recipes run eager.
    args = build_parser().parse_args(["--finetune", "full", "--compile"])
    assert recipe_from_flags(vars(args)).sharding.compile is True
    assert Recipe().sharding.compile is False and RECIPE_VERSION >= 4
    d = Recipe().to_dict()
    del d["loop"]["compile"]
    d["version"] = 3
    assert Recipe.from_dict(d).sharding.compile is False


def test_offload_is_one_declaration_too():
    # --offload (OffloadConfig.offload): the flag, the recipe, version 5; older recipes offload
    # what their --offload-optimizer said, which keeps its meaning beside it.
    def loop(*flags):
        return recipe_from_flags(vars(build_parser().parse_args(["--finetune", "full",
                                                                 *flags]))).offload
    assert (loop("--offload", "params").offloaded_params,
            loop("--offload", "params").offloaded_optimizer) == (True, False)
    assert (loop("--offload", "all").offloaded_params,
            loop("--offload", "all").offloaded_optimizer) == (True, True)
    assert (loop("--offload-optimizer").offloaded_params,
            loop("--offload-optimizer").offloaded_optimizer) == (False, True)
    assert (loop().offloaded_params, loop().offloaded_optimizer) == (False, False)
    assert RECIPE_VERSION >= 5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--offload", "disk"])
    d = Recipe().to_dict()
    d["loop"]["offload"] = "disk"
    with pytest.raises(RecipeError, match="recipe.loop: offload must be one of"):
        Recipe.from_dict(d)
    del d["loop"]["offload"]
    d["version"], d["loop"]["offload_optimizer"] = 4, True
    assert Recipe.from_dict(d).offload.offloaded_optimizer is True
    assert Recipe.from_dict(d).offload.offload is None


def test_recipe_parts_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _recipe().optim.lr = 1.0  # type: ignore[misc]


def test_the_layout_is_one_declaration_too():
    # --hybrid and --quantize-gradients (LayoutConfig.hybrid, .quantize_gradients): the words,
    # the recipe, version 6; older recipes were flat, their gradients exact.
    def loop(*flags):
        return recipe_from_flags(vars(build_parser().parse_args(["--finetune", "full",
                                                                 *flags]))).layout
    assert (loop().hybrid, loop().quantize_gradients) == (None, None)
    assert (loop("--hybrid", "none").hybrid, loop("--hybrid", "hsdp").hybrid) == (None, "hsdp")
    assert loop("--quantize-gradients", "int8").quantize_gradients == "int8"
    assert loop("--quantize-gradients", "none").quantize_gradients is None
    assert RECIPE_VERSION >= 6
    for flag in ("--hybrid", "--quantize-gradients"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([flag, "int4"])
    d = Recipe(layout=LayoutConfig(hybrid="hsdp", quantize_gradients="int8")).to_dict()
    assert Recipe.from_dict(json.loads(json.dumps(d))).layout == \
        LayoutConfig(hybrid="hsdp", quantize_gradients="int8")
    d["loop"]["hybrid"] = "ring"
    with pytest.raises(RecipeError, match=r"recipe.loop: hybrid must be null \(flat\) or one of"):
        Recipe.from_dict(d)
    del d["loop"]["hybrid"], d["loop"]["quantize_gradients"]
    with pytest.raises(RecipeError, match=r"missing fields \['hybrid', 'quantize_gradients'\]"):
        Recipe.from_dict(d)
    d["version"] = 5
    assert (Recipe.from_dict(d).layout.hybrid, Recipe.from_dict(d).layout.quantize_gradients) == \
        (None, None)


@pytest.mark.parametrize("path", ["", " "])
def test_an_empty_offload_path_is_refused_in_one_line(capsys, path):
    # Issue 40, item 5: Path("") is the working directory, which an empty --offload-path (an
    # unset variable in a script) never meant; the scratch went there.
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--offload", "optimizer", "--offload-device", "nvme",
                                   "--offload-path", path])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --offload-path: must be a path, got {path!r}" in err, err
    assert "Traceback" not in err
    # A stored recipe holding one is refused too.
    with pytest.raises(RecipeError, match="offload_path must be a directory"):
        OffloadConfig(offload_path=path)


def test_the_offload_device_path_and_pool_are_declarations_too():
    # --offload-device, --offload-path, --offload-pool (OffloadConfig, version 7): parsed, checked
    # together, stored, mapped onto zerocore.Offload; recipes of version 6 load offloading to
    # host memory, as their runs did.
    def loop(*flags):
        return recipe_from_flags(vars(build_parser().parse_args(["--finetune", "full",
                                                                 *flags]))).offload
    nvme = loop("--offload", "all", "--offload-device", "nvme", "--offload-path", "scratch",
                "--offload-pool", "64MiB")
    assert nvme.offload_path == str(Path("scratch").resolve()) and nvme.offload_pool == 2**26
    assert nvme.policies()["offload"] == zerocore.Offload(
        optimizer="nvme", params="nvme", path=str(Path("scratch").resolve()), pool_bytes=2**26)
    assert nvme.problem(for_a_run=True) is None
    cpu = loop("--offload", "optimizer")
    # The pool's default is auto (None: zerocore.Offload chooses it from the hosts' memory).
    assert (cpu.offload_device, cpu.offload_pool) == ("cpu", None)
    assert cpu.policies()["offload"] == zerocore.Offload(optimizer=True)
    assert RECIPE_VERSION >= 7
    assert loop("--offload-device", "nvme").problem(for_a_run=False) == (
        "--offload-device nvme: nothing is offloaded; add --offload optimizer (the fp32 masters "
        "and Adam moments on NVMe), params or all")
    no_path = loop("--offload-optimizer", "--offload-device", "nvme")
    assert no_path.problem(for_a_run=False) is None  # a plan writes nothing
    assert "needs --offload-path DIR" in no_path.problem(for_a_run=True)
    with pytest.raises(UsageError, match="--offload-pool must be 'auto' .null. or a size of "
                                         "at least 49152"):
        loop("--offload-pool", "1KiB")
    assert loop("--offload-pool", "auto").offload_pool is None
    with pytest.raises(SystemExit):   # "all" is a budget's word, not a pool's
        build_parser().parse_args(["--offload-pool", "all"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--offload-device", "disk"])
    d = Recipe().to_dict()
    for name in ("offload_device", "offload_path", "offload_pool"):
        del d["loop"][name]
    d["version"] = 6
    old = Recipe.from_dict(d).offload
    assert (old.offload_device, old.offload_path) == ("cpu", None)


def test_the_offload_overlap_is_a_declaration_too():
    # --offload-overlap exact|delayed|off (OffloadConfig, version 9): parsed, stored, mapped onto
    # zerocore.Offload(overlap=); said on the run's model line; recipes of version 8 load as
    # "exact" (the same bits as their runs'), and a resume may change it.
    def offload(*flags):
        return recipe_from_flags(vars(build_parser().parse_args(["--finetune", "full",
                                                                 *flags]))).offload
    exact = offload("--offload", "optimizer")
    assert exact.offload_overlap == "exact"
    assert exact.policies()["offload"] == zerocore.Offload(optimizer=True, overlap="exact")
    assert "the optimizer's pass overlaps the next forward (exact)" in exact.words()
    off = offload("--offload", "optimizer", "--offload-overlap", "off")
    assert off.policies()["offload"].overlap == "off"
    assert "the optimizer's pass runs inside its step (not overlapped)" in off.words()
    delayed = offload("--offload", "optimizer", "--offload-overlap", "delayed")
    assert delayed.policies()["offload"] == zerocore.Offload(optimizer=True, overlap="delayed")
    assert "the optimizer's pass is one step delayed" in delayed.words()
    assert "pass" not in offload("--offload", "params").words()  # nothing of the optimizer's
    nvme_params = offload("--offload", "all", "--offload-device", "nvme", "--offload-path", "s")
    assert "not overlapped" in nvme_params.words()  # (zerocore.Offload.overlaps)
    assert not nvme_params.policies()["offload"].overlaps
    assert setting_of(next(f for f in dataclasses.fields(OffloadConfig)
                           if f.name == "offload_overlap")).flag.resumable
    assert RECIPE_VERSION >= 9
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--offload-overlap", "later"])
    d = Recipe().to_dict()
    del d["loop"]["offload_overlap"]
    d["version"] = 8
    assert Recipe.from_dict(d).offload.offload_overlap == "exact"


def test_the_frozen_format_and_placement_are_declarations_too():
    # --frozen-weights {compute,int8,nf4,fp8} and --frozen-placement (ShardingConfig, version
    # 8): parsed, stored, mapped onto zerocore.FrozenWeights; recipes of version 7 load sharded,
    # as their runs were; replicated without a quantized format is refused in one line.
    def sharding(*flags):
        return recipe_from_flags(vars(build_parser().parse_args(["--finetune", "lora",
                                                                 *flags]))).sharding
    plain = sharding()
    assert (plain.frozen_weights, plain.frozen_placement) == (None, "sharded")
    assert sharding("--frozen-weights", "compute").frozen_weights is None
    for fmt in ("int8", "nf4", "fp8"):
        s = sharding("--frozen-weights", fmt, "--frozen-placement", "replicated")
        assert s.frozen_quantized and s.problem(offload="optimizer", offload_device="cpu") is None
        assert s.policies(dtype=torch.float32, specs=[])["frozen_weights"] == \
            zerocore.FrozenWeights(fmt, placement="replicated")
    assert not plain.frozen_quantized
    unquantized = sharding("--frozen-placement", "replicated")
    assert unquantized.problem(offload=None, offload_device="cpu") == (
        "--frozen-placement replicated holds the whole quantized frozen base on every rank: add "
        "--frozen-weights nf4, fp8 or int8, or leave it sharded")
    assert RECIPE_VERSION >= 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--frozen-weights", "auto"])
    # --frozen-placement auto is a word of the commands, which resolve it (neox.run.
    # layout_choice): a recipe never holds it.
    assert build_parser().parse_args(["--frozen-placement", "auto"]).frozen_placement == "auto"
    with pytest.raises(UsageError, match="--frozen-placement must be one of"):
        sharding("--frozen-placement", "auto")
    d = Recipe(sharding=ShardingConfig(frozen_weights="fp8", frozen_placement="replicated")
               ).to_dict()
    assert Recipe.from_dict(json.loads(json.dumps(d))).sharding.frozen_placement == "replicated"
    del d["loop"]["frozen_placement"]
    d["version"] = 7
    assert Recipe.from_dict(d).sharding.frozen_placement == "sharded"
