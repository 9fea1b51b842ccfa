"""``OnDevice``: the shard lives on the compute device, and the gathers read it there.

Trainable: the fp32 master and, computing in 16 bit, its model copy (written by the optimizer
in the same pass as the master), both device tensors; the optimizer steps on the device. Frozen:
the shard in the param dtype (or int8 bytes). Also the home of a trainable group with
``Offload(params=True)`` alone in fp32: the master is what is gathered, and it stays here.
"""

from __future__ import annotations

import torch

from zerocore.engine.homes.home import Home, nbytes
from zerocore.engine.sharded_param import (gather_source, is_shard, new_shard,
                                           refresh_model_copy)


class OnDevice(Home):
    def _trainable_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        return device_master(self.where, values, keep_copy=True)

    def _frozen_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(values, requires_grad=False)

    def gather_input(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        shard = self.shard
        if not is_shard(shard):
            return shard.data, None
        refresh_model_copy(shard)
        return gather_source(shard), None

    @property
    def device_shard_bytes(self) -> int:
        return nbytes(gather_source(self.shard) if is_shard(self.shard) else self.shard)


def device_master(where, values: torch.Tensor, keep_copy: bool) -> torch.nn.Parameter:
    """A trainable shard whose fp32 master lives on the device, with a model copy there when
    computing in 16 bit and ``keep_copy``."""
    if (values.dtype == torch.float32 and values.device == where.device
            and values.dim() == 1 and values._base is None):
        # The group's own slice, made for this shard (FlatGroup's ``values``): taken as the
        # master rather than copied, so that building a group holds it once.
        master = values
    else:
        master = torch.empty(values.numel(), dtype=torch.float32, device=where.device)
        master.copy_(values)
    copy = None
    if where.param_dtype != torch.float32 and keep_copy:
        copy = torch.empty(values.numel(), dtype=where.param_dtype, device=where.device)
        copy.copy_(master)
    return new_shard(master, copy, offloaded=False)
