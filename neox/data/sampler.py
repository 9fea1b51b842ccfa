"""Which windows each rank trains and evaluates on: ``WindowSampler``, the resumable
distributed sampler, and ``eval_batches``, a rank's share of an evaluation pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from neox.data.files import DataError


class WindowSampler:
    """Deterministic distributed sampler over ``num_samples`` windows, with a resumable position.

    Epoch ``e`` uses the permutation ``torch.randperm(num_samples)`` drawn from
    ``torch.Generator().manual_seed(seed + e)``; every rank computes the same one. A step consumes
    the next ``world_size * batch_size`` positions of it, and rank ``r`` takes positions
    ``r, r + W, r + 2W, ...`` of that block, so over an epoch rank ``r`` sees positions
    ``r, r + W, ...``: ranks are disjoint and each sample is seen at most once per epoch.

    The epoch is truncated to a multiple of ``world_size * batch_size`` (``steps_per_epoch``
    steps), like ``DistributedSampler(drop_last=True)``: every rank takes the same number of
    equal batches. The dropped remainder is different samples each epoch, since the permutation
    differs, so no sample is left out for good.

    The position is ``(epoch, samples_done)``: how many permutation positions the whole group has
    consumed in this epoch. It is advanced as each batch is handed out and rolls over to the next
    epoch as soon as an epoch is exhausted, so ``state_dict()`` taken after training on a batch
    resumes with exactly the next one. Because it counts samples of the whole group, a state
    saved by one world size or batch size also loads into another (resharding): the new layout
    continues from the same permutation position; only that epoch's dropped remainder differs.
    """

    def __init__(self, num_samples: int, *, rank: int, world_size: int, batch_size: int,
                 seed: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"sampler: rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        if num_samples < world_size * batch_size:
            raise DataError(f"the training split has {num_samples:,} windows, fewer than one step "
                            f"needs (world_size {world_size} x batch size {batch_size} = "
                            f"{world_size * batch_size:,}); use a smaller batch size, fewer "
                            f"ranks, a shorter sequence length or a longer text")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._samples_done = 0  # positions of this epoch's permutation consumed by all ranks
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) memo

    @property
    def samples_per_step(self) -> int:
        """Samples consumed by the whole group per step: ``world_size * batch_size``."""
        return self.world_size * self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps (batches per rank) in a full epoch."""
        return self.num_samples // self.samples_per_step

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_done(self) -> int:
        """Batches of this sampler's size already drawn in the current epoch. After resuming from
        a state saved with another world size or batch size, the samples that run consumed are
        counted in batches of the current size, rounded down."""
        return self._samples_done // self.samples_per_step

    @property
    def samples_done(self) -> int:
        """Permutation positions of the current epoch consumed by the whole group."""
        return self._samples_done

    def steps_left_in_epoch(self) -> int:
        """Steps until the current epoch is exhausted."""
        return (self.num_samples - self._samples_done) // self.samples_per_step

    def steps_until(self, epochs: int) -> int:
        """Steps still to take until ``epochs`` epochs (counted from epoch 0) are complete."""
        if self._epoch >= epochs:
            return 0
        return self.steps_left_in_epoch() + (epochs - self._epoch - 1) * self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of all samples (the same on every rank), ``[num_samples]``."""
        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._perm[1]

    def next_batch(self) -> torch.Tensor:
        """This rank's next batch of sample indices, ``[batch_size]`` int64, and advance."""
        step = self.samples_per_step
        block = self.permutation(self._epoch)[self._samples_done: self._samples_done + step]
        indices = block.view(self.batch_size, self.world_size)[:, self.rank].clone()
        self._samples_done += step
        self._roll_over()
        return indices

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Batches without end, from the current position, across epochs; stop the loop by step
        count (``steps_until``) or by ``epoch``."""
        while True:
            yield self.next_batch()

    def _roll_over(self) -> None:
        if self.num_samples - self._samples_done < self.samples_per_step:
            self._epoch += 1
            self._samples_done = 0

    def state_dict(self) -> dict[str, int]:
        """The position, to save with a checkpoint. ``epoch``, ``batches_done`` and ``seed`` say
        where the run is; ``samples_done``, ``num_samples``, ``world_size`` and ``batch_size``
        let ``load_state_dict`` check the data and resume under another layout."""
        return {
            "epoch": self._epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "samples_done": self._samples_done,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Needs ``epoch``, ``seed`` and either ``samples_done``
        or ``batches_done`` (the latter counted in this sampler's step size). A different seed or
        number of samples is a ``DataError``: the run would not continue the same data order."""
        missing = [key for key in ("epoch", "seed") if key not in state]
        if missing or ("samples_done" not in state and "batches_done" not in state):
            raise DataError(f"sampler state lacks {missing or ['samples_done/batches_done']}: "
                            f"got keys {sorted(state)}")
        if int(state["seed"]) != self.seed:
            raise DataError(f"sampler state was saved with seed {state['seed']} but this run uses "
                            f"seed {self.seed}; resume with the same seed")
        if "num_samples" in state and int(state["num_samples"]) != self.num_samples:
            raise DataError(f"sampler state was saved for {state['num_samples']:,} training "
                            f"windows but this run has {self.num_samples:,}; the corpus, "
                            f"tokenizer, sequence length or validation split changed")
        if "samples_done" in state:
            samples_done = int(state["samples_done"])
        else:
            samples_done = int(state["batches_done"]) * self.samples_per_step
        epoch = int(state["epoch"])
        if epoch < 0 or not 0 <= samples_done <= self.num_samples:
            raise DataError(f"sampler state is out of range: epoch {epoch}, {samples_done:,} "
                            f"samples done of {self.num_samples:,}")
        self._epoch = epoch
        self._samples_done = samples_done
        self._roll_over()


def eval_batches(num_samples: int, *, rank: int, world_size: int,
                 batch_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s share of an evaluation pass over ``num_samples`` windows, in order.

    Rank ``r`` takes samples ``r, r + W, ...``, in batches of ``batch_size`` (the last may be
    shorter); nothing is dropped, so ranks may hold one sample more than others, and a rank can
    have no batch at all when ``num_samples < world_size``. Average losses over ranks weighted
    by sample count.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"eval: rank {rank} is not in [0, world_size={world_size})")
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1, got {batch_size}")
    mine = torch.arange(rank, num_samples, world_size, dtype=torch.int64)
    return list(torch.split(mine, batch_size))
