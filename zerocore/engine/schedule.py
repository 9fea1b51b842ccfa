"""The step's schedule: which layers are prefetched, kept gathered between forward and backward,
held gathered from step to step and recomputed, decided once per sharded model from its policies
and its layers' sizes, and what one step therefore moves.

The runtime (runtime.py), under both front doors, asks it what to keep, prefetch and recompute;
``zerocore.plan`` runs that same runtime on fake tensors. The order of the layers is the model's
(hooks in whatever order it calls its units); what is done with each is the schedule's.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from zerocore.policies import Prefetch, Recompute

# A layer's flat groups as the traffic count sees them: (padded numel, trainable, bytes one
# gather moves: the param dtype's, or int8 values and scales).
Groups = Sequence[tuple[int, bool, int]]


@dataclasses.dataclass(frozen=True)
class Schedule:
    num_layers: int
    # Prefetch.keep_gathered's choice: trainable groups kept from forward to backward, frozen
    # groups resident (gathered once, then kept from step to step).
    kept: frozenset[int]
    recomputed: frozenset[int]
    prefetch_forward: bool   # start layer i+1's gather while layer i computes
    prefetch_backward: bool  # start the previous layer's gather while a layer's backward runs
    keep_last: bool          # the last layer of a forward stays gathered for its backward

    @classmethod
    def of(cls, prefetch: Prefetch, recompute: Recompute | None, gathered_bytes: list[int],
           recomputable: int | None = None) -> "Schedule":
        """The schedule of layers of these gathered sizes (in index order; every rank computes
        the same from the same layouts). ``recomputable``: how many of the first layers
        ``Recompute`` may name (``shard_model``'s units; the root after them never is)."""
        n = len(gathered_bytes)
        candidates = n if recomputable is None else recomputable
        recomputed = frozenset()
        if recompute is not None:
            recompute.check_range(candidates)
            recomputed = frozenset(i for i in range(candidates) if recompute.selects(i))
        return cls(n, prefetch.layers_kept(gathered_bytes), recomputed, prefetch.forward,
                   prefetch.backward, prefetch.keep_last)

    def resident(self, index: int) -> bool:
        """Whether layer ``index``'s frozen group stays gathered from step to step."""
        return index in self.kept

    def keeps_for_backward(self, index: int, *, last: bool) -> bool:
        """Whether a layer whose forward built a graph stays gathered until its backward (else
        it is freed after its forward, and gathered again for the backward). ``last``: it was
        the last layer of this forward."""
        return index in self.kept or (last and self.keep_last)

    def traffic(self, layers: Sequence[Groups], *, reduce_bytes: int,
                input_requires_grad: bool = False, root: Groups | None = None,
                forward_only: bool = False) -> tuple[int, int]:
        """(bytes all-gathered, bytes reduce-scattered) by one forward and backward, counted as
        the unsharded buffers (``CommCounter``). ``forward_only``: the forward's gathers alone
        (hpZ's gathers across the nodes: backward's stay within the node).

        A layer is gathered for forward, and again for backward unless no autograd node covers
        it (it comes before the first layer with a trainable group, when the input needs no
        gradient) or it is kept between the passes; the frozen groups of ``kept`` layers are
        resident and count nothing here (the step that first gathers them moves them once
        more). ``root``: ``shard_model``'s root unit (the last index), gathered once per step,
        as it stays gathered from its first operation to the end of backward. Trainable groups
        are reduce-scattered once."""
        first = 0 if input_requires_grad else next(
            (i for i, groups in enumerate(layers) if any(g[1] for g in groups)), len(layers))
        gather = reduce = 0
        for i, groups in enumerate(layers):
            in_backward = i >= first
            held = in_backward and self.keeps_for_backward(i, last=i == len(layers) - 1)
            times = 2 if in_backward and not held and not forward_only else 1
            for padded, trainable, nbytes in groups:
                if self.resident(i) and not trainable:
                    continue
                gather += nbytes * times
                if trainable:
                    reduce += padded * reduce_bytes
        for padded, trainable, nbytes in root or ():
            if trainable or not self.resident(self.num_layers - 1):
                gather += nbytes
            if trainable:
                reduce += padded * reduce_bytes
        return gather, reduce

