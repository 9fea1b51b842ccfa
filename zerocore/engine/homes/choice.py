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

A replicated frozen base (``FrozenWeights(placement="replicated")``) is held whole on every
rank: frozen groups are ``Replicated`` on the device, or ``HostReplicated`` in host memory with
``Offload(params="cpu")``, whatever the trainable ones' home (``params="nvme"`` with it is
refused when the model is sharded).
"""

from __future__ import annotations

import torch

from zerocore.engine.homes.device import OnDevice
from zerocore.engine.homes.home import Homes
from zerocore.engine.homes.host_mirror import HostMirror
from zerocore.engine.homes.host_window import HostWindow, RoundedWindow
from zerocore.engine.homes.nvme import NvmeHostWindow, NvmeMirror, NvmeWindow
from zerocore.engine.homes.replicated import HostReplicated, Replicated
from zerocore.engine.host_arena import HostArena
from zerocore.engine.nvme_store import NvmeStore
from zerocore.engine.offload import OffloadStreams
from zerocore.policies import FrozenWeights, Offload


def choose(offload: Offload, *, device: torch.device, param_dtype: torch.dtype,
           streams: OffloadStreams | None, arena: HostArena | None, store: NvmeStore | None,
           host_threads: int | None, frozen_weights: FrozenWeights = FrozenWeights(),
           rehearsal: bool = False) -> Homes:
    """The homes of trainable and frozen groups under ``offload`` and ``frozen_weights``'
    placement (the module's table), with what they share. ``rehearsal``: a plan's, on fake
    tensors (the optimizer's pass is not overlapped there: its worker would not see them)."""
    if offload.optimizer == "nvme":
        trainable = {False: NvmeMirror, "cpu": NvmeHostWindow, "nvme": NvmeWindow}[offload.params]
    elif offload.optimizer:
        trainable = HostWindow if offload.params else HostMirror
    elif offload.params and param_dtype != torch.float32:
        trainable = RoundedWindow
    else:
        trainable = OnDevice
    frozen = {False: OnDevice, "cpu": HostWindow, "nvme": NvmeWindow}[offload.params]
    if frozen_weights.replicated:
        assert offload.params != "nvme", "refused by the sharding: a replicated base is in memory"
        frozen = HostReplicated if offload.params else Replicated
    return Homes(trainable, frozen, device, param_dtype, streams, arena, store, host_threads,
                 overlap=offload.overlaps and not rehearsal, delayed=offload.delayed)
