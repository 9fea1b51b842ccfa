"""``ShardParameter``: this rank's flat shard of one layer's trainable parameters.

It is what ``zerocore.shard`` exposes to optimizers (``model.parameters()``): a 1-D fp32 tensor
holding this rank's contiguous slice of the layer's padded flat trainable parameters (the master
weights), with ``.grad`` the matching fp32 slice of the reduce-scattered gradient. When the layer
computes in fp16/bf16, ``model_copy`` is the same slice in that dtype, on the master's device.

Keeping ``model_copy`` in step with the master:
- ``zerocore.optim`` writes it in the same pass as it updates the master weights and then calls
  ``mark_model_copy_synced()``;
- any other in-place writer of the master (``torch.optim.AdamW``, ``copy_`` under no_grad) bumps
  the tensor's version counter, and ``refresh_model_copy()`` (called by the engine before every
  all-gather) re-derives the copy.
``copy_generation`` increases whenever the copy changes, so a device-side mirror of it (CPU
offload) knows when to fetch it again.
"""

from __future__ import annotations

import torch


class ShardParameter(torch.nn.Parameter):
    """A 1-D fp32 master shard; ``model_copy`` is its low-precision twin, or None."""

    model_copy: torch.Tensor | None  # 1D, fp16/bf16, same numel and device; None in fp32
    copy_generation: int             # bumped each time the master (and its copy) change
    _synced_version: int             # the master's version when model_copy was last derived
    # The parameters of the layer's trainable group, by the name the model gives them, and the
    # part of each this shard holds: (name, start, end) in shard coordinates (a parameter may
    # straddle shards; alignment padding belongs to none). For per-parameter optimizer
    # settings (``zerocore.optim``'s ``param_overrides``). Set by the engine.
    names: tuple[str, ...]
    segments: tuple[tuple[str, int, int], ...]

    def __new__(cls, data: torch.Tensor, model_copy: torch.Tensor | None = None,
                requires_grad: bool = True) -> "ShardParameter":
        assert data.dim() == 1 and data.dtype == torch.float32
        p = super().__new__(cls, data, requires_grad)
        p.model_copy = model_copy
        p.copy_generation = 0
        p._synced_version = p._version
        p.names, p.segments = (), ()
        return p

    def set_layout(self, slots: list[tuple[str, int, int]], lo: int) -> None:
        """slots: (name, first element, numel) of each parameter in the unsharded flat group;
        lo: where this shard starts in it."""
        hi = lo + self.numel()
        self.names = tuple(name for name, _, _ in slots)
        self.segments = tuple((name, max(start, lo) - lo, min(start + n, hi) - lo)
                              for name, start, n in slots if start < hi and start + n > lo)

    def prefix_names(self, prefix: str) -> None:
        """Names relative to a container (``zerocore.shard``'s layer index)."""
        self.names = tuple(prefix + n for n in self.names)
        self.segments = tuple((prefix + n, a, b) for n, a, b in self.segments)

    def mark_model_copy_synced(self) -> None:
        """Called by a writer that updated the master and model_copy together."""
        self._synced_version = self._version
        self.copy_generation += 1

    @torch.no_grad()
    def refresh_model_copy(self) -> None:
        """Re-derives ``model_copy`` from the master if something else changed the master."""
        if self._version != self._synced_version:
            if self.model_copy is not None:
                self.model_copy.copy_(self.data)
            self.mark_model_copy_synced()

    def gather_source(self) -> torch.Tensor:
        """The tensor whose values the layer computes with: the copy, or the fp32 master."""
        return self.data if self.model_copy is None else self.model_copy
