"""``keep_freed_memory``: a rank that computes on the CPU keeps the memory its large tensors free,
for the next step's, instead of handing it back to the system after every operation.

Why: glibc's malloc serves a request above its mmap threshold (which rises with the blocks freed,
to at most 32 MiB on 64-bit) with a mapping of its own, and unmaps it on free. A training step
on the CPU allocates and frees the same large tensors every step: the built-in run's logits,
their log-softmax and their gradients are 2,048 x 8,192 fp32, 64 MiB each. Each is then faulted
in and zeroed by the kernel page by page, every step: measured (perf, 30 steps of
``python -m neox.finetune``, 2 ranks) 4.6 million page faults and 8.5 s of system time against
19.6 s of user time; with freed memory kept, 0.3 million and 1.1 s, and 37% more tokens a
second, the losses bit for bit (the values do not depend on where a tensor lives; torch aligns
every CPU allocation to 64 bytes either way).

How: ``mallopt`` (glibc only; elsewhere nothing changes and False is returned): no request is
served by a mapping of its own (``M_MMAP_MAX`` 0: large blocks come from the heap, where freed
blocks are reused), and the heap's free top is given back to the system only above 2 GiB
(``M_TRIM_THRESHOLD``: a step's tensors freed at the top would otherwise be trimmed after each
step and faulted in again). The cost: the process's resident memory stays at its peak once
reached (the heap is reused, not returned), which is what a training process's peak is anyway.
The settings are process-wide, but only the main thread's allocations gain: glibc gives other
threads arenas of their own, whose heaps are at most 64 MiB, and a block that does not fit one
is still a mapping of its own (the step's tensors are the main thread's). Where another
allocator serves ``malloc`` (jemalloc or tcmalloc preloaded) the call changes nothing, though
glibc's ``mallopt`` still says it did.
"""

from __future__ import annotations

import ctypes

__all__ = ["keep_freed_memory"]

# glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# The heap's free top kept below this many bytes (mallopt takes an int: 2 GiB - 1 at most).
_TRIM_ABOVE = 2**31 - 1


def keep_freed_memory() -> bool:
    """Makes this process's malloc keep freed memory for reuse (see the module docstring).
    Returns whether it did: False where the C library is not glibc. Process-wide; call it once,
    at a rank's start, before the step's first tensors."""
    try:
        libc = ctypes.CDLL(None)  # (the process's own symbols: its C library's among them)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # (glibc's own symbol: another libc's mallopt differs)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE))
