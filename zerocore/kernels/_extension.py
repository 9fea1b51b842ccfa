"""Loads the compiled kernels (zerocore._C) and says what they are.

Three cases, each with a clear outcome:
- ``_C`` was built ahead of time (setup.py) for the torch that is installed: import it.
- It was built for another torch: refuse, naming both versions and the rebuild command, instead of
  letting the dynamic loader fail with an undefined-symbol error.
- It was never built but the sources are here (an editable install made without torch in the
  build environment): compile it now with torch.utils.cpp_extension, once, into torch's extension
  cache, for exactly the torch that is running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import json
import logging
import os
import platform
import re
import time
from typing import Callable, TypeVar

import torch

from zerocore.kernels import _sources

logger = logging.getLogger(__name__)

REBUILD_HINT = "rebuild it with: pip install --no-build-isolation -e ."


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """What zerocore._C contains. ``str(info)`` is a one-line summary."""

    torch_version: str         # the torch it was compiled against
    cuda_version: str | None   # CUDA of that torch when CUDA kernels were built, else None
    cuda_arch_list: str | None
    how: str                   # "built by setup.py" or "compiled on first import"

    @property
    def has_cuda(self) -> bool:
        return self.cuda_version is not None

    def __str__(self) -> str:
        kind = (f"CPU+CUDA kernels (CUDA {self.cuda_version}, arch {self.cuda_arch_list})"
                if self.has_cuda else "CPU-only kernels")
        return f"zerocore._C: {kind} for torch {self.torch_version}, {self.how}"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _check_cpu(avx2: bool) -> None:
    if not avx2 or platform.system() != "Linux":
        return
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        raise ImportError(f"zerocore._C was compiled for x86-64 CPUs with AVX2, FMA and F16C, "
                          f"but this CPU lacks {sorted(missing)}")


def _import_prebuilt(package_dir: str) -> BuildInfo:
    with open(os.path.join(package_dir, "_C_build.json")) as f:
        info = json.load(f)
    if info["torch"] != torch.__version__:
        raise ImportError(f"zerocore._C was built for torch {info['torch']} but torch "
                          f"{torch.__version__} is installed; {REBUILD_HINT}")
    _check_cpu(info.get("avx2", False))
    try:
        importlib.import_module("zerocore._C")
    except (ImportError, OSError) as e:
        raise ImportError(f"zerocore._C (built for torch {info['torch']}) failed to load: {e}; "
                          f"{REBUILD_HINT}") from e
    return BuildInfo(info["torch"], info["cuda"], info["cuda_arch_list"], "built by setup.py")


def _say(message: str) -> None:
    # A warning, so that it reaches a terminal by default (logging's last-resort handler
    # writes warnings to stderr when the application configured nothing): a compile of
    # minutes must not be silent.
    logger.warning(message)


T = TypeVar("T")

# torch's cpp_extension.load marks a build in progress with a file named ``lock`` in the build
# directory (torch.utils.file_baton.FileBaton) and every other loader polls until it is gone. A
# builder that is killed (Ctrl-C during the minutes of a compile, the OOM killer, a job's time
# limit) leaves it behind, and every later import would wait forever.
TORCH_BATON = "lock"


def _build_locked(build_dir: str, build: Callable[[], T]) -> T:
    """``build()`` while this process holds an exclusive ``flock`` on ``build_dir/
    zerocore.flock``, which the OS releases when the process ends however it ends.

    Every zerocore builder takes this lock before torch's, so while it is held no other live
    zerocore process is building here: a ``lock`` file found then was left by a builder that
    died, and is removed (with a line saying so) instead of being waited on forever. Another
    live builder is waited for, with a line saying so."""
    with open(os.path.join(build_dir, "zerocore.flock"), "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"zerocore: another process is compiling the kernels into {build_dir}; "
                 f"waiting for it")
            fcntl.flock(held, fcntl.LOCK_EX)
        baton = os.path.join(build_dir, TORCH_BATON)
        if os.path.exists(baton):
            _say(f"zerocore: removing {baton}, left by a compile that was killed")
            os.remove(baton)
        return build()  # closing the file releases the lock


def _compile_now() -> BuildInfo:
    from torch.utils import cpp_extension

    root = _sources.repo_root()
    with_cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    srcs = _sources.cpu_sources(root) + (_sources.cuda_sources(root) if with_cuda else [])
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _sources.DEFAULT_CUDA_ARCH_LIST)
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None
    # The name carries the build's fingerprint (sources, flags, torch, CUDA targets): a changed
    # source or a torch upgrade compiles anew, and an existing build is loaded without a word.
    fp = _sources.fingerprint(root, with_cuda=with_cuda, torch_version=torch.__version__,
                              cuda_arch_list=arch)
    name = f"zerocore_C_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{fp[:12]}"
    build_dir = os.path.join(os.path.expanduser("~"), ".cache", "zerocore", "kernels", name)
    os.makedirs(build_dir, exist_ok=True)
    _check_cpu(_sources.built_with_avx2())
    compiling = not os.path.isfile(os.path.join(build_dir, f"{name}.so"))
    if compiling:
        took = _sources.CUDA_COMPILE_TIME if with_cuda else _sources.CPU_COMPILE_TIME
        _say(f"zerocore: compiling the kernels for torch {torch.__version__} "
             f"({'CPU+CUDA' if with_cuda else 'CPU only'}) into {build_dir}: {len(srcs)} files, "
             f"{took}, once; a line as each file is done")
    since = time.time()
    progress = (_sources.compile_progress(
        _say, len(srcs), lambda: _sources.objects_written_since(build_dir, since))
        if compiling else contextlib.nullcontext())
    with progress:
        _build_locked(build_dir, lambda: cpp_extension.load(
            name=name, sources=srcs, is_python_module=False, verbose=False,
            build_directory=build_dir,
            extra_cflags=_sources.cxx_flags() + (["-DZEROCORE_WITH_CUDA"] if with_cuda else []),
            extra_cuda_cflags=_sources.nvcc_flags(), extra_ldflags=["-fopenmp"]))
    return BuildInfo(torch.__version__, torch.version.cuda if with_cuda else None,
                     os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None,
                     "compiled on first import")


def _prebuilt_is_stale(package_dir: str) -> bool:
    """Whether the sources beside an installed build (an editable install: the checkout) have
    changed since it was built, e.g. after a ``git pull``: its library would lack their new ops."""
    root = _sources.repo_root()
    if not os.path.isdir(os.path.join(root, "csrc")):
        return False
    with open(os.path.join(package_dir, "_C_build.json")) as f:
        info = json.load(f)
    if "fingerprint" not in info:
        return False
    current = _sources.fingerprint(root, with_cuda=info["cuda"] is not None,
                                   torch_version=info["torch"],
                                   cuda_arch_list=info["cuda_arch_list"])
    return current != info["fingerprint"]


def load() -> BuildInfo:
    """Makes torch.ops.zerocore.* available and returns what was loaded."""
    # The built library and its record sit in the zerocore package, where setup.py puts them.
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(package_dir, "_C_build.json")):
        if not _prebuilt_is_stale(package_dir):
            return _import_prebuilt(package_dir)
        _say("zerocore: csrc/ changed since zerocore._C was installed; using a build of these "
             "sources instead (`pip install --no-build-isolation -e .` rebuilds the installed "
             "one)")
        return _compile_now()
    if os.path.isdir(os.path.join(_sources.repo_root(), "csrc")):
        return _compile_now()
    raise ImportError(f"zerocore._C is not built and its sources are not available; "
                      f"{REBUILD_HINT}")
