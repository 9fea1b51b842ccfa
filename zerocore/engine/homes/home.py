"""``Home``: where one flat group's shard lives, and everything that depends on it.

A home is chosen once per ``Sharding`` (homes/choice.py, ``choose``), as the transport is
(comm/transport.py), and placed once per flat group (``Homes.place``): ``FlatGroup`` then asks
its home, never the offload policy. Each home owns
- the shard: where the trainable group's fp32 master, its model copy and (through the
  optimizer, zerocore.optim) its moments live, or the frozen group's values;
- how the unit's full weights are produced for a forward or a backward: ``start`` hands the
  group's gather the tensor this rank contributes (the shard itself, a device mirror of a host
  copy, a window uploaded or read for this one gather) and ``finish`` drops what was made for
  it once the compute stream has the full weights; ``complete`` waits for the gather just
  before the unit runs. A home that holds the full weights itself (a replicated frozen base,
  homes/replicated.py) starts nothing and dequantizes them into ``target.full`` in
  ``complete`` instead, with no collective: the interface is the same;
- reading and writing the values outside a step (a load, a checkpoint, an export);
- its byte counts for the memory report and the plan;
- its freeing: the host waits for the uploads that read a host shard before it writes it.

The homes: homes/device.py (on the compute device), homes/host_mirror.py (the optimizer on the
host, the device keeping a mirror of the model copy), homes/host_window.py (parameters on the
host, uploaded for each gather; or rounded on the device from a device master), homes/nvme.py
(masters and moments, and with ``params="nvme"`` the shards the gathers read, on NVMe),
homes/replicated.py (the whole quantized frozen base on every rank, nothing gathered).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.host_arena import HostArena
from zerocore.engine.nvme_store import NvmeStore, Region
from zerocore.engine.offload import OffloadStreams
from zerocore.engine.sharded_param import (gather_source, is_offloaded, is_shard, master_values,
                                           new_shard, wait_for_device)


class GatherTarget(Protocol):
    """What a home produces full weights for: its flat group."""

    full: torch.Tensor  # 1D, param dtype, padded_numel: the gathered buffer the views are cut from

    def gather_from(self, source: torch.Tensor) -> None:
        """Starts the group's all-gather from this rank's shard ``source`` (1D, on the device),
        on the current stream."""

    def receive(self) -> None:
        """Waits for the group's gather and dequantizes a quantized group's parts into
        ``full``."""

    def unpack(self, packed: torch.Tensor) -> None:
        """``full`` <- every rank's packed part of a quantized group (1D, uint8)."""


@dataclasses.dataclass(frozen=True)
class Planned:
    """Bytes in memory a home's trainable shard of ``numel`` elements holds, as a plan counts
    them before anything is built (planning/rehearsed_step.py)."""

    params: int      # model copies (param dtype), or fp32 masters computed with in fp32
    masters: int     # fp32 masters beside 16-bit model copies
    optimizer: int   # Adam's two fp32 moments
    mirrors: int     # a device mirror of a host model copy


