"""Where a sharded model computes, and the checks that it can: ``zerocore.shard``'s default device
(from the process group's backend), what this process can run on (``Platform``), and one
agreement between the ranks, before anything is allocated on the device, that each rank can use
its device and that no two ranks share one GPU.

Why a check of its own. A user who forgets ``torch.cuda.set_device`` has every rank on
``cuda:0``; NCCL then fails at its first collective with "Duplicate GPU detected" (or, on some
versions, hangs), far from the cause. A CPU-only build of ``zerocore._C`` on a GPU machine would
fail inside the first backward. Both are found here, in ``shard()``, on every rank, with the fix.

The comparison runs on device *descriptions* (``RankDevice``: host, device name, the GPU's UUID),
exchanged as Python objects over a CPU channel, never on tensors on the device: exchanging them
over NCCL would itself hit the duplicate GPU. So it can be driven on a CPU-only machine by
passing a ``Platform`` that says what a GPU machine would.

``init_process_group(device_id=)`` or ``shard(device=)`` without ``torch.cuda.set_device``
leave the current device at cuda:0, where torch and the user's own code allocate: such a rank
is told so in one line, before any collective. zerocore's own collectives of small values run
on the device it is given (``comm_device``), never on the current device behind its back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Callable

import torch
import torch.distributed as dist

from zerocore.comm.objects import all_gather_objects

logger = logging.getLogger(__name__)

# What the messages tell a user to do about a shared GPU: set_device, the one advice (device_id=
# and device= do not change the current device, which torch and the user's code allocate on).
ONE_GPU_PER_PROCESS = (
    "give each process its own GPU before init_process_group with "
    "torch.cuda.set_device(local_rank % torch.cuda.device_count()), "
    "local_rank = int(os.environ['LOCAL_RANK']) (torchrun and most launchers set LOCAL_RANK); "
    "init_process_group(device_id=...) and zerocore.shard(device=...) alone do not set the "
    "current device")
REBUILD = "pip install --no-build-isolation -e ."


@dataclasses.dataclass(frozen=True)
class Platform:
    """What this process can compute on, for the device ``shard()`` chose: what the checks in
    ``shard()`` read, and the NVMe pool is chosen from. ``Platform.detect(device)`` reads it
    from torch and the OS, with what ``shard`` gives it (``zerocore.BUILD``'s kernels, the host's
    memory: ``host_memory_bytes``); tests (and dry runs) pass their own to
    ``zerocore.shard(..., platform=...)``."""

    host: str                   # this machine's network name (ranks on one host share its GPUs
                                # and its memory)
    torch_cuda: str | None      # torch.version.cuda: None for a CPU build of torch
    cuda_device_count: int      # CUDA devices this process sees (after CUDA_VISIBLE_DEVICES)
    kernels_cuda: bool          # zerocore._C has CUDA kernels (zerocore.BUILD.has_cuda)
    device_uuid: str | None     # the chosen CUDA device's UUID (the physical GPU), if known
    usable_cores: int           # CPU cores this process may run on (its affinity mask)
    # The current CUDA device's index (torch.cuda.set_device's) when a CUDA device was chosen;
    # None otherwise (read only then: it initialises CUDA).
    current_cuda_index: int | None = None
    # The memory this host gives the process, in bytes (the machine's, or its container's
    # limit where lower: ``host_memory_bytes``), which ``Offload(pool_bytes=None)`` chooses the
    # NVMe pool from; None: not known (a made-up platform), and then a pool must be given.
    host_memory: int | None = None

    @staticmethod
    def detect(device: torch.device, *, kernels_cuda: bool, host_memory: int) -> "Platform":
        count = torch.cuda.device_count()  # NVML: does not initialise CUDA
        uuid = current = None
        if device.type == "cuda" and device.index is not None and device.index < count:
            # The UUID names the physical GPU even when each process sees other devices under
            # the same index (a launcher that sets CUDA_VISIBLE_DEVICES per process).
            uuid = getattr(torch.cuda.get_device_properties(device.index), "uuid", None)
            uuid = None if uuid is None else str(uuid)
            current = torch.cuda.current_device()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        return Platform(socket.gethostname(), torch.version.cuda, count, kernels_cuda, uuid,
                        cores, current, host_memory)


# -- the default device ---------------------------------------------------------------------------

def backend_map(group: dist.ProcessGroup) -> dict[str, str]:
    """{device type: backend} of a process group, e.g. {"cpu": "gloo", "cuda": "nccl"}.

    ``dist.get_backend`` is not enough: for ``init_process_group()`` without a backend torch
    2.13 reports "undefined" (the backend is chosen per device: "cuda:nccl" on a GPU machine),
    and for ``"cpu:gloo,cuda:nccl"`` the whole string. The backend configuration names the
    backend of each device type."""
    getter = getattr(dist, "get_backend_config", None)
    return parse_backend_config(str(getter(group) if getter else dist.get_backend(group)))


def parse_backend_config(config: str) -> dict[str, str]:
    """"cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}; a bare "nccl" (older torch)
    -> {"cuda": "nccl"}; a bare "gloo" -> {"cpu": "gloo", "cuda": "gloo"}."""
    config = config.strip().lower()
    if ":" not in config:
        return {"cuda": config} if config == "nccl" else {"cpu": config, "cuda": config}
    pairs = (part.split(":", 1) for part in config.split(",") if part.strip())
    return {dev.strip(): backend.strip() for dev, backend in pairs}


def default_device(backends: dict[str, str], bound_device: torch.device | None,
                   current_cuda_index: Callable[[], int]) -> torch.device:
    """CUDA when any backend of the group is NCCL (NCCL moves only CUDA tensors), else the CPU.
    The CUDA device is the one the group is bound to (``init_process_group(device_id=...)``),
    else the current one (``torch.cuda.set_device``)."""
    if "nccl" not in backends.values():
        return torch.device("cpu")
    if bound_device is not None and bound_device.type == "cuda":
        return bound_device
    return torch.device("cuda", current_cuda_index())


def resolve_device(device: torch.device | str | None, group: dist.ProcessGroup) -> torch.device:
    """The device ``shard()`` computes on: the caller's, or ``default_device`` for the group; a
    CUDA device without an index gets the current one (when this process sees any GPU)."""
    if device is None:
        bound = getattr(group, "bound_device_id", None)
        dev = default_device(backend_map(group), bound, torch.cuda.current_device)
    else:
        dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.device_count() > 0:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# -- what one rank can do -------------------------------------------------------------------------

def device_problem(device: torch.device, platform: Platform) -> str | None:
    """Why this process cannot compute on ``device``, or None."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"zerocore computes on CPU or CUDA devices, not {device}"
    if platform.torch_cuda is None:
        return (f"{device} was asked for (NCCL, or device=), but this torch "
                f"({torch.__version__}) is a CPU build: install a CUDA build of torch, then "
                f"rebuild zerocore's kernels with: {REBUILD}")
    if platform.cuda_device_count == 0:
        return (f"{device} was asked for (NCCL, or device=), but this process sees no CUDA "
                f"device (is CUDA_VISIBLE_DEVICES empty, or the driver missing?)")
    if device.index is not None and device.index >= platform.cuda_device_count:
        return (f"{device} was asked for, but this process sees "
                f"{platform.cuda_device_count} CUDA device(s); {ONE_GPU_PER_PROCESS}")
    if not platform.kernels_cuda:
        return (f"zerocore._C was built without CUDA kernels (no CUDA toolkit was found when it "
                f"was compiled), so it cannot train on {device}: install the CUDA toolkit of "
                f"torch's CUDA {platform.torch_cuda} (nvcc on PATH, or CUDA_HOME set) and "
                f"rebuild with: {REBUILD} (`python -m zerocore` prints what was built)")
    return None


