"""The engine tests' seeded stack of layers and what one training run of it does.

Two models small enough for every test yet with what the engine must get right: an MLP of odd
widths (every flat group padded inside and at the end) and a tiny causal transformer (token ids in,
a learned position embedding, attention). ``Spec`` says what one run does; ``global_batch`` gives
every rank the same global batch, of which each rank takes its rows; ``train_digest`` hashes a
whole run, for bitwise comparisons between engine settings (tests/engine/test_offload.py,
test_overlap.py, test_keep_gathered.py, test_frozen_int8.py). ``full_params`` and what follows it
run on a rank of a gloo World (tests/support/dist_utils.py): they shard and gather.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct

import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from tests.support.dist_utils import all_gather_flat

LR = 1e-2
WEIGHT_DECAY = 0.1  # large enough that a step missing the decoupled decay shows up
LOCAL_BATCH = 4     # rows (sequences) per rank per micro-batch


# -- models -------------------------------------------------------------------------------------

D_IN, HIDDEN, D_OUT = 13, 31, 7  # odd sizes: every flat group has padding inside and at the end


class WithUnused(nn.Module):
    """A linear layer with an extra trainable parameter that forward never uses."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


def mlp_layers(with_unused: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    first = (WithUnused(D_IN, HIDDEN) if with_unused
             else nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU()))
    return [first,
            nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU()),
            nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, D_OUT))]


VOCAB, D_MODEL, N_HEAD, SEQ = 23, 32, 4, 9


