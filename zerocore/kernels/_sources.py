"""Where the kernel sources are and how they are compiled.

Shared by ``setup.py`` (ahead-of-time build) and ``zerocore.kernels._extension`` (the just-in-time
fallback), so both build exactly the same thing. Imports nothing from torch or zerocore: setup.py
loads this file by path before zerocore can be imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
from typing import Callable, Iterator

# What a compile of the kernels takes, as the messages and the README say it. CPU-only, measured
# with `python setup.py build_ext --inplace` in a fresh clone on 2 cores: 30 s and 31 s at load
# 2 (51-53 s of CPU time; bench/records/2026-12-02-reliability-fault-injection.md), 44 s at load
# 1 and 82 s at load 9 earlier, 291 s on a machine busy with other work (issue 33): the CPU time
# is fixed, the wall time is whatever share of the cores the compile gets. A CUDA build adds the
# four .cu files (not measured here: no GPU machine).
CPU_COMPILE_TIME = "30-45 s on 2 idle cores (minutes on a busy one)"
CUDA_COMPILE_TIME = "5-10 minutes (an estimate)"

# Compute capabilities built by default when TORCH_CUDA_ARCH_LIST is not set: A100 (8.0) and
# H100/H200 (9.0), with PTX for 9.0 so newer GPUs can JIT-compile it.
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"


def repo_root() -> str:
    # zerocore/kernels/_sources.py -> the checkout, which holds csrc/
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_sources(root: str) -> list[str]:
    # fused_adam_{scalar,avx2,avx512}.cpp: one file per instruction set, each compiled for its
    # own target by pragmas inside it, chosen at run time (see cpu/fused_adam_cpu.cpp).
    # The same for lowbit_*.cpp (lowbit_cpu.cpp chooses); cpu_features.cpp asks the CPU which
    # of them it runs.
    names = ["checks.cpp", "ops.cpp", "cpu/cpu_features.cpp", "cpu/fused_adam_cpu.cpp",
             "cpu/fused_adam_scalar.cpp", "cpu/fused_adam_avx2.cpp", "cpu/fused_adam_avx512.cpp",
             "cpu/grad_stats_cpu.cpp", "cpu/pack_cpu.cpp", "cpu/quant_cpu.cpp",
             "cpu/lowbit_cpu.cpp", "cpu/lowbit_scalar.cpp", "cpu/lowbit_avx2.cpp",
             "cpu/lowbit_avx512.cpp"]
    return [os.path.join(root, "csrc", n) for n in names]


def cuda_sources(root: str) -> list[str]:
    names = ["cuda/fused_adam_cuda.cu", "cuda/grad_stats_cuda.cu", "cuda/pack_cuda.cu",
             "cuda/quant_cuda.cu", "cuda/lowbit_cuda.cu"]
    return [os.path.join(root, "csrc", n) for n in names]


def cxx_flags() -> list[str]:
    # No FMA contraction: the vector body and the scalar tail of each kernel must round alike so
    # results do not depend on how the work is split across threads.
    # -g0 last: setuptools adds Python's own CFLAGS, which carry -g (an 8.5 MB library instead
    # of 0.3 MB, and a slower link); the later flag wins.
    flags = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-g0"]
    if platform.machine() in ("x86_64", "AMD64"):
        # ATen's at::vec picks its 256-bit AVX2 implementation from these macros. Every x86-64
        # server CPU of the last ten years has AVX2+FMA+F16C; zerocore checks at import time that
        # the running CPU does too (see zerocore.kernels._extension).
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def nvcc_flags() -> list[str]:
    # Never --use_fast_math: it makes divisions and square roots approximate (and flushes
    # subnormals), and the CUDA kernels must round exactly as the CPU kernels and the references.
    return ["-O3", "-std=c++20", "-lineinfo"]


def fingerprint(root: str, *, with_cuda: bool, torch_version: str, cuda_arch_list: str | None,
                ) -> str:
    """What a build depends on: every file under csrc/, the flags, the torch it is compiled
    against and the CUDA targets. Equal fingerprints mean an existing build can be reused."""
    h = hashlib.sha256()
    csrc = os.path.join(root, "csrc")
    for folder, _, files in sorted(os.walk(csrc)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    h.update(repr((cxx_flags(), nvcc_flags() if with_cuda else None, torch_version,
                   cuda_arch_list if with_cuda else None)).encode())
    return h.hexdigest()


def built_with_avx2() -> bool:
    return "-mavx2" in cxx_flags()


def objects_written_since(build_dir: str, since: float) -> int:
    """How many object files (``.o``) under ``build_dir`` were written since ``since`` (a
    ``time.time()``): the files of this compile done so far."""
    n = 0
    for folder, _, files in os.walk(build_dir):
        for name in files:
            if name.endswith(".o"):
                try:
                    if os.stat(os.path.join(folder, name)).st_mtime >= since:
                        n += 1
                except OSError:  # being replaced by the compiler right now
                    pass
    return n


class TerminalLines:
    """setup.py's messages as written to the terminal, each on a line of its own.

    pip captures a build's output (shown only with -v), so setup.py also writes each message
    straight to the terminal, where pip's spinner is drawing: when the first message comes,
    pip's "Building editable for zerocore (pyproject.toml) ... -" has no newline yet, and after
    each message the spinner draws its next character at the start of the line below. So the
    first message starts a new line, and each later one first clears the line it starts on."""

    def __init__(self):
        self.said = 0  # messages written so far

    def text(self, message: str) -> str:
        """What to write to the terminal for ``message``, the next message."""
        text = ("\r\033[K" if self.said else "\n") + message + "\n"
        self.said += 1
        return text


@contextlib.contextmanager
def compile_progress(say: Callable[[str], None], total: int, done: Callable[[], int], *,
                     poll_s: float = 1.0, quiet_s: float = 20.0,
                     clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """While the block compiles, a line each time a file is done ("zerocore: 2 of 6 files
    compiled (31 s)") and, between them, one every ``quiet_s`` seconds, so that a compile of a
    minute or more is never silent (pip and torch's loader show nothing of it)."""
    stop = threading.Event()
    start = clock()

    def watch() -> None:
        last_n, last_said = 0, start
        while not stop.wait(poll_s):
            n, now = done(), clock()
            if n != last_n or now - last_said >= quiet_s:
                say(f"zerocore: {min(n, total)} of {total} files compiled ({now - start:.0f} s)")
                last_n, last_said = n, now

    watcher = threading.Thread(target=watch, name="zerocore-compile-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
