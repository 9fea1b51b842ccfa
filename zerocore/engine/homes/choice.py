"""``choose``: where one sharding's shards live, decided once for it from ``Offload`` (as
``transport.choose`` decides how its groups travel), and ``Homes.place``, which gives each flat
group its home. The table (trainable groups by where the optimizer and the parameters are;
frozen groups by where the parameters are):

    optimizer \\ params   False         "cpu"            "nvme"
    False                 OnDevice      RoundedWindow*   RoundedWindow*
    "cpu"                 HostMirror    HostWindow       (refused by Offload)
    "nvme"                NvmeMirror    NvmeHostWindow   NvmeWindow
    frozen                OnDevice      HostWindow       NvmeWindow

    * OnDevice in fp32: the master is what is gathered, and it stays on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from zerocore.engine.homes.device import OnDevice
from zerocore.engine.homes.home import Home
from zerocore.engine.homes.host_mirror import HostMirror
from zerocore.engine.homes.host_window import HostWindow, RoundedWindow
from zerocore.engine.homes.nvme import NvmeHostWindow, NvmeMirror, NvmeWindow
from zerocore.engine.host_arena import HostArena
from zerocore.engine.nvme_store import NvmeStore
from zerocore.engine.offload import OffloadStreams
from zerocore.policies import Offload


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

    def place(self, values: torch.Tensor, trainable: bool) -> Home:
        """A flat group's home, holding its shard made from ``values`` (``Home``'s)."""
        return (self.trainable if trainable else self.frozen)(self, values, trainable)


def choose(offload: Offload, *, device: torch.device, param_dtype: torch.dtype,
           streams: OffloadStreams | None, arena: HostArena | None, store: NvmeStore | None,
           host_threads: int | None) -> Homes:
    """The homes of trainable and frozen groups under ``offload`` (the module's table), with
    what they share."""
    if offload.optimizer == "nvme":
        trainable = {False: NvmeMirror, "cpu": NvmeHostWindow, "nvme": NvmeWindow}[offload.params]
    elif offload.optimizer:
        trainable = HostWindow if offload.params else HostMirror
    elif offload.params and param_dtype != torch.float32:
        trainable = RoundedWindow
    else:
        trainable = OnDevice
    frozen = {False: OnDevice, "cpu": HostWindow, "nvme": NvmeWindow}[offload.params]
    return Homes(trainable, frozen, device, param_dtype, streams, arena, store, host_threads)