class Home:
    """Where one flat group's shard lives. ``values``: the trainable group's slice of its full
    values (1D, shard_numel, fp32 or another float dtype, any device), or the frozen group's
    shard as it is stored (on the device, param dtype or int8 bytes); the caller's to give (a
    home may keep it as its shard or master)."""

    # Whether the optimizer steps this shard on the host: its gradient shards go there after
    # each reduce-scatter (engine/backward.py).
    steps_on_host = False
    # Whether the runtime brings the device copy of the shard up to date at the start of each
    # forward, all groups at once (``upload``), so the uploads overlap the first units' work.
    uploads_before_forward = False
    # Whether the group's full weights are gathered from every rank's shard (False: the home
    # holds them all, and the group moves no bytes: ``gather_bytes`` is 0).
    gathers = True

    def __init__(self, where: Homes, values: torch.Tensor, trainable: bool):
        self.where = where
        self.trainable = trainable
        self.shard: torch.nn.Parameter = (self._trainable_shard(values) if trainable
                                          else self._frozen_shard(values))

    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        raise NotImplementedError(f"{type(self).__name__} holds no trainable shard")

    def _frozen_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        raise NotImplementedError(f"{type(self).__name__} holds no frozen shard")

    # -- full weights ----------------------------------------------------------------------------

    def start(self, target: GatherTarget) -> None:
        """Starts producing the full weights: the group's gather from this rank's shard."""
        source, _ = self.gather_input()
        target.gather_from(source)

    def complete(self, target: GatherTarget) -> None:
        """Ends producing the full weights, on the compute stream, just before the unit uses
        them: waits for the gather (``target.receive``)."""
        target.receive()

    @classmethod
    def check_room(cls, device: torch.device, held: int, building: int, what: str) -> None:
        """Refuses a group this home could not hold (``held`` bytes kept, ``building`` more
        while it is made) before it is allocated; the shard homes hold 1/N of the state, as
        the plan predicts, and check nothing here."""

    @classmethod
    def held_range(cls, layout: FlatLayout, rank: int) -> tuple[int, int]:
        """The elements of a group of ``layout`` whose values this home holds on ``rank``:
        its shard."""
        return layout.shard_range(rank)

    def gather_input(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The tensor the all-gather reads, and on CUDA the event the gather stream waits for
        before reading it (None: nothing to wait for)."""
        raise NotImplementedError

    def finish(self) -> None:
        """The compute stream has the full weights (it waited for the gather): what was made
        for this gather alone is dropped."""

    def upload(self) -> None:
        """Brings the device copy of the shard up to date (``uploads_before_forward``)."""

    def wait_host_reads(self) -> None:
        """Blocks the host until the last upload that read this group's host shard (or the
        model copy a mirror is uploaded from) has completed; nothing else on the device."""
        if is_offloaded(self.shard):
            wait_for_device(self.shard)

    # -- values outside a step -------------------------------------------------------------------

    def write(self, data: torch.Tensor) -> None:
        """A frozen shard <- ``data`` (its numel, as stored: param dtype or int8 bytes)."""
        self.shard.copy_(data)

    def values(self) -> torch.Tensor:
        """The shard's values: a trainable group's fp32 master, a frozen group's shard."""
        return master_values(self.shard)

    def saved_values(self) -> torch.Tensor:
        """A frozen shard as a checkpoint saves it."""
        return self.shard.detach()

    @property
    def disk_region(self) -> Region | None:
        """Where the shard the gathers read lives on NVMe; None: not there."""
        return None

    # -- bytes -----------------------------------------------------------------------------------

    @property
    def mirror_bytes(self) -> int:
        """Bytes of a device mirror of a host model copy; 0 without one."""
        return 0

    @property
    def window_bytes(self) -> int:
        """Bytes of the window in flight (a device copy of the shard made for one gather)."""
        return 0

    @property
    def memory_shard_bytes(self) -> int:
        """Bytes of the shard the gathers read, held in memory (host or device)."""
        if self.disk_region is not None:
            return 0
        return nbytes(gather_source(self.shard) if is_shard(self.shard) else self.shard)

    @property
    def device_shard_bytes(self) -> int:
        """Bytes of this group's parameter shard on the compute device now, what its gathers
        read there."""
        return self.window_bytes + self.mirror_bytes

    @classmethod
    def planned(cls, numel: int, param_bytes: int) -> Planned:
        """What a trainable shard of ``numel`` elements holds in memory here (computing in
        ``param_bytes`` per element): its model copy (the master in fp32), the master beside
        a 16-bit copy, and the moments."""
        return Planned(params=numel * param_bytes, masters=numel * 4 if param_bytes != 4 else 0,
                       optimizer=numel * 8, mirrors=0)

    # Whether a frozen shard placed here is held in memory (host or device), not on disk.
    frozen_in_memory = True

    def state_bytes(self) -> tuple[int, int]:
        """A trainable shard's bytes in memory for the memory report: (parameters, fp32
        masters): its model copy and master, or in fp32 the master alone, which is what is
        computed with; a device mirror counts as parameters."""
        shard, copy = self.shard, self.shard.model_copy
        published = nbytes(getattr(shard, "published", None))
        if copy is not None:
            return nbytes(copy) + published + self.mirror_bytes, shard.numel() * 4
        return shard.numel() * 4 + published + self.mirror_bytes, 0