class Embedding(nn.Module):
    """Token ids -> token + learned position embeddings."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, D_MODEL))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) int64
        return self.tok(idx) + self.pos[:idx.shape[1]]  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        # No bias: a key bias adds the same q·b to every score of a query, which softmax cancels,
        # so its exact gradient is 0 and the computed one is rounding noise, whose sign Adam's
        # m/sqrt(v) turns into ±lr steps that no two summation orders agree on.
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Readout(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))  # (B, T, vocab)


def transformer_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embedding(), Block(), Block(), Readout()]


# -- what one training run does ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    model: str = "mlp"                  # "mlp" or "transformer"
    steps: int = 10
    micro: int = 1                      # micro-batches accumulated per step
    train: str = "all"                  # "all", "biases" (weights frozen), "no_embedding",
                                        # "middle_frozen" (all of layer 1 frozen)
    max_norm: float | None = None       # clip through zerocore.LossScaler / clip_grad_norm_
    offload: bool = False               # Offload(optimizer=True)
    offload_params: bool = False        # Offload(params=True)
    param_dtype: torch.dtype = torch.float32
    with_unused: bool = False           # a trainable parameter that forward never uses
    gc_before_backward: bool = False    # gc.collect() between forward and backward
    dangling_forward: bool = False      # a forward with grad enabled, never backpropagated
    eval_no_grad: bool = False          # compare a torch.no_grad() forward with the reference


def make_layers(spec: Spec) -> list[nn.Module]:
    layers = transformer_layers() if spec.model == "transformer" else mlp_layers(spec.with_unused)
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if spec.train == "biases" and not name.endswith("bias"):
                p.requires_grad_(False)
            if (spec.train, i) in (("no_embedding", 0), ("middle_frozen", 1)):
                p.requires_grad_(False)
    return layers


def global_batch(spec: Spec, step: int, micro: int, world_size: int):
    """(inputs, targets) of the whole global batch: LOCAL_BATCH rows per rank, the same on every
    rank. Learnable targets (a fixed random teacher; a fixed token rule) so that loss falls."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    rows = LOCAL_BATCH * world_size
    if spec.model == "transformer":
        start = torch.randint(0, VOCAB, (rows, 1), generator=g)
        seq = (start * 5 + 3 * torch.arange(SEQ + 1)) % VOCAB  # next token = a fixed function
        return seq[:, :-1], seq[:, 1:]
    x = torch.randn(rows, D_IN, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(D_IN, D_OUT, generator=teacher) / math.sqrt(D_IN)
    return x, torch.tanh(x @ w)


def loss_fn(spec: Spec, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = out.float()
    if spec.model == "transformer":
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return (out - y).pow(2).mean()


def model_input(spec: Spec, x: torch.Tensor) -> torch.Tensor:
    return x if spec.model == "transformer" else x.to(spec.param_dtype)


def full_params(model: zerocore.ShardedSequential) -> dict[str, torch.Tensor]:
    """Every parameter of the sharded model, as the unsharded model names it ("<layer>.<name>"):
    each group's shards all-gathered (fp32 masters for trainable groups), cut along its slots."""
    out = {}
    for layer in model.layers:
        for g in layer.groups:
            flat = all_gather_flat(g.shard)
            for s in g.layout.slots:
                name = model.param_name(layer.index, s.name)
                out[name] = flat[s.offset:s.offset + s.numel].view(s.shape)
    return out


def full_grads(model: zerocore.ShardedSequential) -> dict[str, torch.Tensor]:
    """The gradient of every trainable parameter, all-gathered from the gradient shards."""
    out = {}
    for layer in model.layers:
        if layer.trainable is not None:
            g = layer.trainable
            flat = all_gather_flat(g.shard.grad)
            for s in g.layout.slots:
                name = model.param_name(layer.index, s.name)
                out[name] = flat[s.offset:s.offset + s.numel].view(s.shape)
    return out


def accumulate_step(model: zerocore.ShardedSequential, spec: Spec, step: int, rank: int,
                    world_size: int) -> list[float]:
    """Forward and backward of every micro-batch of one step on this rank's rows (gradients
    accumulate in the shards); each micro-batch's loss, exactly."""
    losses = []
    for m in range(spec.micro):
        x, y = global_batch(spec, step, m, world_size)
        xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = loss_fn(spec, model(model_input(spec, xr)), yr) / spec.micro
        loss.backward()
        losses.append(loss.item())
    return losses


def shard_stack(spec: Spec) -> zerocore.ShardedSequential:
    """The stack of ``spec``, sharded in its parameter dtype, its optimizer offloaded when
    ``spec.offload``, its parameter shards when ``spec.offload_params``."""
    return zerocore.shard(make_layers(spec),
                          mixed_precision=zerocore.MixedPrecision(spec.param_dtype),
                          offload=zerocore.Offload(optimizer=spec.offload,
                                                   params=spec.offload_params))


def train_digest(model: zerocore.ShardedSequential, spec: Spec, rank: int,
                 world_size: int, final=None, sharding=None) -> dict:
    """Trains the sharded model and returns a digest of every step's loss (this rank's, exact),
    the gradient shards and norm before every step, and the final parameters (``final(model)``:
    {name: tensor}; default every rank's shards gathered, fp32 masters). ``sharding``: the
    model's, when ``model`` is not one itself (``shard_model``'s model)."""
    sharding = model if sharding is None else sharding
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = zerocore.LossScaler(sharding.group, dynamic=False)
    h = hashlib.sha256()
    for step in range(spec.steps):
        for loss in accumulate_step(model, spec, step, rank, world_size):
            h.update(struct.pack("<d", loss))
        digest_step(h, sharding, opt, scaler, spec)
    for name, t in sorted((final or full_params)(sharding).items()):
        h.update(name.encode())
        h.update(t.float().numpy().tobytes())
    return {"digest": h.hexdigest()}


def digest_step(h: "hashlib._Hash", sharding: nn.Module, opt: torch.optim.Optimizer,
                scaler: zerocore.LossScaler, spec: Spec) -> None:
    """The end of one step of a digested run (``sharding``: either front door's): the gradient
    shards hashed, the optimizer stepped (through the scaler, clipping to ``spec.max_norm``,
    with the norm hashed, when it is set), the gradients zeroed."""
    for shard in sharding.trainable_shards():
        h.update(shard.grad.numpy().tobytes())
    if spec.max_norm is not None:
        h.update(struct.pack("<d", scaler.step(opt, max_norm=spec.max_norm).grad_norm))
    else:
        opt.step()
    opt.zero_grad()


def assert_trains_as(weights: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     init: dict[str, torch.Tensor], *, atol: float,
                     update_rtol: float | None) -> None:
    """Trained weights against the unsharded reference's (``want``, from ``init``): elementwise
    within ``atol``; or, given ``update_rtol``, the whole update (``||w - w_ref|| /
    ||w_ref - w_init||``), for reduced precision, where Adam turns the rounding of a tiny
    gradient into lr-sized steps of a few elements while the update as a whole agrees."""
    assert weights.keys() == want.keys(), (sorted(weights), sorted(want))
    if update_rtol is None:
        for n, w in weights.items():
            torch.testing.assert_close(w.float(), want[n], rtol=0, atol=atol, msg=n)
        return
    off = sum((w.float() - want[n]).square().sum() for n, w in weights.items()).sqrt()
    update = sum((want[n] - init[n]).square().sum() for n in want).sqrt()
    assert off <= update_rtol * update, (off, update)
