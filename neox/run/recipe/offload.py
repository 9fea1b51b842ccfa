"""What lives off the device (``--offload``), and where: host memory, or scratch files on a
local disk (ZeRO-Infinity). ``policies`` gives ``zerocore.shard`` its ``zerocore.Offload``."""

from __future__ import annotations

import dataclasses
from typing import Any

import zerocore
from neox.run.recipe.declaring import STEP, at_least, check_fields, is_bool, path_or_none
from neox.setting import BadValue, Flag, absolute_path, byte_budget, path_text, setting
from zerocore import (AUTO_POOL_HOST_SHARE, DEFAULT_POOL_BYTES, MAX_AUTO_POOL_BYTES,
                      MIN_POOL_BYTES, OFFLOAD_DEVICES, OVERLAPS)

__all__ = ["OffloadConfig", "OFFLOADS", "offload_words"]

OFFLOADS = ("params", "optimizer", "all")   # --offload's choices


def pool_size(text: str) -> int | None:
    """--offload-pool's text: ``auto`` (None: chosen from the host's memory) or a size."""
    if text.strip().lower() == "auto":
        return None
    size = byte_budget(text)
    if size == "all":
        raise BadValue(f"must be 'auto' or a size such as 1GiB or 512MiB, got {text!r}")
    return size