def current_device_mismatch(rank: int, device: torch.device, platform: Platform,
                            bound: torch.device | None) -> str | None:
    """The one line for a rank that computes on another CUDA device than its current one
    (``device=``, or the group's ``device_id``, without ``torch.cuda.set_device``), or None."""
    current = platform.current_cuda_index
    if device.type != "cuda" or current is None or device.index in (None, current):
        return None
    source = ("the group's device_id" if bound is not None and torch.device(bound) == device
              else "device=")
    return (f"zerocore.shard: rank {rank} computes on {device} ({source}) but its current CUDA "
            f"device is cuda:{current}, where torch and your own code allocate; call "
            f"torch.cuda.set_device({device.index}) before init_process_group")


# -- what the ranks agree on ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RankDevice:
    """One rank's device as the ranks exchange it: a description, never a tensor on it."""

    rank: int
    host: str
    device: str            # "cpu", "cuda:0"
    uuid: str | None       # the CUDA device's UUID, None on the CPU or when unknown
    problem: str | None    # why this rank cannot compute there (device_problem), or None
    # The caller's own refusal of this rank's setting (e.g. a mesh made for another kind of
    # device), raised on every rank as it is: the exchange is where the ranks first meet.
    refusal: str | None = None
    host_memory: int | None = None   # its host's memory (Platform.host_memory), for the pool

    def gpu_key(self) -> tuple[str, ...] | None:
        """What identifies the physical GPU: its UUID, else (host, device); None on the CPU."""
        if not self.device.startswith("cuda"):
            return None
        return ("uuid", self.uuid) if self.uuid else ("host", self.host, self.device)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the ranks agreed on: every rank's device, and how many ranks share this host."""

    ranks: tuple[RankDevice, ...]
    ranks_on_host: int

    def hosts(self) -> tuple[tuple[str, int | None], ...]:
        """Every rank's host and the memory it gives the rank, in rank order: what the NVMe
        pool is chosen from (``zerocore.agreed_pool_bytes``), the same list on every rank."""
        return tuple((r.host, r.host_memory) for r in self.ranks)


