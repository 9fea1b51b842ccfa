"""``--keep-gathered`` in neox.finetune and neox.plan: flags -> recipe -> engine
(``zerocore.Prefetch.keep_gathered``). A run with a gathered-memory budget trains bit for bit as
one without, and all-gathers less; sizes are parsed with their units; a resumed run may change
the budget; recipes written before the field existed still load."""

from __future__ import annotations

import pytest

from neox.setting import BadValue, byte_budget
from neox.run.recipe import Recipe
from neox.finetune import main as finetune_main
from tests.support.neox_testing import (BPE512, EXCERPT, call_main, gathered_mib, run_losses,
                                        run_module)

RUN = ("--cpu", "--data", EXCERPT, "--tokenizer", BPE512, "--seq-len", 32, "--batch-size", 4,
       "--sample-tokens", 0, "--nproc", 2, "--finetune", "lora", "--max-steps", 3)


@pytest.mark.e2e
def test_budget_run_trains_bit_for_bit_and_gathers_less(tmp_path):
    runs = {}
    for name, extra in (("plain", ()), ("all", ("--keep-gathered", "all")),
                        ("budget", ("--keep-gathered", "300KiB"))):
        proc = run_module("neox.finetune", *RUN, "--cache-dir", tmp_path / "cache",
                          "--output-dir", tmp_path / name, *extra)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (proc.stdout, run_losses(tmp_path / name), gathered_mib(proc.stdout))
    plain = runs["plain"]
    assert len(plain[1]) == 3
    assert "stay gathered" not in plain[0]
    for name in ("all", "budget"):
        stdout, losses, gathered = runs[name]
        assert "stay gathered" in stdout, stdout
        assert losses == plain[1]
        assert gathered < plain[2]
    # Everything kept: only the first forward gathers the frozen weights.
    assert runs["all"][2] < runs["budget"][2]


@pytest.mark.parametrize("text, value", [("0", 0), ("1000", 1000), ("2GiB", 2 * 2**30),
                                         ("512mib", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                         ("all", "all"), ("ALL", "all"), ("64KiB", 65536)])
def test_sizes_are_parsed_with_their_units(text, value):
    assert byte_budget(text) == value


@pytest.mark.parametrize("text", ["-1", "lots", "2XB", "nan", "inf", ""])
def test_bad_sizes_are_refused(text):
    with pytest.raises(BadValue, match="must be 'all' or a size"):
        byte_budget(text)


def test_a_bad_size_is_a_usage_error(capsys, tmp_path):
    proc = call_main(finetune_main, capsys, *RUN, "--output-dir", tmp_path / "out",
                     "--keep-gathered", "lots")
    assert proc.returncode == 2
    assert "--keep-gathered: must be 'all' or a size" in proc.stderr, proc.stderr


def test_recipes_without_the_field_load_with_no_budget():
    d = Recipe().to_dict()
    assert d["loop"]["keep_gathered"] == 0
    del d["loop"]["keep_gathered"]
    # Version 2 recipes always hold it; version 1 ones written before it existed do not.
    with pytest.raises(ValueError, match=r"recipe.loop: missing fields \['keep_gathered'\]"):
        Recipe.from_dict(d)
    d["version"] = 1
    assert Recipe.from_dict(d).sharding.keep_gathered == 0
    d["loop"]["keep_gathered"] = "all"
    assert Recipe.from_dict(d).sharding.keep_gathered == "all"
    d["loop"]["keep_gathered"] = -5
    with pytest.raises(ValueError, match="keep_gathered must be"):
        Recipe.from_dict(d)