def pool_text(size: int | None) -> str:
    """--offload-pool's value as the flag writes it (in MiB when whole, else in bytes)."""
    if size is None:
        return "auto"
    return f"{size // 2**20}MiB" if size % 2**20 == 0 else str(size)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Which of the parameter shards and the optimizer state live off the device, and where."""

    offload_optimizer: bool = setting(
        False, check=is_bool, problem="{name} must be a bool",
        flag=Flag(STEP, "keep fp32 masters, gradients and Adam moments in CPU memory (as "
                        "--offload optimizer)", resumable=True))
    # What lives in CPU memory (zerocore.Offload): with offload_optimizer, the optimizer is
    # offloaded when either says so.
    offload: str | None = setting(
        None, check=lambda x: x is None or x in OFFLOADS,
        problem=f"{{name}} must be one of {OFFLOADS} or null, got {{value!r}}",
        flag=Flag(STEP, "what lives in CPU memory: 'optimizer' (fp32 masters, gradients and "
                        "Adam moments, stepped there), 'params' (every parameter shard, frozen "
                        "ones too: the device holds a layer's only while its all-gather reads "
                        "it; the optimizer stays on the device), 'all' (both) (default: none)",
                  choices=OFFLOADS, resumable=True), since=5)
    # Where what --offload names lives (zerocore.Offload's optimizer=/params= device): host
    # memory, or scratch files on a local disk (ZeRO-Infinity). Bitwise the same either way,
    # so a resumed run may change it, and the path and pool with it.
    offload_device: str = setting(
        "cpu", check=lambda x: x in OFFLOAD_DEVICES,
        problem=f"{{name}} must be one of {OFFLOAD_DEVICES}, got {{value!r}}",
        flag=Flag(STEP, "where what --offload names lives: 'cpu' (host memory) or 'nvme' "
                        "(ZeRO-Infinity: the fp32 masters and Adam moments in a scratch file "
                        "per rank in --offload-path, on a local disk, stepped through "
                        "--offload-pool of host memory; the gradients and 16-bit copies stay "
                        "in host memory) (default: cpu)", choices=OFFLOAD_DEVICES,
                  resumable=True), since=7)
    offload_path: str | None = setting(
        None, check=path_or_none, problem="{name} must be a directory, got {value!r}",
        flag=Flag(STEP, "the directory --offload-device nvme keeps its scratch in (a local "
                        "disk with room for 12 bytes per trained parameter per node; the files "
                        "have no name and go when the ranks end, however they end)",
                  parse=path_text, store=absolute_path, metavar="DIR", resumable=True),
        since=7, per_node=True)
    # None (auto, the default since issue 44): zerocore.Offload(pool_bytes=None) chooses it
    # from the hosts' memory. A recipe that stored a size keeps it; one that stored none
    # (version 7 until then stored 256 MiB, the old default, so every stored NVMe recipe has a
    # size) takes auto: a new value of the same field, not a new meaning of a stored one.
    offload_pool: int | None = setting(
        None, check=lambda x: x is None or at_least(MIN_POOL_BYTES)(x),
        problem=f"{{name}} must be 'auto' (null) or a size of at least {MIN_POOL_BYTES} bytes, "
                f"got {{value!r}}",
        flag=Flag(STEP, f"host memory per rank that --offload-device nvme reads and writes "
                        f"through (e.g. 256MiB, 1GiB): all it holds of the masters and moments "
                        f"at once; larger means longer transfers and more read ahead. 'auto' "
                        f"(the default) takes the largest power of two from "
                        f"{DEFAULT_POOL_BYTES // 2**20}MiB to {MAX_AUTO_POOL_BYTES // 2**30}GiB "
                        f"whose copies on a node's ranks take at most 1/{AUTO_POOL_HOST_SHARE} "
                        f"of its memory, or of its container's limit where lower (one rank "
                        f"on 24 GB: 1GiB; eight on 128 GB: 512MiB each)", parse=pool_size,
                  metavar="SIZE", text=pool_text,
                  resumable=True), since=7)
    # Whether the offloaded optimizer's pass overlaps the next forward (zerocore.Offload's
    # overlap). "exact" and "off" give the same bits; "delayed" does not (each forward
    # computes with the weights from before the last update), and a resume restarts its delay
    # from the loaded weights, so a resumed run may change it too. Recipes before version 9
    # lack it and load as "exact" (their runs were "off": the same bits); "delayed" is a new
    # value of the same field, not a new meaning of a stored one: still version 9.
    offload_overlap: str = setting(
        "exact", check=lambda x: x in OVERLAPS,
        problem=f"{{name}} must be one of {OVERLAPS}, got {{value!r}}",
        flag=Flag(STEP, "with the optimizer offloaded: 'exact' steps its layers on a host "
                        "worker in forward order while the next forward runs, each layer's "
                        "gather waiting for its own update (bitwise the same results); 'delayed' "
                        "lets each step's update run beside the whole next forward and "
                        "backward, which compute with the weights from before it (the "
                        "ZeRO-Offload paper's delayed update: not the same results); 'off' "
                        "steps them all inside the optimizer's step (default: exact)",
                  choices=OVERLAPS, resumable=True), since=9)

    def __post_init__(self) -> None:
        check_fields(self, "recipe.offload")

    @property
    def offloaded_params(self) -> bool:
        """Whether the parameter shards live off the device (``zerocore.Offload(params=)``)."""
        return self.offload in ("params", "all")

    @property
    def offloaded_optimizer(self) -> bool:
        """Whether the optimizer state lives off the device: ``--offload optimizer|all``, or
        ``--offload-optimizer`` (``zerocore.Offload(optimizer=)``), in host memory or on NVMe
        (``offload_device``)."""
        return self.offload_optimizer or self.offload in ("optimizer", "all")

    def policies(self) -> dict[str, Any]:
        """``zerocore.shard``'s ``offload``: each half offloaded to ``offload_device``, with
        the NVMe path and pool."""
        return dict(offload=zerocore.Offload(
            optimizer=self.offload_device if self.offloaded_optimizer else False,
            params=self.offload_device if self.offloaded_params else False,
            path=self.offload_path if self.offload_device == "nvme" else None,
            pool_bytes=self.offload_pool, overlap=self.offload_overlap))

    def problem(self, *, for_a_run: bool) -> str | None:
        """What is wrong with the offload flags together, in one line (None: nothing):
        --offload-device nvme with nothing offloaded, or for a run without --offload-path (a
        plan needs none: it writes nothing). (A path with --offload-device cpu is unused: a
        run resumed in memory keeps the path its checkpoint's recipe names.)"""
        if self.offload_device != "nvme":
            return None
        if not (self.offloaded_optimizer or self.offloaded_params):
            return ("--offload-device nvme: nothing is offloaded; add --offload optimizer "
                    "(the fp32 masters and Adam moments on NVMe), params or all")
        if for_a_run and self.offload_path is None:
            return ("--offload-device nvme needs --offload-path DIR, the directory on a local "
                    "disk to keep the scratch files in")
        return None

    def words(self) -> str:
        """What is offloaded and where, for the run's model line ("" nothing)."""
        offloaded = offload_words(self.offloaded_params, self.offloaded_optimizer)
        if not offloaded:
            return ""
        where = ("on NVMe (fp32 masters and Adam moments in scratch files in "
                 f"{self.offload_path})" if self.offload_device == "nvme" else "in CPU memory")
        overlap = ""
        if self.offloaded_optimizer:
            # (zerocore.Offload.overlaps: with the parameters on NVMe the pass stays inside
            # the step, whatever the field)
            overlaps = self.offload_overlap != "off" and not (
                self.offloaded_params and self.offload_device == "nvme")
            overlap = ("; the optimizer's pass runs inside its step (not overlapped)"
                       if not overlaps else
                       "; the optimizer's pass is one step delayed (each forward computes "
                       "with the weights from before the last update)"
                       if self.offload_overlap == "delayed" else
                       "; the optimizer's pass overlaps the next forward (exact)")
        return f"; {offloaded} {where}{overlap}"


def offload_words(params: bool, optimizer: bool) -> str:
    """What lives in CPU memory, in words: "parameter shards and optimizer state", ...; ""
    for nothing."""
    return " and ".join(w for w, on in (("parameter shards", params),
                                        ("optimizer state", optimizer)) if on)
