"""What the offload tests share (tests/engine/test_param_offload.py, test_nvme_offload.py,
test_overlapped_pass.py, test_delayed_pass.py): a toy stack sharded through either front door,
the homes an overlapped optimizer pass runs on, and a stack large enough for a plan to be
checked against a measured peak."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from tests.support.toy_stack import Spec, make_layers
from zerocore.policies import MIN_POOL_BYTES

DOORS = ["shard", "shard_model"]


def pass_offload(label: str, path: str, overlap: str) -> zerocore.Offload:
    """The homes whose optimizer pass overlaps (``overlap``: "exact", "delayed" or "off"):
    host memory, with the parameters on the device (a mirror) or on the host (a window);
    NVMe, the same two (the pool at its minimum, so that every shard is stepped in several
    chunks)."""
    nvme = dict(path=path, pool_bytes=MIN_POOL_BYTES)
    return {"cpu": zerocore.Offload(optimizer="cpu", overlap=overlap),
            "cpu+params": zerocore.Offload(optimizer="cpu", params="cpu", overlap=overlap),
            "nvme": zerocore.Offload(optimizer="nvme", overlap=overlap, **nvme),
            "nvme+params": zerocore.Offload(optimizer="nvme", params="cpu", overlap=overlap,
                                            **nvme)}[label]


def build(door: str, spec: Spec, policies: dict, offload: zerocore.Offload):
    """(the callable model, its sharding) of ``spec``'s layers in its param dtype, with
    ``policies`` and ``offload``. ``shard_model`` takes the middle layers as units and leaves
    the first and the last to the root (as a Hugging Face model's embedding and head)."""
    layers = make_layers(spec)
    policies = dict(policies, offload=offload,
                    mixed_precision=zerocore.MixedPrecision(spec.param_dtype))
    if door == "shard":
        model = zerocore.shard(layers, **policies)
        return model, model
    model = nn.Sequential(*layers)
    return model, zerocore.shard_model(model, list(model)[1:-1], **policies)


@dataclasses.dataclass(frozen=True)
class Case:
    """A training case of the overlapped pass's tests."""

    spec: Spec
    # Steps at which the last rank's first gradient is made inf (fp16: skipped everywhere).
    overflow_steps: tuple[int, ...] = ()


def pass_cases(steps: int) -> dict[str, Case]:
    """The overlapped pass's cases, of ``steps`` steps: fp32 with two micro-batches and
    clipping, bf16 with clipping, and fp16 with clipping, a dynamic scale and one step more,
    the one before the last two skipped for an overflow."""
    return {
        "mlp-fp32-micro2-clip": Case(Spec(model="mlp", steps=steps, micro=2, max_norm=0.05)),
        "transformer-bf16-clip": Case(Spec(model="transformer", steps=steps, max_norm=0.5,
                                           param_dtype=torch.bfloat16)),
        "mlp-fp16-overflow": Case(Spec(model="mlp", steps=steps + 1, micro=2, max_norm=1.0,
                                       param_dtype=torch.float16),
                                  overflow_steps=(steps - 2,)),
    }


def layer_stack(device: str | None = None) -> list[nn.Module]:
    """Layers large enough that what the plan does not count (Python objects, the kernels' own
    workspaces) is small beside what it does: an embedding, four blocks of 4 x 128^2 weights,
    a head."""
    torch.manual_seed(0)
    d, vocab = 128, 512
    blocks = [nn.Sequential(nn.LayerNorm(d, device=device), nn.Linear(d, 4 * d, device=device),
                            nn.GELU(), nn.Linear(4 * d, d, device=device)) for _ in range(4)]
    return [nn.Embedding(vocab, d, device=device), *blocks, nn.Linear(d, vocab, device=device)]


# The stack's input per rank: token ids.
BATCH, SEQ = 4, 64


def stack_loss(out: torch.Tensor) -> torch.Tensor:
    target = torch.zeros(out.shape[0] * out.shape[1], dtype=torch.long)
    return F.cross_entropy(out.flatten(0, 1).float(), target)


def measured_peaks(make: Callable[[], zerocore.ShardedSequential],
                   info: Callable[[zerocore.ShardedSequential], Any] = lambda model: None
                   ) -> tuple[list[int], Any]:
    """The peak bytes of two steps of the stack ``make()`` shards (``PeakMemory`` plus the host
    arena, which is mapped outside torch's allocator), after a first step, three times: the
    CPU's count can only over-count (a buffer gloo's worker thread lets go of last is not seen
    freed: PeakMemory's docstring), so the smallest is the step's own. ``info(model)`` of the
    last."""
    peaks = []
    for _ in range(3):
        with zerocore.PeakMemory("cpu") as peak:
            arena, found = _train_stack(make, info, peak)
        peaks.append(peak.peak_bytes + arena)
    return peaks, found


def _train_stack(make: Callable[[], zerocore.ShardedSequential],
                 info: Callable[[zerocore.ShardedSequential], Any],
                 peak: zerocore.PeakMemory) -> tuple[int, Any]:
    """Three steps, the peak's window opened after the first (nothing is created lazily after
    it); the bytes of the host arena. Everything it makes is its own, and goes within the
    region (PeakMemory counts what was made before and freed inside it negatively)."""
    model = make()
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        if step == 1:
            peak.mark()
        stack_loss(model(torch.zeros(BATCH, SEQ, dtype=torch.long))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    arena = model.ctx.arena
    return (arena.used if arena is not None else 0), info(model)
