"""Multi-process tests of ``zerocore.LossScaler`` on a sharded fp16 model (gloo on the CPU, world
sizes 1, 2 and 3): every rank agrees on an overflow that only one rank sees and skips the step
with it; DeepSpeed's dynamic loss-scale rule (halve after ``hysteresis`` overflows, double after
``window`` good steps, hysteresis restored only when the scale grows); training resumes after a
skip.

Overflows are injected into the gradient shard of the last rank only, after backward: only that
rank's own statistics can reveal them, so a rank that decided alone would step while the others
skip.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from tests.support.dist_utils import inject_overflow

LR = 1e-3
# A moderate start (DeepSpeed's 2**16 would be fine too) keeps the scaled gradients far from
# fp16's 65504 for this model, so the only overflows are the injected ones.
INIT_SCALE = 2.0**10


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(11, 29), nn.GELU()),
            nn.Sequential(nn.LayerNorm(29), nn.Linear(29, 29), nn.GELU()),
            nn.Linear(29, 5)]


def local_batch(rank: int, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randn(4 * world_size, 11, generator=g),
            torch.randn(4 * world_size, 5, generator=g))
    return x.chunk(world_size)[rank].half(), y.chunk(world_size)[rank]


def snapshot(model: zerocore.ShardedSequential, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything an optimizer step may change on this rank: masters, fp16 copies, Adam state."""
    out = []
    for p in model.trainable_shards():
        out += [p.detach().clone(), p.model_copy.clone()]
        out += [t.clone() for t in opt.state[p].values()]  # exp_avg, exp_avg_sq, step
    return out


def run_steps(rank: int, world_size: int, policy: zerocore.LossScaling,
              overflow_steps: list[int], steps: int) -> list[dict]:
    """Trains in fp16 with a dynamic loss scale, injecting an overflow on the last rank at the
    given steps; returns what each step did, as this rank saw it."""
    model = zerocore.shard(layers(), mixed_precision=zerocore.MixedPrecision(torch.float16))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR)
    scaler = zerocore.LossScaler(model.group, dynamic=True, policy=policy)
    history = []
    for step in range(steps):
        x, y = local_batch(rank, world_size, step)
        loss = (model(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        if step in overflow_steps and rank == world_size - 1:
            inject_overflow(model.layers[:1], model.rank)
        # The unscaled global gradient norm, computed here from the shards.
        sum_sq = torch.tensor([sum(p.grad.double().square().sum().item()
                                   for p in model.trainable_shards())])
        dist.all_reduce(sum_sq)
        before = snapshot(model, opt)
        result = scaler.step(opt)
        opt.zero_grad()
        after = snapshot(model, opt)
        history.append({
            "skipped": result.skipped, "used_scale": result.loss_scale,
            "scale_after": scaler.loss_scale, "grad_norm": result.grad_norm,
            "expected_norm": math.sqrt(sum_sq.item()) / result.loss_scale,
            "changed": [not torch.equal(a, b) for a, b in zip(before, after)],
        })
    return history


def test_defaults_are_deepspeeds():
    p = zerocore.LossScaling()
    assert (p.init_scale, p.window, p.hysteresis, p.min_scale) == (2.0**16, 1000, 2, 1.0)


def check_steps(histories: list[list[dict]], want: list[tuple[bool, float, float]]) -> None:
    """want[i] = (skipped, scale used, scale after) of step i, the same on every rank."""
    for rank, history in enumerate(histories):
        for i, (h, (skipped, used, after)) in enumerate(zip(history, want, strict=True)):
            where = f"rank {rank}, step {i}"
            assert (h["skipped"], h["used_scale"], h["scale_after"]) == (skipped, used, after), \
                (where, h)
            if skipped:
                assert not any(h["changed"]), \
                    f"{where}: a skipped step changed the optimizer state"
                assert math.isnan(h["grad_norm"]), where
            else:
                assert all(h["changed"]), f"{where}: a step left some state unchanged"
                # The same squares summed in another order (double here, fp32 in the kernel).
                assert h["grad_norm"] == pytest.approx(h["expected_norm"], rel=1e-5), where


S = INIT_SCALE


def test_overflow_on_one_rank_skips_everywhere_hysteresis_2(world):
    """Default hysteresis 2: the first overflow only spends hysteresis, the second halves."""
    policy = zerocore.LossScaling(init_scale=S)
    histories = world.run(run_steps, policy, [1, 2], 5)
    check_steps(histories, [(False, S, S), (True, S, S), (True, S, S / 2), (False, S / 2, S / 2),
                            (False, S / 2, S / 2)])


def test_overflow_on_one_rank_hysteresis_1(world):
    policy = zerocore.LossScaling(init_scale=S, hysteresis=1)
    histories = world.run(run_steps, policy, [1, 2], 4)
    check_steps(histories, [(False, S, S), (True, S, S / 2), (True, S / 2, S / 4),
                            (False, S / 4, S / 4)])


def test_scale_grows_after_window_good_steps(world):
    policy = zerocore.LossScaling(init_scale=S, window=3)
    histories = world.run(run_steps, policy, [], 7)
    check_steps(histories, [(False, S, S), (False, S, S), (False, S, 2 * S), (False, 2 * S, 2 * S),
                            (False, 2 * S, 2 * S), (False, 2 * S, 4 * S), (False, 4 * S, 4 * S)])


def test_hysteresis_restored_only_when_scale_grows(world):
    """DeepSpeed's non-consecutive hysteresis: an overflow spends one unit of hysteresis, good
    steps do not give it back until the scale grows, and after growing it is full again."""
    policy = zerocore.LossScaling(init_scale=S, window=3)
    histories = world.run(run_steps, policy, [1, 5, 6], 8)
    check_steps(histories, [
        (False, S, S),
        (True, S, S),            # hysteresis 2 -> 1, good-step count restarts
        (False, S, S),
        (False, S, S),
        (False, S, 2 * S),       # third good step since the overflow: grow, hysteresis back to 2
        (True, 2 * S, 2 * S),    # 2 -> 1
        (True, 2 * S, S),        # spent: halve
        (False, S, S),
    ])


def test_scale_never_below_minimum(world):
    policy = zerocore.LossScaling(init_scale=4.0, hysteresis=1, min_scale=2.0)
    histories = world.run(run_steps, policy, [0, 1, 2], 4)
    check_steps(histories, [(True, 4.0, 2.0), (True, 2.0, 2.0), (True, 2.0, 2.0),
                            (False, 2.0, 2.0)])


def test_a_scaler_ignores_the_state_of_the_other_precision():
    """A run resumed in bf16 from an fp16 checkpoint (or the reverse) keeps its own start: the
    fp16 scale, loaded into a scaler that does not scale the loss, would divide every gradient
    by it."""
    fp16 = zerocore.LossScaler(None, dynamic=True)
    fp16.loss_scale = 1024.0
    bf16 = zerocore.LossScaler(None, dynamic=False)
    bf16.load_state_dict(fp16.state_dict())
    assert bf16.loss_scale == 1.0 and bf16.grad_norm(4.0, False) == 2.0
    again = zerocore.LossScaler(None, dynamic=True)
    again.load_state_dict(bf16.state_dict())
    assert again.loss_scale == again.policy.init_scale
    same = zerocore.LossScaler(None, dynamic=True)
    same.load_state_dict(fp16.state_dict())
    assert same.loss_scale == 1024.0
