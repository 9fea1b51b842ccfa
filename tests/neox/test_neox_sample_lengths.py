"""neox's sample from a sharded model (``sample_sharded``, the end of a run) with ranks that
generate different lengths (issue 39, item 2): each rank its own ``new_tokens``, or its own
prompt. The ranks agree before each token whether any still generates; a rank that is done runs
forwards on a dummy token, so the others' gathers have every rank.

Gloo ranks at world sizes 2 and 3, gathering by reading peers' memory and by gloo's collectives.
Each rank's text is the unsharded model's on its own prompt, recomputed without a cache, bit for
bit: every forward that chooses a token is the same computation on the same gathered values, and
the sampling generator is seeded the same on every rank. Ranks given the same prompt and seed get
the same text, as when rank 0 chose every token for the world.
"""

from __future__ import annotations

import pytest
import torch

import neox
import zerocore
from neox.model import NeoXModel
from neox.run.sampling import choose_token, sample_sharded

WORLD_SIZES = [2, 3]
CONFIG = neox.NeoXConfig(vocab_size=97, hidden_size=48, num_hidden_layers=3,
                         num_attention_heads=4, intermediate_size=96, rotary_pct=0.5)
LONGEST = 6
# Each way of gathering by its Comm: reading peers' memory (one host), gloo's collectives.
TRANSPORTS = {"read": dict(gather="read"), "collective": dict(peer_read="off")}
SAMPLING = dict(temperature=1.0, top_k=0)


def layers() -> list[torch.nn.Module]:
    return neox.build_layers(CONFIG, generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def reference(model: NeoXModel, prompt: torch.Tensor, new_tokens: int, seed: int
              ) -> torch.Tensor:
    ids, generator = prompt, torch.Generator().manual_seed(seed)
    for _ in range(new_tokens):
        token = choose_token(model(ids)[:, -1], generator=generator, **SAMPLING)
        ids = torch.cat((ids, token), dim=1)
    return ids


def sample_run(rank: int, world_size: int, transport: str) -> dict:
    ref = NeoXModel(CONFIG, layers()).eval()
    model = zerocore.shard(layers(), comm=zerocore.Comm(**TRANSPORTS[transport]))
    model.eval()
    shared = torch.tensor([[3, 14, 15, 92]])
    own = torch.randint(0, CONFIG.vocab_size, (1, 3 + rank),
                        generator=torch.Generator().manual_seed(rank))
    # (prompt, new tokens): rank r's own count of tokens; its own prompt; the same for all.
    cases = {"count": (shared, LONGEST - 2 * rank), "prompt": (own, LONGEST),
             "same": (shared, LONGEST)}
    got, want = {}, {}
    for name, (prompt, new_tokens) in cases.items():
        got[name] = sample_sharded(model, prompt, new_tokens=new_tokens,
                                   generator=torch.Generator().manual_seed(7),
                                   group=model.group, **SAMPLING)
        want[name] = reference(ref, prompt, new_tokens, seed=7)
    return {"got": got, "want": want}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_sample_with_ranks_generating_different_lengths(world, transport):
    results = world.run(sample_run, transport)
    for r, res in enumerate(results):
        for name, out in res["got"].items():
            assert torch.equal(out, res["want"][name]), (r, name, out, res["want"][name])
    assert len({res["got"]["count"].shape[1] for res in results}) == len(results)
    assert len({res["got"]["prompt"].shape[1] for res in results}) == len(results)
    for res in results:  # one text for the world, as rank 0 chose it before
        assert torch.equal(res["got"]["same"], results[0]["got"]["same"])
