"""NVMe offload's homes (ZeRO-Infinity): what lives in the sharding's scratch file
(engine/nvme_store.py), moved through its bounded pool of host buffers.

``Offload(optimizer="nvme")``: a trainable shard's fp32 master and Adam moments live in the
scratch; the tensor itself holds no values (``placeholder``), and the optimizer steps the record
chunk by chunk through the pool (zerocore.optim). The model copy the kernel writes (in the param
dtype, fp32 included: it is what the layers compute with) stays in host memory and reaches the
gathers as the host homes' does: through a device mirror (``NvmeMirror``, parameters not
offloaded) or a window per gather (``NvmeHostWindow``, ``params="cpu"``).

``Offload(params="nvme")`` (``NvmeWindow``): the shards the gathers read live in the scratch too:
the frozen shards, and with the optimizer there the model copies. Each gather's window is read
into a pool slot (read ahead, as a rule, while the units before compute: ``NvmeStore``) and
copied to the device from there.
"""

from __future__ import annotations

import dataclasses

import torch

from zerocore.engine.homes.home import Planned, add_published, host_buffer, nbytes
from zerocore.engine.homes.host_mirror import HostMirror
from zerocore.engine.homes.host_window import HostWindow
from zerocore.engine.nvme_store import Region
from zerocore.engine.sharded_param import new_shard, placeholder


def nvme_master(where, values: torch.Tensor, copy: torch.Tensor | None) -> torch.nn.Parameter:
    """A trainable shard whose fp32 master (``values``, written now) and Adam moments (zeros)
    live in the sharding's scratch, and whose model copy (in the param dtype) is ``copy``, in
    host memory, or (None: ``params="nvme"``) in the scratch too. Either is written now,
    rounded from the master. In fp32 with the copy in host memory (a store without
    ``masters``) the copy is the master, and the scratch holds the moments alone."""
    store, dtype = where.store, where.param_dtype
    record = store.add_adam(values.numel(), "a layer's fp32 master and Adam moments",
                            copy_dtype=dtype if copy is None else None,
                            master=None if store.masters else copy)
    if copy is not None:
        copy.copy_(values)
    if not record.master_in_memory:
        store.write_values(record.master, values)
    if copy is None:
        store.write_values(record.copy, values.to(dtype))
    shard = new_shard(placeholder(values.numel()), copy, offloaded=True,
                      overlapped=where.overlap)
    shard.nvme = record
    shard.host_threads = where.host_threads
    add_published(where, shard, copy)
    return shard


class _MastersOnNvme:
    """The trainable shard of a home whose masters and moments are on NVMe, the model copy in
    host memory (in fp32 the master itself); counted as the copy (and a mirror): the master,
    if apart, is in ``nvme_bytes``."""

    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        copy = host_buffer(self.where, values.numel(), self.where.param_dtype)
        return nvme_master(self.where, values, copy)

    def state_bytes(self) -> tuple[int, int]:
        copy = nbytes(self.shard.model_copy)   # (the gathers read the published one, if any)
        return copy + nbytes(self.shard.published) + self.mirror_bytes, 0

    @classmethod
    def planned(cls, numel: int, param_bytes: int) -> Planned:
        return dataclasses.replace(super().planned(numel, param_bytes), masters=0,
                                   optimizer=0)


class NvmeMirror(_MastersOnNvme, HostMirror):
    """``Offload(optimizer="nvme")``, parameters on the device: a mirror of the host copy."""


class NvmeHostWindow(_MastersOnNvme, HostWindow):
    """``Offload(optimizer="nvme", params="cpu")``: a window of the host copy per gather."""


class NvmeWindow(HostWindow):
    """``Offload(params="nvme")``: the frozen shard, or (with ``optimizer="nvme"``) the
    trainable master, moments and model copy, in the scratch; a window read per gather."""

    frozen_in_memory = False

    def __init__(self, where, values: torch.Tensor, trainable: bool):
        # A frozen shard's place in the scratch (a trainable one's copy is its ``.nvme.copy``).
        self._disk: Region | None = None
        super().__init__(where, values, trainable)

    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        return nvme_master(self.where, values, None)

    def _frozen_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        store = self.where.store
        self._disk = store.add_region(values.numel(), values.dtype,
                                      "a layer's frozen parameter shard")
        store.write_values(self._disk, values)
        # The tensor holds no values (``_disk`` has them).
        return torch.nn.Parameter(placeholder(values.numel(), values.dtype),
                                  requires_grad=False)

    @property
    def disk_region(self) -> Region | None:
        if self._disk is not None:
            return self._disk
        return self.shard.nvme.copy

    def _make_window(self) -> torch.Tensor:
        """The window made from the shard's values read into a pool slot; on CUDA uploaded
        from the (pinned) slot on the upload stream, the slot read into again once that upload
        is done."""
        store, streams, dev = self.where.store, self.where.streams, self.where.device
        source, slot = store.window_source(self.disk_region)
        if streams is None:
            window = torch.empty(source.numel(), dtype=source.dtype, device=dev).copy_(source)
            store.window_copied(slot, None)
            return window
        with torch.cuda.stream(streams.upload):
            window = torch.empty(source.numel(), dtype=source.dtype, device=dev)
            window.copy_(source, non_blocking=True)
            self._window_ready = streams.upload.record_event()
        store.window_copied(slot, self._window_ready)
        return window

    def write(self, data: torch.Tensor) -> None:
        self.where.store.write_values(self._disk, data.to(self._disk.dtype))

    def values(self) -> torch.Tensor:
        if self._disk is not None:
            return self.where.store.read_values(self._disk)
        return super().values()

    def saved_values(self) -> torch.Tensor:
        """On NVMe the region mapped (what torch.save then reads from the disk as it
        writes)."""
        if self._disk is not None:
            return self.where.store.mapped(self._disk)
        return super().saved_values()

    def state_bytes(self) -> tuple[int, int]:
        return 0, 0   # the master, moments and copy are all in ``nvme_bytes``

    @classmethod
    def planned(cls, numel: int, param_bytes: int) -> Planned:
        return Planned(params=0, masters=0, optimizer=0, mirrors=0)

