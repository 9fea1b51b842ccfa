"""Plain ``model.generate(...)`` on a ``shard_model`` model with ranks stopping at different
lengths (issue 39, item 2): each rank its own prompt, and either its own ``max_new_tokens`` or
its own eos token, met after a different number of tokens. A rank that is done keeps running
forwards until every rank is (transformers' ``synced_gpus``, which it turns on by itself for the
model: zerocore/engine/synced_generation.py), so the others' gathers all have their ranks.

Gloo ranks at world sizes 2 and 3 (one rank has nothing to wait for); tiny GPT-NeoX and Llama with
PEFT LoRA (whose ``generate`` runs on the inner causal LM); gathering by reading peers' memory
and by gloo's collectives; per token, inside ``gathered()``, inside ``gathered(max_bytes=)``
holding one unit, and with ``synced_gpus=True`` given. Each rank's tokens are the unsharded
model's on its own prompt, bit for bit: every forward that produces a token is the same
computation on the same gathered values (greedy decoding).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import zerocore
from tests.support.hf_models import VOCAB, batch, build, decoder_layers, prepare

WORLD_SIZES = [2, 3]
PROMPT = 4
LONGEST = 7  # new tokens of the longest rank
# Each way of gathering by its Comm: reading peers' memory (one host), gloo's collectives.
TRANSPORTS = {"read": dict(gather="read"), "collective": dict(peer_read="off")}


def lengths_run(rank: int, world_size: int, arch: str, mode: str, transport: str) -> dict:
    model = prepare(build(arch, seed=5), mode)
    model.eval()
    ref = copy.deepcopy(model)
    prompt = batch(10 + rank, 1)[:, :PROMPT]   # (1, PROMPT), each rank its own
    greedy = dict(do_sample=False, pad_token_id=0)
    # Stopped by max_new_tokens: rank r generates LONGEST - 2r tokens.
    by_count = dict(max_new_tokens=LONGEST - 2 * rank, **greedy)
    # Stopped by eos, the same max_new_tokens everywhere: rank 0's eos is the first token it
    # generates; the other ranks' a token their text never holds, so they run to the end (a
    # tiny model's greedy text often repeats one token: an eos the rank meets later is not
    # to be had on every rank).
    free = ref.generate(input_ids=prompt, max_new_tokens=LONGEST, **greedy)[0, PROMPT:]
    eos = int(free[0]) if rank == 0 else min(set(range(VOCAB)) - set(free.tolist()))
    by_eos = dict(max_new_tokens=LONGEST, eos_token_id=eos, **greedy)
    cases = {"count": by_count, "eos": by_eos}
    want = {name: ref.generate(input_ids=prompt, **kw) for name, kw in cases.items()}
    sharded = zerocore.shard_model(model, decoder_layers(model),
                                   comm=zerocore.Comm(**TRANSPORTS[transport]))
    first_unit = sharded.units[0].layer.gathered_size
    blocks = {"per_token": (contextlib.nullcontext, {}),
              "gathered": (sharded.gathered, {}),
              "one_unit": (lambda: sharded.gathered(max_bytes=first_unit), {}),
              "synced_gpus": (contextlib.nullcontext, dict(synced_gpus=True))}
    got = {}
    for block, (enter, extra) in blocks.items():
        for name, kw in cases.items():
            with enter():
                got[block, name] = model.generate(input_ids=prompt, **kw, **extra)
    return {"want": want, "got": got}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("arch,mode", [("neox", "full"), ("llama", "lora")])
def test_generate_with_ranks_stopping_at_different_lengths(world, arch, mode, transport):
    results = world.run(lengths_run, arch, mode, transport)
    for case in ("count", "eos"):
        lengths = {res["want"][case].shape[1] for res in results}
        assert len(lengths) > 1, (case, lengths)  # the ranks do stop at different lengths
    for r, res in enumerate(results):
        for (block, case), out in res["got"].items():
            want = res["want"][case]
            assert torch.equal(out, want), (r, block, case, out, want)


def marks_run(rank: int, world_size: int) -> dict:
    model = prepare(build("llama", seed=5), "lora")
    sharded = zerocore.shard_model(model, decoder_layers(model))
    marked = sorted(name for name, m in model.named_modules()
                    if vars(m).get("_is_fsdp_managed_module"))
    sharded.remove()
    after = [name for name, m in model.named_modules() if "_is_fsdp_managed_module" in vars(m)]
    loaded = build("neox", seed=5)
    loaded._is_distributed_loading_by_transformers = True
    try:
        zerocore.shard_model(loaded, decoder_layers(loaded))
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"marked": marked, "after": after, "refused": refused}


def test_what_is_marked_for_synced_generation(world):
    for res in world.run(marks_run):
        # The PEFT model and the causal LM inside it, whose generate runs: nothing else (the
        # attribute also changes how torch.compile traces a module: docs/decisions.md).
        assert res["marked"] == ["", "base_model.model"], res["marked"]
        assert res["after"] == []
        assert res["refused"] is not None and "distributed_config" in res["refused"]
