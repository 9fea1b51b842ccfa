"""``LossScaler``: the optimizer step of a sharded model — global gradient statistics, overflow
agreement, dynamic loss scaling for fp16, and gradient-norm clipping — in one small all-reduce.

Every rank computes, over its gradient shards, the sum of squares and a non-finite flag
(``zerocore.ops.grad_stats``, no host synchronisation), then one all-reduce of those two numbers
gives every rank the same global norm and the same overflow verdict: either all ranks step or all
skip. Unscaling and clipping are folded into one factor that the fused Adam kernel applies while
it reads the gradient, so the gradients are read once.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from zerocore.comm import collectives
from zerocore.comm.device import comm_device
from zerocore.comm.lockstep import STATS, lockstep_of
from zerocore.kernels import ops
from zerocore.optim import Adam
from zerocore.policies import LossScaling


@dataclasses.dataclass(frozen=True)
class StepResult:
    grad_norm: float   # global L2 norm of the unscaled gradients (inf/nan when skipped)
    skipped: bool      # True when a gradient was inf/nan on any rank: no parameter changed
    loss_scale: float  # the scale that was used for this step's loss


class LossScaler:
    """Scales the loss (fp16 only: ``dynamic=True``) and steps an optimizer over sharded grads.

    Usage::

        scaler = zerocore.LossScaler(model.group, dynamic=(param_dtype == torch.float16))
        scaler.scale(loss).backward()
        result = scaler.step(optimizer, max_norm=1.0)
        optimizer.zero_grad()
    """

    def __init__(self, group: dist.ProcessGroup, *, dynamic: bool,
                 policy: LossScaling = LossScaling(),
                 counter: collectives.CommCounter | None = None,
                 device: torch.device | None = None):
        """device: where the model computes (``model.device``), where the statistics of
        offloaded (CPU) gradients are all-reduced on a group without a CPU backend (NCCL
        alone); default the group's bound device, else the current CUDA device."""
        self.group = group
        self.device = device
        self.dynamic = dynamic
        self.policy = policy
        self.counter = counter if counter is not None else collectives.CommCounter()
        self.loss_scale = policy.init_scale if dynamic else 1.0
        self._hysteresis_left = policy.hysteresis
        self._good_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.dynamic else loss

    def step(self, optimizer: torch.optim.Optimizer, *,
             max_norm: float | None = None) -> StepResult:
        """Steps ``optimizer`` unless some gradient anywhere is inf/nan; clips to ``max_norm``
        (global L2 norm over all ranks' shards, like ``torch.nn.utils.clip_grad_norm_`` on the
        unsharded model) if given."""
        for lockstep in lockstep_of(p for g in optimizer.param_groups for p in g["params"]):
            lockstep.before_step(STATS)  # the ranks agree on where they are first
        sum_sq, nonfinite = global_grad_stats(_grads(optimizer), self.group, self.counter,
                                              self.device)
        return self.step_with_stats(optimizer, sum_sq, nonfinite, max_norm=max_norm)

    def grad_norm(self, sum_sq: float, nonfinite: bool) -> float:
        """The global norm of the unscaled gradients from ``global_grad_stats``' figures (nan
        when a gradient is inf or nan)."""
        if nonfinite or not math.isfinite(sum_sq):
            return float("nan")
        return math.sqrt(sum_sq) / self.loss_scale  # (1 unless dynamic)

    def step_with_stats(self, optimizer: torch.optim.Optimizer, sum_sq: float, nonfinite: bool,
                        *, max_norm: float | None = None) -> StepResult:
        """``step`` given ``global_grad_stats(...)`` of the optimizer's gradients, computed
        already (``ShardedTrainer`` logs the norm before it steps)."""
        scale = self.loss_scale
        norm = self.grad_norm(sum_sq, nonfinite)
        if math.isnan(norm):
            self._update(overflow=True)
            return StepResult(norm, True, scale)
        clip = 1.0
        if max_norm is not None:
            clip = min(1.0, max_norm / (norm + 1e-6))  # the coefficient of clip_grad_norm_
        inv = clip / scale
        if isinstance(optimizer, Adam):
            optimizer.step(inv_grad_scale=inv)
        else:
            if inv != 1.0:
                for g in _grads(optimizer):
                    g.mul_(inv)
            optimizer.step()
        self._update(overflow=False)
        return StepResult(norm, False, scale)

    def _update(self, overflow: bool) -> None:
        """DeepSpeed's dynamic loss-scale rule (hysteresis not consecutive)."""
        if not self.dynamic:
            return
        p = self.policy
        if overflow:
            if self._hysteresis_left <= 1:
                self.loss_scale = max(self.loss_scale / 2, p.min_scale)
            else:
                self._hysteresis_left -= 1
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps % p.window == 0:
                self.loss_scale *= 2
                self._hysteresis_left = p.hysteresis

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale, "hysteresis_left": self._hysteresis_left,
                "good_steps": self._good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("dynamic", self.dynamic)) != self.dynamic:
            # A run resumed in another precision (fp16 <-> bf16/fp32): the saved scale belongs
            # to the other; this scaler keeps its own start (1 when not dynamic, else the
            # policy's initial scale), or every gradient would be divided by a scale that
            # nothing multiplied it by.
            return
        self.loss_scale = float(state["loss_scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._good_steps = int(state["good_steps"])


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def global_grad_stats(grads: list[torch.Tensor], group: dist.ProcessGroup,
                      counter: collectives.CommCounter,
                      device: torch.device | None = None) -> tuple[float, bool]:
    """Collective: the sum of squares of every rank's ``grads`` and whether any element of them
    is inf or nan, the same on every rank (one all-reduce, the one host synchronisation).

    The statistics are all-reduced beside the gradients when the group has a backend for their
    device (offloaded ones are on the CPU), else on ``device``, the model's (NCCL alone, as
    ``init_process_group()`` picks on a GPU machine; ``comm.device.choose_comm_device``)."""
    device = comm_device(group, grads[0].device if grads else torch.device("cpu"), device)
    stats = torch.zeros(2, dtype=torch.float32, device=device)
    for g in grads:
        if g.device == device:
            ops.grad_stats(g, stats)
        else:
            stats += ops.grad_stats(g).to(device)
    collectives.all_reduce_sum(stats, group, counter)
    sum_sq, nonfinite = stats.tolist()
    return sum_sq, nonfinite > 0
