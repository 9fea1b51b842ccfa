"""``HostArena``: the host memory of one sharding's offloaded state (``Offload(optimizer=True)``):
the fp32 master shards, their 16-bit model copies and the two staging buffers gradients are
copied into from the device, carved in order from one anonymous mapping, and on a GPU pinned,
exactly the bytes used, once the layers are built.

Why not ``torch.empty(..., pin_memory=True)`` per buffer: torch's caching host allocator rounds
each pinned block up (to a power of two), and pinned memory cannot be swapped, with eight ranks
a host; one registration (``cudaHostRegister``) of exactly what is used pins nothing more.

Why a reservation: layers are sharded one at a time (a generator of layers keeps host memory near
one layer), so the total is known only after the last. The mapping is reserved at the size of
the host's memory, which costs address space only (a page takes memory when first written, and
``MAP_NORESERVE`` keeps the reservation out of the kernel's overcommit accounting); what is
carved is written at once, and the rest is never touched.
"""

from __future__ import annotations

import mmap
import os
import weakref

import torch

# Linux's MAP_NORESERVE (the mmap module names it only from Python 3.13).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_ALIGN = 64   # bytes: every buffer starts on a cache line (and any dtype's alignment)


def host_memory_bytes(cgroup_root: str = "/sys/fs/cgroup",
                      proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The memory this process's host gives it, in bytes: the machine's physical memory, or
    its container's memory limit where that is lower (a job confined to 16 GB of a 512 GB
    machine must size what it takes, the NVMe pool, from its 16 GB: the kernel kills it past
    them). The same every run on a machine, unlike what is free at the time."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([physical, *_cgroup_limits(cgroup_root, proc_cgroup)])


def _cgroup_limits(root: str, proc_cgroup: str) -> list[int]:
    """The memory limits of this process's cgroups, in bytes: cgroup v2's ``memory.max`` and
    v1's ``memory.limit_in_bytes``, at the mount's root (what a container with a cgroup
    namespace sees as its own) and at this process's own cgroup (named in ``proc_cgroup``).
    None where a file is missing or says there is no limit ("max"; v1 writes a number near
    2**63, which the machine's memory is below anyway)."""
    files = [f"{root}/memory.max", f"{root}/memory/memory.limit_in_bytes"]
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "ID:CONTROLLERS:PATH"; v2's has no controllers
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            files.append(f"{root}{path.rstrip('/')}/memory.max")
        elif "memory" in controllers.split(","):
            files.append(f"{root}/memory{path.rstrip('/')}/memory.limit_in_bytes")
    limits = []
    for name in files:
        try:
            with open(name) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return limits


class HostArena:
    """``take(numel, dtype)`` hands out consecutive buffers; ``pin()`` pins what was taken (on a
    CUDA machine); ``used`` / ``pinned`` are the bytes carved and pinned."""

    def __init__(self, pin: bool, reserve: int | None = None):
        self._pin = pin
        self._size = reserve if reserve is not None else host_memory_bytes()
        self._map = mmap.mmap(-1, self._size,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)   # holds the mapping
        self.used = 0
        self.pinned = 0

    def take(self, numel: int, dtype: torch.dtype, align: int = _ALIGN) -> torch.Tensor:
        """A new 1-D buffer of ``numel`` elements of ``dtype`` (zeros: fresh pages), starting
        at a multiple of ``align`` bytes (the page, for direct I/O's buffers)."""
        assert self.pinned == 0, "the arena is pinned already: buffers come before pin()"
        start = -(-self.used // align) * align
        end = start + numel * dtype.itemsize
        if end > self._size:
            raise MemoryError(f"zerocore: the offloaded state needs more than the host's "
                              f"{self._size / 2**30:.1f} GiB of memory")
        self.used = end
        # A tensor with a storage of its own, exactly its bytes of the mapping: not a view of
        # ``_bytes``, as views share one version counter, and a shard's counter says whether
        # its master was written (sharded_param.refresh_model_copy); and not a window on the
        # whole mapping's storage, which ``torch.save`` (a checkpoint) would write whole, the
        # reservation's size.
        if numel == 0:
            return torch.empty(0, dtype=dtype)   # frombuffer refuses a count of 0
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=start)

    def pin(self) -> None:
        """Pins the bytes taken so far (a CUDA machine; elsewhere nothing to do): host-device
        copies of them then run asynchronously. Unpinned when the arena goes."""
        if not self._pin or self.used == 0 or self.pinned:
            return
        ptr = self._bytes.data_ptr()
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, self.used, 0)
        if int(err) != 0:
            raise RuntimeError(f"zerocore: pinning {self.used / 2**20:,.1f} MiB of host memory "
                               f"for the offloaded state failed (cudaHostRegister: error "
                               f"{int(err)}); the host may limit locked memory (ulimit -l)")
        self.pinned = self.used
        weakref.finalize(self, cudart.cudaHostUnregister, ptr)
