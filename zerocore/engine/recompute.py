"""What a recomputed forward must reproduce of the first one (``zerocore.Recompute``): the
random-number generators' states and the autocast settings in force when the layer first ran.

Dropout and any other random op draw from the CPU generator (CPU tensors) or the device's
generator (CUDA tensors). Capturing both before the first forward and installing them around
the recomputation makes it draw the same numbers; the states in force before the recomputation
are put back afterwards, so the rest of the program's random stream is the one it would have
been without recomputation. torch.utils.checkpoint does the same (``preserve_rng_state``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class ForwardState:
    """The generator states and autocast settings of one forward, to run it again alike."""

    cpu_rng: torch.Tensor                 # torch.get_rng_state(): uint8, ~5 KB
    cuda_device: torch.device | None      # the layer's CUDA device, if it computes on one
    cuda_rng: torch.Tensor | None         # that device's generator state
    # (device type, enabled, dtype) of autocast for the CPU and the compute device
    autocast: tuple[tuple[str, bool, torch.dtype], ...]

    @staticmethod
    def capture(device: torch.device) -> "ForwardState":
        cuda = device if device.type == "cuda" else None
        kinds = ("cpu",) if cuda is None else ("cpu", "cuda")
        return ForwardState(
            cpu_rng=torch.get_rng_state(), cuda_device=cuda,
            cuda_rng=torch.cuda.get_rng_state(cuda) if cuda is not None else None,
            autocast=tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                           for k in kinds))

    @contextlib.contextmanager
    def reinstated(self) -> Iterator[None]:
        """Runs the body with this forward's generator states and autocast settings, then puts
        the generators back as they were."""
        cpu_now = torch.get_rng_state()
        cuda_now = (torch.cuda.get_rng_state(self.cuda_device)
                    if self.cuda_device is not None else None)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_device is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.cuda_device)
        try:
            with contextlib.ExitStack() as stack:
                for kind, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
                yield
        finally:
            torch.set_rng_state(cpu_now)
            if self.cuda_device is not None:
                torch.cuda.set_rng_state(cuda_now, self.cuda_device)
