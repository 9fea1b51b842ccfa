"""``HostWindow``: parameter offload (``Offload(params=True)``): the shards the gathers read
live on the host, and the device holds one only for the window of its gather.

Each gather's input is a window: a device copy of the shard made when the gather starts (on
the prefetch schedule, so while the unit before computes) and dropped once the gather has
consumed it; backward's gather makes it again. Frozen shards (int8 ones included) live in the
host arena; a trainable group's model copy (the master in fp32) lives there with the optimizer
(``Offload(optimizer=True)`` too), which steps it on the host.

``RoundedWindow``: the same with the optimizer on the device (DeepSpeed's offload_param alone):
the fp32 master stays on the device and no 16-bit copy is kept at all; each window is the
master rounded to the param dtype on the device, the rounding the fused optimizer gives a model
copy, so the same bits. (In fp32 the master itself is gathered: homes/device.py.)
"""

from __future__ import annotations

import torch

from zerocore.engine.homes.device import device_master
from zerocore.engine.homes.home import OffDevice, Planned, host_buffer, host_master, nbytes
from zerocore.engine.sharded_param import gather_source, is_shard, refresh_model_copy


class HostWindow(OffDevice):
    steps_on_host = True   # (asked of trainable groups: a frozen one has no optimizer)

    def __init__(self, where, values: torch.Tensor, trainable: bool):
        super().__init__(where, values, trainable)
        # The gather input's device copy while its gather is in flight (1D, the shard's dtype
        # and numel; None otherwise), and on CUDA the event of its upload, which the gather
        # stream waits for.
        self._window: torch.Tensor | None = None
        self._window_ready: torch.cuda.Event | None = None
        # A frozen shard on CUDA: the event of the last upload that read it (the host waits for
        # it before writing the shard: ``wait_host_reads``). Trainable shards keep theirs as
        # ``shard.upload_done``, which the optimizer waits for.
        self._host_read: torch.cuda.Event | None = None

    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        return host_master(self.where, values)

    def _frozen_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        # Quantized on the device, as without offload; then kept on the host.
        data = host_buffer(self.where, values.numel(), values.dtype).copy_(values)
        return torch.nn.Parameter(data, requires_grad=False)

    def gather_input(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        self._window_ready = None
        self._window = self._make_window()
        return self._window, self._window_ready

    def _make_window(self) -> torch.Tensor:
        """The device copy of the host shard that one all-gather reads: on CUDA copied up on
        the upload stream, recording the event the gather stream waits for and the host waits
        for before it writes the shard; on the CPU into a buffer of its own (the stand-in for
        device memory)."""
        shard, streams, dev = self.shard, self.where.streams, self.where.device
        if is_shard(shard):
            refresh_model_copy(shard)  # waits for the last upload first if it writes the copy
            source = gather_source(shard)
        else:
            source = shard.data
        if streams is None:
            return torch.empty(source.numel(), dtype=source.dtype, device=dev).copy_(source)
        with torch.cuda.stream(streams.upload):
            window = torch.empty(source.numel(), dtype=source.dtype, device=dev)
            window.copy_(source, non_blocking=True)
            self._window_ready = streams.upload.record_event()
        if is_shard(shard):
            shard.upload_done = self._window_ready
        else:
            self._host_read = self._window_ready
        return window

    def finish(self) -> None:
        """The gather has consumed the window (the compute stream waited for it): dropped. On
        CUDA its memory is first recorded on the compute stream, so that the caching allocator
        hands it out again only once the compute stream is past this point, after the
        collective that read it."""
        window, self._window = self._window, None
        self._window_ready = None
        if window is not None and self.where.streams is not None:
            window.record_stream(torch.cuda.current_stream(self.where.device))

    def wait_host_reads(self) -> None:
        super().wait_host_reads()
        if self._host_read is not None:
            self._host_read.synchronize()
            self._host_read = None

    @property
    def window_bytes(self) -> int:
        return nbytes(self._window)


class RoundedWindow(HostWindow):
    """A trainable group with ``Offload(params=True)`` and the optimizer on the device, in 16
    bit: windows rounded from the device master (see the module's docstring)."""

    steps_on_host = False

    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        return device_master(self.where, values, keep_copy=False)

    def _make_window(self) -> torch.Tensor:
        """The master rounded to param_dtype, on the gather stream once it has waited for the
        compute stream (where the optimizer wrote the master)."""
        streams, master = self.where.streams, self.shard.detach()
        if streams is None:
            return master.to(self.where.param_dtype)
        with torch.cuda.stream(streams.gather):
            return master.to(self.where.param_dtype)

    def state_bytes(self) -> tuple[int, int]:
        return 0, self.shard.numel() * 4   # a master, no copy kept

    @classmethod
    def planned(cls, numel: int, param_bytes: int) -> Planned:
        return Planned(params=0, masters=numel * 4, optimizer=numel * 8, mirrors=0)
