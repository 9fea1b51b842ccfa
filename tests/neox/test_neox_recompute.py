"""``--activation-checkpointing`` in neox.finetune: flags -> recipe -> engine. A run that
recomputes its blocks' activations trains bit for bit as one that keeps them; the choice of
blocks is checked against the kept ones; a resumed run may change it."""

from __future__ import annotations

import json

import pytest

from neox.blocks import chosen_blocks
from neox.config import PRESETS
from neox.commands.finetune import build_parser
from neox.commands.flags import explicit_flags
from neox.finetune import main as finetune_main
from neox.model import layer_specs
from neox.run.recipe import recipe_from_flags
from neox.setting import UsageError
from tests.support.neox_testing import (BPE512, EXCERPT, assert_clean_error, call_main, run_losses,
                                        run_module)

RUN = ("--cpu", "--data", EXCERPT, "--tokenizer", BPE512, "--seq-len", 32, "--batch-size", 4,
       "--sample-tokens", 0, "--nproc", 2)


@pytest.mark.e2e
def test_recomputed_run_trains_bit_for_bit(tmp_path):
    runs = {}
    for name, extra in (("plain", ()), ("recomputed", ("--activation-checkpointing",))):
        proc = run_module("neox.finetune", *RUN, "--max-steps", 4, "--cache-dir",
                          tmp_path / "cache", "--output-dir", tmp_path / name, *extra)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (proc.stdout, run_losses(tmp_path / name))
    assert "activations of 4 block(s) recomputed in backward" in runs["recomputed"][0]
    assert "recomputed in backward" not in runs["plain"][0]
    assert len(runs["plain"][1]) == 4
    assert runs["recomputed"][1] == runs["plain"][1]


def _recipe(*argv: str):
    argv = ("--finetune", "full") + argv
    args = build_parser().parse_args(argv)
    args.explicit = explicit_flags(build_parser(), list(argv))
    kept, recomputed = chosen_blocks(args.filter_layers, args.activation_checkpointing,
                                     PRESETS["tiny"].num_hidden_layers)
    return recipe_from_flags(vars(args), {"filter_layers": kept,
                                          "activation_checkpointing": recomputed})


@pytest.mark.parametrize("argv, blocks, positions", [
    ((), (), None),
    (("--activation-checkpointing",), (0, 1, 2, 3), (1, 2, 3, 4)),
    (("--activation-checkpointing", "1,3"), (1, 3), (2, 4)),
    (("--activation-checkpointing", "--activation-checkpointing-every", "2"), (0, 1, 2, 3),
     (1, 3)),
])
def test_flags_to_recipe_to_engine(argv, blocks, positions):
    recipe = _recipe("--model", "tiny", *argv)
    assert recipe.sharding.activation_checkpointing == blocks
    policy = recipe.sharding.recompute(layer_specs(PRESETS["tiny"], None))
    chosen = None if policy is None else tuple(i for i in range(7) if policy.selects(i))
    assert chosen == positions
    stored = type(recipe).from_dict(json.loads(json.dumps(recipe.to_dict())))
    assert stored == recipe


def test_filtered_blocks_map_to_their_positions():
    recipe = _recipe("--model", "tiny", "--filter-layers", "1,3", "--activation-checkpointing",
                     "3")
    specs = layer_specs(PRESETS["tiny"], (1, 3))
    policy = recipe.sharding.recompute(specs)
    assert [i for i in range(len(specs)) if policy.selects(i)] == [2]   # embed, 1, *3*, ...


def test_a_block_not_kept_is_refused():
    with pytest.raises(UsageError,
                       match=r"block\(s\) \[0\] are not among the kept blocks \(1-3\)"):
        _recipe("--model", "tiny", "--filter-layers", "1-3", "--activation-checkpointing", "0,2")


@pytest.mark.parametrize("value, phrase", [("9", "block 9 is out of range"),
                                           ("x", "is not a block index")])
def test_bad_block_lists_are_one_line(capsys, value, phrase):
    proc = call_main(finetune_main, capsys, "--model", "tiny", "--activation-checkpointing",
                     value, "--max-steps", 1)
    assert_clean_error(proc, phrase)
