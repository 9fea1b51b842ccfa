"""The stored recipe kept its form when the recipe was split by concern (issue 42, item 3): a
checkpoint's recipe as the neox before the split wrote it (version 7, sections model, data,
optim, loop, output) reads into the parts by concern, and this neox writes back exactly that
form, so that a run written now resumes in the neox before the split too."""

from __future__ import annotations

import json

import pytest

from neox.run.recipe import (LayoutConfig, OffloadConfig, Recipe, RecipeError, ShardingConfig,
                             TrainingConfig)

# Recipe(...).to_dict() of the neox before the split (commit 908ad0b), every moved field given
# a value other than its default.
BEFORE_THE_SPLIT = json.loads("""
{"version": 7,
 "model": {"checkpoint": null, "preset": "tiny", "filter_layers": null,
           "allow_outside_weights": false, "dtype": null, "seed": 3,
           "finetune": {"mode": "biases", "lora_rank": 8, "lora_alpha": 16.0,
                        "lora_targets": ["query_key_value", "attention.dense"], "seed": 0},
           "reduce_dtype": "bf16", "frozen_weights": "int8"},
 "data": {"data": null, "data_dir": null, "tokenizer": null, "cache_dir": null, "seq_len": 128,
          "val_fraction": 0.1},
 "optim": {"lr": 0.0003, "warmup": 0, "weight_decay": 0.0, "clip": 1.0, "betas": [0.9, 0.999],
           "eps": 1e-08},
 "loop": {"batch_size": 4, "grad_accum": 1, "epochs": 1, "max_steps": null, "eval_every": 0,
          "seed": 0, "offload_optimizer": false, "offload": "params", "offload_device": "nvme",
          "offload_path": "/nvme/scratch", "offload_pool": 268435456, "max_nonfinite_steps": 5,
          "activation_checkpointing": [0, 2], "activation_checkpointing_every": 2,
          "hybrid": "hsdp", "quantize_gradients": "int8", "compile": true,
          "keep_gathered": "all"},
 "output": {"output_dir": "runs/neox-finetune", "save_every": 0, "keep_last": 3,
            "export_hf": false, "sample_tokens": 48, "sample_temperature": 0.8,
            "measure_memory": false}}
""")


def test_a_recipe_stored_before_the_split_reads_into_its_concerns():
    recipe = Recipe.from_dict(BEFORE_THE_SPLIT)
    assert recipe.training == TrainingConfig(batch_size=4, max_nonfinite_steps=5)
    assert recipe.sharding == ShardingConfig(
        reduce_dtype="bf16", frozen_weights="int8", activation_checkpointing=(0, 2),
        activation_checkpointing_every=2, compile=True, keep_gathered="all")
    # The pool it stored (256 MiB, the default then) is kept: auto is the default of a recipe
    # that stores none (issue 44).
    assert recipe.offload == OffloadConfig(offload="params", offload_device="nvme",
                                           offload_path="/nvme/scratch", offload_pool=2**28)
    assert recipe.layout == LayoutConfig(hybrid="hsdp", quantize_gradients="int8")
    assert recipe.model.seed == 3


def test_this_neox_stores_the_form_the_neox_before_the_split_reads():
    # Version 8 (issue 41) adds one field to "loop", the frozen weights' placement (a version-7
    # recipe's runs were sharded), and version 9 (issue 44) the optimizer pass's overlap (the
    # same bits either way: "exact", the default): the rest of the form is version 7's, name
    # for name.
    stored = json.loads(json.dumps(Recipe.from_dict(BEFORE_THE_SPLIT).to_dict()))
    assert (stored.pop("version"), stored["loop"].pop("frozen_placement"),
            stored["loop"].pop("offload_overlap")) == (9, "sharded", "exact")
    assert stored == {k: v for k, v in BEFORE_THE_SPLIT.items() if k != "version"}


def test_version_8_stores_the_frozen_placement_and_nf4():
    d = json.loads(json.dumps(BEFORE_THE_SPLIT))
    d["version"], d["model"]["frozen_weights"], d["loop"]["frozen_placement"] = \
        8, "nf4", "replicated"
    recipe = Recipe.from_dict(d)
    assert (recipe.sharding.frozen_weights, recipe.sharding.frozen_placement) == \
        ("nf4", "replicated")
    assert json.loads(json.dumps(recipe.to_dict())) == dict(
        d, version=9, loop=dict(d["loop"], offload_overlap="exact"))
    # From version 8 on the field is always stored, and checked.
    del d["loop"]["frozen_placement"]
    with pytest.raises(RecipeError, match=r"recipe.loop: missing fields \['frozen_placement'\]"):
        Recipe.from_dict(d)
    d["loop"]["frozen_placement"] = "everywhere"
    with pytest.raises(RecipeError, match="recipe.loop: frozen_placement must be one of"):
        Recipe.from_dict(d)


def test_version_9_stores_the_overlap_and_older_versions_load_as_exact():
    """``--offload-overlap`` (issue 44): resumable (bitwise the same either way); recipes of
    versions 1-8, whose runs stepped inside the step, load as "exact", the same bits."""
    d = json.loads(json.dumps(BEFORE_THE_SPLIT))
    assert Recipe.from_dict(d).offload.offload_overlap == "exact"
    d["version"], d["loop"]["frozen_placement"], d["loop"]["offload_overlap"] = 9, "sharded", "off"
    recipe = Recipe.from_dict(d)
    assert recipe.offload.offload_overlap == "off"
    assert recipe.offload.policies()["offload"].overlap == "off"
    assert json.loads(json.dumps(recipe.to_dict())) == d
    del d["loop"]["offload_overlap"]
    with pytest.raises(RecipeError, match=r"recipe.loop: missing fields \['offload_overlap'\]"):
        Recipe.from_dict(d)
    d["loop"]["offload_overlap"] = "later"
    with pytest.raises(RecipeError, match="recipe.loop: offload_overlap must be one of"):
        Recipe.from_dict(d)
