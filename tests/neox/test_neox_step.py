"""neox/run/step.py: the loss and the count of right predictions of a micro-batch."""

from __future__ import annotations

import pytest
import torch

from neox.run.step import correct_predictions, micro_batch_loss


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (2, 17, 1000), (4, 33, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_correct_predictions_are_argmaxs_count_ties_and_nans_included(shape, dtype):
    """Exactly ``(logits.argmax(-1) == targets).sum()``: the same integer, not a tolerance.
    Logits rounded to the compute dtype tie often (bf16 has 8 bits of mantissa), and argmax
    takes the first maximum, so ties are forced: a maximum repeated at index 0 and at the
    target, some targets at the later copy (wrong for argmax) and some at the first (right);
    and NaN rows, which argmax treats as the maximum."""
    g = torch.Generator().manual_seed(sum(shape))
    vocab = shape[-1]
    logits = torch.randn(*shape, generator=g).to(dtype).float()
    targets = torch.randint(0, vocab, shape[:-1], generator=g)
    flat, t = logits.view(-1, vocab), targets.view(-1)
    rows = flat.shape[0]
    if vocab > 2:
        flat[::3, 1] = flat[::3].amax(-1)          # a tie between index 1 and another maximum
        flat[::3, 2] = flat[::3, 1]
        t[::3] = 2                                 # the later copy: argmax says wrong
        t[1::6] = 1
        flat[1::6, 1] = flat[1::6].amax(-1) + 1    # the only maximum: right
    if rows > 4:
        flat[4, vocab // 2] = float("nan")
        t[4] = vocab // 2                          # argmax picks the NaN: right
        flat[min(5, rows - 1), 0] = float("nan")   # a NaN elsewhere: wrong unless targeted
    expected = (logits.argmax(-1) == targets).sum()
    assert correct_predictions(logits, targets).item() == expected.item()
    assert micro_batch_loss(logits.to(dtype), targets)[1].item() == expected.item()


def test_correct_predictions_count_a_real_hit():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 1.0, 0.0]]])
    assert correct_predictions(logits, torch.tensor([[1, 0]])).item() == 2
    assert correct_predictions(logits, torch.tensor([[2, 1]])).item() == 0
