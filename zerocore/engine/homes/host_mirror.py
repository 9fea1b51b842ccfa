"""``HostMirror``: the optimizer on the host (``Offload(optimizer=True)`` alone), the device
keeping a mirror of the model copy.

The trainable shard's fp32 master, its model copy (the master itself in fp32), its gradient and
the Adam moments live in host memory (the sharding's host arena) and the CPU fused kernel steps
them. The device keeps a mirror of the model copy between steps, which the gathers read: it is
brought up to date once per step, when the optimizer changed the copy, at the start of forward
(``upload``), on the upload stream on CUDA (engine/offload.py). Frozen groups stay on the device
(homes/device.py).
"""

from __future__ import annotations

import dataclasses

import torch

from zerocore.engine.homes.home import OffDevice, Planned, host_master, nbytes
from zerocore.engine.sharded_param import gather_source, is_offloaded, refresh_model_copy


class HostMirror(OffDevice):
    steps_on_host = True
    uploads_before_forward = True

    def __init__(self, where, values: torch.Tensor, trainable: bool):
        assert trainable, "a mirror is of a trainable model copy"
        super().__init__(where, values, trainable)
        # 1D, param dtype, shard_numel: the gather input, on the device.
        self._mirror = torch.empty(self.shard.numel(), dtype=where.param_dtype,
                                   device=where.device)
        self._mirror_generation = -1   # the copy's ``copy_generation`` last uploaded
        # On CUDA: recorded on the compute stream once it has waited for an all-gather that
        # read the mirror; the next upload into the mirror waits for it.
        self._mirror_read: torch.cuda.Event | None = None

    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        return host_master(self.where, values)

    def gather_input(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        self.upload()
        return self._mirror, self.shard.upload_done

    def finish(self) -> None:
        if self.where.streams is not None:
            self._mirror_read = torch.cuda.current_stream(self.where.device).record_event()

    def upload(self) -> None:
        """Brings the device mirror up to date with the host gather source, if it changed since
        the last upload (the optimizer stepped, or the master was written). On CUDA the copy
        runs on the upload stream, after the last all-gather that read the mirror, and records
        the event that the next all-gather and the host's next write of the source wait for; on
        the CPU it is a plain copy."""
        shard = self.shard
        assert is_offloaded(shard)
        refresh_model_copy(shard)  # waits for the last upload first if it writes the copy
        if self._mirror_generation == shard.copy_generation:
            return
        streams = self.where.streams
        if streams is None:
            self._mirror.copy_(gather_source(shard))
        else:
            if self._mirror_read is not None:
                streams.upload.wait_event(self._mirror_read)
            with torch.cuda.stream(streams.upload):
                self._mirror.copy_(gather_source(shard), non_blocking=True)
                shard.upload_done = streams.upload.record_event()
        self._mirror_generation = shard.copy_generation

    @property
    def mirror_bytes(self) -> int:
        return nbytes(self._mirror)

    @classmethod
    def planned(cls, numel: int, param_bytes: int) -> Planned:
        return dataclasses.replace(super().planned(numel, param_bytes),
                                   mirrors=numel * param_bytes)