def placement_problem(ranks: list[RankDevice], one_gpu_each: bool = True) -> str | None:
    """The one message every rank raises, or None when each rank can compute on its device.
    one_gpu_each: two ranks may not share a GPU (NCCL's rule; gloo over CUDA tensors has none)."""
    failed = [r for r in ranks if r.problem is not None]
    if failed:
        others = ("" if len(failed) == 1 else
                  f" (ranks {', '.join(str(r.rank) for r in failed)} cannot use their devices)")
        return f"rank {failed[0].rank}: {failed[0].problem}{others}"
    kinds = {r.device.split(":")[0] for r in ranks}
    if len(kinds) > 1:
        listing = ", ".join(f"rank {r.rank}: {r.device}" for r in ranks)
        return (f"the ranks compute on different kinds of device ({listing}); every rank must "
                f"compute on the same kind")
    sharing: dict[tuple[str, ...], list[RankDevice]] = {}
    for r in ranks if one_gpu_each else ():
        key = r.gpu_key()
        if key is not None:
            sharing.setdefault(key, []).append(r)
    for group in sharing.values():
        if len(group) > 1:
            first = group[0]
            which = first.device + (f" ({first.uuid})" if first.uuid else "")
            return (f"ranks {', '.join(str(r.rank) for r in group)} on host {first.host} all "
                    f"compute on the same GPU, {which}: NCCL needs one GPU per process; "
                    f"{ONE_GPU_PER_PROCESS}")
    return None


def uses_side_channel(backends: dict[str, str]) -> bool:
    """True when the group has no CPU backend (NCCL alone): the descriptions then travel over a
    gloo side group, since an object all-gather over NCCL would run on the very GPU being
    checked."""
    return "cpu" not in backends


