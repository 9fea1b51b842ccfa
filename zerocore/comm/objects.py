"""Object collectives (Python values exchanged between ranks) on a device the caller names.

torch's ``all_gather_object`` puts its buffers on ``torch.cuda.current_device()`` when the group
has no CPU backend (NCCL alone), whatever device the group or the model is on: cuda:0 on every
rank that did not call ``torch.cuda.set_device``, so the exchange is refused, or every rank
opens a communicator on GPU 0. Here the caller passes the device (``comm.device.comm_device``
chooses it: the CPU when the group has a CPU backend, else the model's device). Values travel
pickled, as torch's object collectives send them; every rank runs the same program.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from zerocore.comm.collectives import all_gather_sync


def all_gather_objects(obj: Any, group: dist.ProcessGroup, device: torch.device) -> list[Any]:
    """Collective: every rank's ``obj``, in group rank order; the bytes travel on ``device``."""
    world = dist.get_world_size(group)
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_sync(sizes, size, group)
    lengths = sizes.tolist()
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = torch.empty(world * longest, dtype=torch.uint8, device=device)
    all_gather_sync(every, mine.to(device), group)
    rows = every.view(world, longest).cpu()
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def broadcast_objects(objects: list[Any], src: int, group: dist.ProcessGroup,
                      device: torch.device) -> None:
    """Collective: ``objects`` (a list, the same length on every rank) <- group rank ``src``'s,
    in place; the bytes travel on ``device``."""
    dist.broadcast_object_list(objects, src=dist.get_global_rank(group, src), group=group,
                               device=device)
