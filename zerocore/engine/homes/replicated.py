"""``Replicated``: the whole quantized frozen base on every rank
(``FrozenWeights(placement="replicated")``).

The home holds every rank's packed part of its frozen group (engine/quantized.py: quantized part
by part, exactly as the sharded parts are, so both placements compute with the same bits), on
the compute device. Nothing is gathered: ``start`` does nothing and ``complete``, called just
before the unit runs (in forward, in backward, and in a recomputed forward), dequantizes the
parts into the group's gathered buffer, which the group frees after the unit as it frees a
gathered one. What it saves is every frozen all-gather, twice a micro-batch; what it costs is
the whole quantized base on each rank, and one dequantization per use.

``HostReplicated``: the same base with the parameters offloaded (``Offload(params="cpu")``), as
a DeepSpeed or FSDP user expects of parameter offload: every parameter off the device between
its uses, so the whole quantized base lives in the host arena, and each use uploads the unit's
quantized bytes (on CUDA on the upload stream, from ``start``, on the prefetch schedule: while
the unit before computes) and dequantizes them on the device in ``complete``. Each use moves
the unit's quantized bytes over PCIe (NF4: 0.5625 bytes an element) and nothing over the link,
where a sharded base with its parameters offloaded uploads a shard and all-gathers the unit.
"""

from __future__ import annotations

import torch

from zerocore.engine.flat_layout import FlatLayout
from zerocore.engine.homes.home import GatherTarget, Home, nbytes
from zerocore.engine.homes.host_window import HostWindow
from zerocore.engine.scratch_file import size_text


class Replicated(Home):
    gathers = False

    @classmethod
    def check_room(cls, device: torch.device, held: int, building: int, what: str) -> None:
        """ValueError, before anything of it is allocated, when ``held`` bytes (a group's
        packed parts, kept) and ``building`` more (the fp32 values they are quantized from,
        dropped once packed) exceed what ``device`` has free; nothing when that is not known.
        Checked group by group as the layers are built, so each sees what the ones before
        took."""
        free = free_bytes(device)
        if free is not None and held + building > free:
            raise ValueError(f"FrozenWeights(placement='replicated'): {what} needs "
                             f"{size_text(held)} for its quantized frozen base on every rank "
                             f"(and {size_text(building)} while quantizing it), and {device} "
                             f"has {size_text(free)} free; shard the frozen base "
                             f"(placement='sharded'), or give more ranks more memory")

    def _frozen_shard(self, values: torch.Tensor) -> torch.nn.Parameter:
        # values: every rank's packed part, in rank order (1D, uint8, on the device).
        return torch.nn.Parameter(values, requires_grad=False)

    @classmethod
    def held_range(cls, layout: FlatLayout, rank: int) -> tuple[int, int]:
        return 0, layout.padded_numel

    def start(self, target: GatherTarget) -> None:
        """Nothing to gather: the parts are dequantized by ``complete``, when they are used."""

    def complete(self, target: GatherTarget) -> None:
        target.unpack(self.shard.detach())

    @property
    def device_shard_bytes(self) -> int:
        return nbytes(self.shard)


class HostReplicated(HostWindow):
    """The whole quantized frozen base in host memory, each unit's bytes uploaded for each use
    (see the module's docstring). A window is HostWindow's: a device copy of the held bytes,
    dropped by ``finish`` once the unit's weights are dequantized from it."""

    gathers = False

    @classmethod
    def check_room(cls, device: torch.device, held: int, building: int, what: str) -> None:
        """The held bytes are the host's to hold; the fp32 values they are quantized from are
        made on the device, as without offload (on a CPU rank, the same memory)."""
        if device.type == "cpu":
            Replicated.check_room(device, held, building, what)
        else:
            Replicated.check_room(torch.device("cpu"), held, 0, what)
            Replicated.check_room(device, 0, building, what)

    @classmethod
    def held_range(cls, layout: FlatLayout, rank: int) -> tuple[int, int]:
        return 0, layout.padded_numel

    def start(self, target: GatherTarget) -> None:
        """The upload of the unit's quantized bytes (nothing is gathered)."""
        self._window_ready = None
        self._window = self._make_window()

    def complete(self, target: GatherTarget) -> None:
        """Just before the unit runs: waits for the upload, then dequantizes every part."""
        if self._window_ready is not None:
            torch.cuda.current_stream(self.where.device).wait_event(self._window_ready)
        target.unpack(self._window)


def free_bytes(device: torch.device) -> int | None:
    """Bytes ``device`` can still give: a GPU's free memory and what its caching allocator holds
    unused; the host's available memory (Linux' MemAvailable) for the CPU; None if not known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