class OffDevice(Home):
    """A home whose gather input reaches the device by a copy (a mirror's upload, a window):
    on CUDA the gather is issued from the gather stream once that copy is done."""

    def start(self, target: GatherTarget) -> None:
        streams = self.where.streams
        if streams is None:
            super().start(target)
            return
        # Issued from the gather stream, which c10d makes NCCL wait for: it waits for the
        # compute stream's work so far (the gathered buffer may reuse memory that work still
        # reads; a window rounded from the master reads what the optimizer wrote) and for the
        # upload. The compute stream itself waits only for the all-gather (the group's
        # ``wait_gather``), never for an upload.
        device = self.where.device
        streams.gather.wait_stream(torch.cuda.current_stream(device))
        source, upload = self.gather_input()
        if upload is not None:
            streams.gather.wait_event(upload)
        with torch.cuda.stream(streams.gather):
            target.gather_from(source)


@dataclasses.dataclass(frozen=True)
class Homes:
    """The homes of one sharding's groups, and what they share."""

    trainable: type[Home]
    frozen: type[Home]
    device: torch.device               # where layers compute
    param_dtype: torch.dtype
    streams: OffloadStreams | None     # offload's side streams on CUDA; None otherwise
    # Where host homes' shards live (engine/host_arena.py); None without offload (and in a
    # plan's rehearsal, whose shards are fake).
    arena: HostArena | None = None
    # The NVMe homes' scratch and pool (engine/nvme_store.py); None without NVMe offload.
    store: NvmeStore | None = None
    # CPU threads the optimizer steps host shards with (a GPU rank's share of its host);
    # None: torch's own count (zerocore.optim).
    host_threads: int | None = None
    # Whether the optimizer steps trainable host shards on its worker while the next forward
    # runs (``Offload.overlaps``; never in a plan's rehearsal, whose tensors are fake).
    overlap: bool = False
    # ``Offload(overlap="delayed")``: trainable host shards keep a published copy for the
    # gathers (``ShardParameter.published``), a second host copy in the param dtype.
    delayed: bool = False

    def place(self, values: torch.Tensor, trainable: bool) -> Home:
        """A flat group's home, holding its shard made from ``values`` (``Home``'s)."""
        return (self.trainable if trainable else self.frozen)(self, values, trainable)

    def home_of(self, trainable: bool) -> type[Home]:
        """The home a trainable or frozen group gets."""
        return self.trainable if trainable else self.frozen

    def held_range(self, trainable: bool, layout: FlatLayout, rank: int) -> tuple[int, int]:
        """The elements of a group of ``layout`` its home holds on ``rank``
        (``Home.held_range``): what the group is built and loaded from."""
        return (self.trainable if trainable else self.frozen).held_range(layout, rank)


def host_buffer(where: Homes, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host buffer of offloaded state: from the sharding's host arena (pinned once the
    layers are built), or in a plan's rehearsal, which has none, a fake CPU tensor."""
    if where.arena is not None:
        return where.arena.take(numel, dtype)
    return torch.empty(numel, dtype=dtype, device="cpu")


def host_master(where: Homes, values: torch.Tensor) -> torch.nn.Parameter:
    """A trainable shard whose fp32 master and model copy (none in fp32) live on the host,
    stepped there by the optimizer with the sharding's CPU threads."""
    master = host_buffer(where, values.numel(), torch.float32)
    master.copy_(values)
    copy = None
    if where.param_dtype != torch.float32:
        copy = host_buffer(where, values.numel(), where.param_dtype)
        copy.copy_(master)
    shard = new_shard(master, copy, offloaded=True, overlapped=where.overlap)
    shard.host_threads = where.host_threads
    add_published(where, shard, master if copy is None else copy)
    return shard


def add_published(where: Homes, shard: torch.nn.Parameter, values: torch.Tensor) -> None:
    """``Offload(overlap="delayed")``: the shard's published copy, what its gathers read, from
    ``values`` (its model copy, in the param dtype)."""
    if where.delayed:
        shard.published = host_buffer(where, values.numel(), where.param_dtype).copy_(values)


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
