"""The compute and reduction dtypes by the names the recipe and the flags use, and the compute
dtype's default for a device."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "resolve_dtype"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``--dtype``, or its default for the device: fp32 on the CPU; bf16 on a GPU (fp16 where
    the GPU has no bf16)."""
    if name is not None:
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
