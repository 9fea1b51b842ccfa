"""One training step of neox as the engine sees it, shared by the run (``neox.run.training``) and
the plan (``neox.plan``), so that what the plan traces is what the run executes: the loss of a
micro-batch (the engine policies a recipe asks for are its parts' ``policies()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


__all__ = ["micro_batch_loss", "correct_predictions"]


def micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean token cross-entropy, number of correct argmax predictions) of logits (B, T, V) in
    the compute dtype against targets (B, T).

    The softmax runs in fp32 whatever the compute dtype. The fp32 copy of the logits is not
    kept for backward (cross-entropy keeps its own fp32 log-probabilities) and goes when this
    returns: at a 50k vocabulary it is the largest activation of a step, so the caller must not
    hold it through backward either."""
    logits = logits.float()                                                # (B, T, V) fp32
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss, correct_predictions(logits, targets)


@torch.no_grad()
def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many positions' argmax over the last dimension of ``logits`` is the target: exactly
    ``(logits.argmax(-1) == targets).sum()``, ties and NaNs included (argmax's first maximum,
    a NaN counting as the maximum), at a fraction of its cost on the CPU. There argmax over a
    vocabulary is a scalar loop: 50-100 ms a step for the built-in run's 2,048 x 8,192 logits,
    against 11 ms for the maximum alone (measured 2026-12-06, one thread). Only the positions
    whose target holds the maximum (or that hold a NaN) can be right; argmax decides those.
    On a GPU, argmax itself: selecting those positions would wait for the device."""
    if logits.device.type != "cpu":
        return (logits.argmax(-1) == targets).sum()
    best = logits.amax(-1)
    at_target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    maybe = (at_target == best) | best.isnan()
    return (logits[maybe].argmax(-1) == targets[maybe]).sum()
