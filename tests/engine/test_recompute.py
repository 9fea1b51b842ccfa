"""Activation recomputation (``zerocore.Recompute``): gradients, losses and the random stream
are bitwise those of the same training without it, at world sizes 1-3, with dropout, for
stacks that mix trainable and frozen layers; and a recomputed layer's forward keeps nothing for
backward but its input.

Both runs of a comparison happen on the same ranks, one after the other, from the same seeds:
the same operations on the same values in the same order must give the same bits (fp32, CPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from tests.support.dist_utils import all_gather_flat

VOCAB, D_MODEL, N_HEAD, SEQ, BATCH = 29, 24, 3, 7, 3
P_DROP = 0.25  # large enough that a different mask changes every gradient


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.drop = nn.Dropout(P_DROP)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:   # (B, T) -> (B, T, C)
        return self.drop(self.tok(idx))


class Block(nn.Module):
    """Pre-LN block with attention dropout (SDPA's own) and residual dropout."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)
        self.drop = nn.Dropout(P_DROP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=P_DROP if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Readout(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


class AttentionBlock(nn.Module):
    """nn.MultiheadAttention(batch_first=True) (its input projection runs on a transposed, non-
    contiguous 3-D input) with its own dropout, then a Linear applied to a transposed input: the
    kernels torch picks for these depend on whether the weights require grad, so a first forward
    on views that do not would differ in the last bits from the recomputation and from a run
    without recomputation."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D_MODEL, N_HEAD, dropout=P_DROP, batch_first=True)
        self.mix = nn.Linear(BATCH, BATCH)   # mixes along the batch of a (C, T, B) view
        self.drop = nn.Dropout(P_DROP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.drop(self.mix(x.transpose(0, 2))).transpose(0, 2)


def make_layers(train: str, stack: str = "blocks") -> list[nn.Module]:
    torch.manual_seed(0)
    block = {"blocks": Block, "attention": AttentionBlock}[stack]
    layers = [Embedding(), block(), block(), block(), Readout()]
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            frozen = {"all": False,
                      "biases": not name.endswith("bias"),
                      # a frozen first layer fed token ids: no node covers it
                      "frozen_embedding": i == 0,
                      # a whole block frozen, between trainable ones
                      "frozen_middle": i == 2}[train]
            p.requires_grad_(not frozen)
    return layers


@dataclasses.dataclass(frozen=True)
class Run:
    train: str = "all"
    recompute: zerocore.Recompute | None = None
    steps: int = 3
    micro: int = 1
    stack: str = "blocks"


def train_run(rank: int, world_size: int, run: Run) -> dict:
    """Losses, every step's full gradients and the RNG state after each backward."""
    model = zerocore.shard(make_layers(run.train, run.stack), recompute=run.recompute)
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # dropout masks: per rank, the same in both runs
    out = {"losses": [], "grads": [], "rng": [],
           "recomputed": [layer.recompute for layer in model.layers]}
    for step in range(run.steps):
        for m in range(run.micro):
            g = torch.Generator().manual_seed(10 * step + m)
            ids = torch.randint(0, VOCAB, (world_size * BATCH, SEQ + 1), generator=g)
            x, y = ids[:, :-1].chunk(world_size)[rank], ids[:, 1:].chunk(world_size)[rank]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / run.micro
            loss.backward()
            out["losses"].append(loss.item())
            out["rng"].append(torch.get_rng_state())
        grads = {}
        for layer in model.layers:
            if layer.trainable is not None:
                grads[layer.index] = all_gather_flat(layer.trainable.shard.grad)
        out["grads"].append(grads)
        opt.step()
        opt.zero_grad()
    return out


def assert_bitwise(plain: list[dict], recomputed: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(plain, recomputed)):
        assert a["losses"] == b["losses"], f"rank {rank}: losses differ"
        for i, (ra, rb) in enumerate(zip(a["rng"], b["rng"])):
            assert torch.equal(ra, rb), f"rank {rank}: the random stream differs after pass {i}"
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert ga.keys() == gb.keys()
            for layer, want in ga.items():
                assert torch.equal(gb[layer], want), \
                    f"rank {rank}, step {step}, layer {layer}: gradients differ"


@pytest.mark.parametrize("train", ["all", "biases", "frozen_embedding", "frozen_middle"])
def test_recompute_all_is_bitwise(world, train):
    plain = world.run(train_run, Run(train=train))
    again = world.run(train_run, Run(train=train, recompute=zerocore.Recompute()))
    assert all(again[0]["recomputed"]) and not any(plain[0]["recomputed"])
    assert_bitwise(plain, again)
    # Dropout really drew masks: a forward in eval mode would not change with the seed; here
    # the two ranks (different seeds, different rows) and the steps see different losses.
    assert len(set(plain[0]["losses"])) == len(plain[0]["losses"])


@pytest.mark.parametrize("train", ["all", "biases"])
def test_recompute_is_bitwise_for_attention_and_transposed_inputs(world, train):
    run = Run(train=train, stack="attention")
    plain = world.run(train_run, run)
    again = world.run(train_run, dataclasses.replace(run, recompute=zerocore.Recompute()))
    assert all(again[0]["recomputed"])
    assert_bitwise(plain, again)


@pytest.mark.parametrize("policy, chosen", [
    (zerocore.Recompute(every=2), [True, False, True, False, True]),
    (zerocore.Recompute(layers=(1, 3)), [False, True, False, True, False]),
    (zerocore.Recompute(layers=(1, 2, 3), every=2), [False, True, False, True, False])],
    ids=["every-2", "blocks-1-3", "blocks-every-2"])
def test_recompute_some_layers_with_accumulation(world, policy, chosen):
    run = Run(train="frozen_middle", micro=2, steps=2)
    plain = world.run(train_run, run)
    again = world.run(train_run, dataclasses.replace(run, recompute=policy))
    assert again[0]["recomputed"] == chosen
    assert_bitwise(plain, again)


def saved_by_forward(rank: int, world_size: int, recompute: bool) -> tuple[int, int]:
    """Bytes of tensors that autograd saved while the forward ran, and the bytes of the
    layers' inputs (a recomputed layer's forward keeps those alone: torch's checkpoint saves
    them, and builds the graph in backward)."""
    model = zerocore.shard(make_layers("all"),
                           recompute=zerocore.Recompute() if recompute else None)
    seen: dict[int, int] = {}
    inputs: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    def note_input(module: torch.nn.Module, args: tuple) -> None:
        s = args[0].untyped_storage()
        inputs[s.data_ptr()] = s.nbytes()

    for layer in model.layers:
        layer.module.register_forward_pre_hook(note_input)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
    out.sum().backward()
    return sum(seen.values()), sum(inputs.values())


def test_recomputed_forward_keeps_only_its_input(worlds):
    (plain, inputs), (again, _) = (worlds(2).run(saved_by_forward, r)[0] for r in (False, True))
    assert plain > 2 * inputs and again == inputs, (plain, again, inputs)


def test_recompute_policy_checks():
    with pytest.raises(ValueError, match="'all' or layer positions"):
        zerocore.Recompute(layers="some")
    with pytest.raises(ValueError, match="integers >= 0"):
        zerocore.Recompute(layers=(-1,))
    with pytest.raises(ValueError, match="every"):
        zerocore.Recompute(every=0)
    assert zerocore.Recompute(layers=[4, 1, 4]).layers == (1, 4)


def shard_out_of_range(rank: int, world_size: int) -> str:
    try:
        zerocore.shard(make_layers("all"), recompute=zerocore.Recompute(layers=(1, 9)))
    except ValueError as e:
        return str(e)
    return ""


def test_recompute_beyond_the_stack_raises_on_every_rank(worlds):
    for msg in worlds(2).run(shard_out_of_range):
        assert "[9] lie beyond the stack, which has 5 layers" in msg, msg
