"""``ShardedModel.gathered()``: generation that gathers each unit once (issue 21, item 6).

Gloo ranks at world sizes 1, 2 and 3; tiny GPT-NeoX (full) and Llama with PEFT LoRA (whose
``generate`` calls the inner model directly, so the root is gathered through a module owning
its parameters). Inside the block ``generate`` gives the unsharded model's tokens bit for bit,
as per-token gathering does, and issues one all-gather per flat group for the whole call where
per-token gathering issues one per group per forward; after the block every group is sharded
again. ``max_bytes`` holds only the units that fit. A forward that would build a graph inside is
refused in one line and leaves the model usable.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zerocore
from tests.support.hf_models import batch, build, decoder_layers, prepare
from zerocore.engine.flat_group import GroupState

NEW_TOKENS = 6


def _all_sharded(sharded) -> bool:
    return all(g.state is GroupState.SHARDED for layer in sharded.layers for g in layer.groups)


def gathered_run(rank: int, world_size: int, arch: str, mode: str) -> dict:
    model = prepare(build(arch, seed=5), mode)
    model.eval()
    ref = copy.deepcopy(model)
    prompt = batch(3, 2)[:, :4]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    want = ref.generate(input_ids=prompt, **kwargs)
    sharded = zerocore.shard_model(model, decoder_layers(model))
    forwards = []
    decoder_layers(model)[0].register_forward_pre_hook(lambda m, a: forwards.append(1))
    groups = sum(len(layer.groups) for layer in sharded.layers)
    counter = sharded.counter

    def generate(**extra):
        for layer in sharded.layers:  # each count from nothing gathered (see the test)
            layer.free()
        counter.reset()
        forwards.clear()
        out = model.generate(input_ids=prompt, **kwargs, **extra)
        # Group gathers, not collectives: at one rank a gather runs none (it is a copy).
        return out, counter.group_gathers, len(forwards)

    per_token, per_token_gathers, n_forwards = generate()
    with sharded.gathered():
        held, held_gathers, held_forwards = generate()
        assert not _all_sharded(sharded)  # still held inside the block
    after_block = _all_sharded(sharded)
    # A budget holding the first unit only: every other group gathers per forward.
    first = sharded.units[0].layer
    with sharded.gathered(max_bytes=first.gathered_size):
        budget, budget_gathers, _ = generate()
    # A forward that would build a graph is refused before it changes anything.
    with sharded.gathered():
        try:
            model(input_ids=prompt)
            refused = None
        except RuntimeError as e:
            refused = str(e)
    again, _, _ = generate()
    return {"want": want, "per_token": per_token, "held": held, "budget": budget,
            "again": again, "groups": groups, "first_groups": len(first.groups),
            "root_groups": len(sharded.root.layer.groups),
            "forwards": (n_forwards, held_forwards), "gathers": (per_token_gathers,
                                                                 held_gathers, budget_gathers),
            "after_block": after_block, "after_all": _all_sharded(sharded),
            "refused": refused}


@pytest.mark.parametrize("arch,mode", [("neox", "full"), ("llama", "lora")])
def test_generation_inside_gathered_gathers_once_and_is_exact(world, arch, mode):
    for r, res in enumerate(world.run(gathered_run, arch, mode)):
        for name in ("per_token", "held", "budget", "again"):
            assert torch.equal(res[name], res["want"]), (r, name, res[name], res["want"])
        forwards, held_forwards = res["forwards"]
        assert forwards == held_forwards == NEW_TOKENS, res["forwards"]
        per_token, held, budget = res["gathers"]
        groups, first, root = res["groups"], res["first_groups"], res["root_groups"]
        # Per token every unit's groups are gathered for every forward. The root's are too for
        # a plain model (its forward hook frees them); PEFT's generate calls the inner model,
        # for which the root is gathered once and kept for the whole call.
        root_gathers = root if mode == "lora" else root * forwards
        assert per_token == (groups - root) * forwards + root_gathers, res["gathers"]
        assert held == groups, res["gathers"]  # every group once
        assert budget == first + (groups - root - first) * forwards + root_gathers, \
            res["gathers"]
        assert res["after_block"]
        # Per-token generation of a plain model leaves nothing gathered; after PEFT's the
        # root stays gathered until the model's next forward (sharded_model.py,
        # _root_owner_pre): the block's end frees it, per-token generation does not.
        assert res["after_all"] == (mode != "lora")
        assert res["refused"] is not None and "torch.no_grad()" in res["refused"]
        assert "\n" not in res["refused"]
