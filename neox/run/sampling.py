"""Choosing the next token from logits; sampling text from a model in one process (with a
key/value cache, ``generate``) and from a sharded model (``sample_sharded``).

``neox.generate`` (one process, key/value cache) and the end of a fine-tuning run (every rank
of a sharded model, no cache) choose tokens the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from neox.model import NeoXModel

__all__ = ["choose_token", "generate", "sample_sharded"]


def choose_token(logits: torch.Tensor, *, temperature: float, top_k: int,
                 generator: torch.Generator | None) -> torch.Tensor:
    """The next token (B, 1) from the last position's logits (B, vocab): the likeliest at
    temperature 0, else a sample among the ``top_k`` likeliest (all when 0) at ``temperature``.
    ``generator`` is a CPU generator (sampling runs on the CPU, so a seed gives the same text on
    any device)."""
    if temperature < 0:
        raise ValueError(f"temperature {temperature}: must be >= 0 (0: greedy)")
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    scores = logits.float() / temperature
    if top_k > 0:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


@torch.no_grad()
def sample_sharded(model: nn.Module, prompt: torch.Tensor, *, new_tokens: int,
                   temperature: float, top_k: int, generator: torch.Generator | None,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """prompt (1, T) int64 -> (1, T + new_tokens), from a model whose forward is collective over
    ``group`` (a ``zerocore.shard`` stack: ``model.group``). Each rank continues its own prompt
    for its own ``new_tokens``, choosing its tokens from its own logits (ranks given the same
    prompt and seed choose the same tokens: the same forward on the same gathered values).
    Before each token the ranks agree whether any is still generating (one all-reduce of a
    flag); a rank that is done runs the forward on a dummy token and drops its output, so that
    the others' gathers have every rank. Without a key/value cache each token costs a forward
    over the whole sequence: for a short sample at the end of a run."""
    ids = prompt
    dummy = prompt[:, :1]                                              # (1, 1)
    while True:
        done = ids.shape[1] - prompt.shape[1] >= new_tokens
        anyone = torch.tensor([int(not done)], device=ids.device)
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=group)
        if not anyone.item():
            return ids
        if done:
            model(dummy)                    # its output dropped: the others' gathers need it
            continue
        logits = model(ids)[:, -1]                                   # (1, vocab)
        token = choose_token(logits, temperature=temperature, top_k=top_k, generator=generator)
        ids = torch.cat((ids, token), dim=1)


@torch.no_grad()
def generate(model: NeoXModel, prompt: torch.Tensor, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """prompt (B, T) int64 -> (B, T + max_new_tokens). The prompt runs once through the model;
    each new token then costs one single-token forward against the cached keys and values."""
    if prompt.shape[1] < 1:
        raise ValueError("the prompt must hold at least one token")
    caches = model.new_caches()
    out = prompt
    logits = model.forward_cached(prompt, caches)[:, -1].float()   # (B, vocab)
    for _ in range(max_new_tokens):
        token = choose_token(logits, temperature=temperature, top_k=top_k,
                             generator=generator)                    # (B, 1)
        out = torch.cat((out, token), dim=1)
        logits = model.forward_cached(token, caches)[:, -1].float()
    return out