def agree_on_devices(group: dist.ProcessGroup, device: torch.device, platform: Platform, *,
                     side_channel: bool | None = None,
                     one_gpu_each: bool | None = None,
                     refusal: str | None = None) -> Placement:
    """Collective: every rank describes its device, the ranks exchange the descriptions over a
    CPU channel, and either every rank returns the same ``Placement`` or every rank raises the
    same ValueError (a rank that cannot use its device, ranks on different kinds of device, two
    ranks on one GPU where NCCL moves CUDA tensors). Allocates nothing on the device.

    The channel: the group itself when it has a CPU backend (gloo, "cpu:gloo,cuda:nccl");
    otherwise (NCCL alone) a gloo group of the same ranks, created by them alone
    (``use_local_synchronization``: a subgroup's ranks need not wait for the world's others),
    kept for the process's life (one per call: see below why not destroyed). So a rank of an
    NCCL subgroup that cannot use its device is refused on every rank of the subgroup at once,
    not on its own while the others wait for it in their first NCCL collective.

    side_channel: force the gloo side group (default: when the group has no CPU
    backend); tests use it to run that path over gloo. one_gpu_each: refuse two ranks on one GPU
    (default: when NCCL is the group's CUDA backend; gloo ranks may share one); tests set it to
    check NCCL's placement over gloo. refusal: this rank's refusal of its setting (a whole
    message), raised on every rank, naming the ranks it concerns when not all."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    backends = backend_map(group)
    mismatch = current_device_mismatch(rank, device, platform,
                                       getattr(group, "bound_device_id", None))
    if mismatch is not None:
        logger.warning(mismatch)
    mine = RankDevice(rank, platform.host, str(device),
                      platform.device_uuid if device.type == "cuda" else None,
                      device_problem(device, platform), refusal, platform.host_memory)
    if world == 1:  # nobody to agree with, nor to share a GPU with
        if refusal is not None:
            raise ValueError(refusal)
        if mine.problem is not None:
            raise ValueError(f"zerocore.shard: rank 0: {mine.problem}")
        return Placement((mine,), 1)
    if side_channel is None:
        side_channel = uses_side_channel(backends)
    if one_gpu_each is None:  # (the side channel serves NCCL-only groups)
        one_gpu_each = side_channel or backends.get("cuda") == "nccl"
    cpu = torch.device("cpu")
    if not side_channel:
        everyone = all_gather_objects(mine, group, cpu)
    else:
        # A gloo group of the same ranks, made by them alone (use_local_synchronization: the
        # world's other ranks take no part). It is left alive, not destroyed after the exchange:
        # torch names such a group by its ranks and the number of live groups, so destroying it
        # hands the next one (a second shard() on the same group) the same name and store
        # prefix, whose rendezvous then reads this one's stale addresses: a hang, or "Connection
        # refused" on some ranks (torch 2.13; reproduced by tests/engine/test_device.py).
        channel = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                 use_local_synchronization=True)
        everyone = all_gather_objects(mine, channel, cpu)
    ranks = [r for r in everyone if r is not None]
    refused = [r for r in ranks if r.refusal is not None]
    if refused:
        which = ("" if len(refused) == len(ranks) else
                 f" (ranks {', '.join(str(r.rank) for r in refused)})")
        raise ValueError(refused[0].refusal + which)
    problem = placement_problem(ranks, one_gpu_each)
    if problem is not None:
        raise ValueError(f"zerocore.shard: {problem}")
    return Placement(tuple(ranks), sum(r.host == platform.host for r in ranks))


def comm_device(group: dist.ProcessGroup, preferred: torch.device,
                device: torch.device | None = None) -> torch.device:
    """A device whose tensors the group's collectives accept (``choose_comm_device``)."""
    return choose_comm_device(backend_map(group), preferred, device,
                              getattr(group, "bound_device_id", None), torch.cuda.current_device)


def choose_comm_device(backends: dict[str, str], preferred: torch.device,
                       device: torch.device | None, bound: torch.device | None,
                       current_cuda_index: Callable[[], int]) -> torch.device:
    """``preferred`` when the group has a backend for its type (the CPU, for objects, on a group
    with gloo); else, a NCCL-only group, the CUDA device the caller passes (``device``: the
    model's), else the group's bound one (``device_id``), else the current one (the last
    resort, for callers that know no device: ``torch.cuda.set_device``'s); else the CPU."""
    if preferred.type in backends:
        return preferred
    if "cuda" in backends:
        if device is not None and device.type == "cuda":
            return device
        if bound is not None:
            return torch.device(bound)
        return torch.device("cuda", current_cuda_index())
    return torch.device("cpu")
