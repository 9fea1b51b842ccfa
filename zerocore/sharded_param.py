"""``ShardParameter``: this rank's flat shard of one layer's trainable parameters.

It is what ``zerocore.shard`` exposes to optimizers (``model.parameters()``): a 1-D fp32 tensor
holding this rank's contiguous slice of the layer's padded flat trainable parameters (the master
weights), with ``.grad`` the matching fp32 slice of the reduce-scattered gradient. When the layer
computes in fp16/bf16, ``model_copy`` is the same slice in that dtype: the all-gather input.

``zerocore.optim`` writes ``model_copy`` in the same pass as it updates the master weights and says
so with ``mark_model_copy_synced()``. Any other writer of the master (``torch.optim.AdamW``,
``load_state_dict``) bumps the tensor's version counter, and the engine then refreshes
``model_copy`` from the master before the next all-gather (``refresh_model_copy``).
"""

from __future__ import annotations

import torch


class ShardParameter(torch.nn.Parameter):
    """A 1-D fp32 master shard; ``model_copy`` is its low-precision twin, or None."""

    model_copy: torch.Tensor | None  # 1D, fp16/bf16, same numel; None when computing in fp32
    _synced_version: int

    def __new__(cls, data: torch.Tensor, model_copy: torch.Tensor | None = None,
                requires_grad: bool = True) -> "ShardParameter":
        assert data.dim() == 1 and data.dtype == torch.float32
        p = super().__new__(cls, data, requires_grad)
        p.model_copy = model_copy
        p._synced_version = p._version
        return p

    def mark_model_copy_synced(self) -> None:
        self._synced_version = self._version

    @torch.no_grad()
    def refresh_model_copy(self) -> None:
        """Re-derives ``model_copy`` from the master weights if something changed them since it
        was last written."""
        if self.model_copy is not None and self._version != self._synced_version:
            self.model_copy.copy_(self.data)
        self._synced_version = self._version
