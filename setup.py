"""Builds zerocore._C: the CPU kernels always, the CUDA kernels too when torch is a CUDA build and
a CUDA toolkit is found (CUDA_HOME or nvcc on PATH). TORCH_CUDA_ARCH_LIST overrides the targets.

Build against the torch you will run with: `pip install --no-build-isolation -e .`. Without torch
at build time (plain `pip install -e .` in an isolated build) no extension is compiled here and
zerocore compiles it on first import instead, for the torch it finds then.
"""

import importlib.util
import json
import os
import shutil
import time

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "zerocore_sources", os.path.join(ROOT, "zerocore", "kernels", "_sources.py"))
sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sources)


def _messages():
    """``say(message)``: a line the user sees. pip captures a build's output unless run with
    -v, so it also goes to the terminal directly when there is one, on a line of its own beside
    pip's spinner (``TerminalLines``)."""
    terminal = sources.TerminalLines()

    def say(message: str) -> None:
        print(message, flush=True)
        try:
            with open("/dev/tty", "a") as tty:
                tty.write(terminal.text(message))
        except OSError:  # no terminal (CI, a pipe): the captured line is all there is
            pass
    return say


def _recorded_fingerprint() -> str | None:
    try:
        with open(os.path.join(ROOT, "zerocore", "_C_build.json")) as f:
            return json.load(f).get("fingerprint")
    except (OSError, ValueError):
        return None


def extension_args():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("zerocore: torch is not importable in the build environment; the kernels will be "
              "compiled on first import (use --no-build-isolation to build them now)")
        return {}
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", sources.DEFAULT_CUDA_ARCH_LIST)
    src = [os.path.relpath(p, ROOT) for p in sources.cpu_sources(ROOT)]
    if with_cuda:
        src += [os.path.relpath(p, ROOT) for p in sources.cuda_sources(ROOT)]
        ext = cpp_extension.CUDAExtension(
            "zerocore._C", src, define_macros=[("ZEROCORE_WITH_CUDA", None)],
            extra_compile_args={"cxx": sources.cxx_flags(), "nvcc": sources.nvcc_flags()},
            extra_link_args=["-fopenmp"])
    else:
        ext = cpp_extension.CppExtension(
            "zerocore._C", src, extra_compile_args={"cxx": sources.cxx_flags()},
            extra_link_args=["-fopenmp"])
    arch = os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else None
    fp = sources.fingerprint(ROOT, with_cuda=with_cuda, torch_version=torch.__version__,
                             cuda_arch_list=arch)
    say = _messages()
    what = (f"for torch {torch.__version__} "
            f"({'CPU+CUDA, arch ' + arch if with_cuda else 'CPU only'})")

    class BuildWithInfo(cpp_extension.BuildExtension):
        """Compiles zerocore._C, or reuses the one already in the source tree when nothing it
        depends on changed (so the README's second install does not compile again), and records
        next to it which torch it was built for, so that importing zerocore under another torch
        gives a clear message instead of a symbol error."""

        def run(self):
            target = self.get_ext_fullpath("zerocore._C")
            in_tree = os.path.join(ROOT, "zerocore", os.path.basename(target))
            if _recorded_fingerprint() == fp and os.path.isfile(in_tree):
                say(f"zerocore: zerocore._C {what} is up to date; reusing it")
                if os.path.abspath(target) != os.path.abspath(in_tree):
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copy2(in_tree, target)
            else:
                n = len(src)
                took = sources.CUDA_COMPILE_TIME if with_cuda else sources.CPU_COMPILE_TIME
                say(f"zerocore: compiling zerocore._C {what}: {n} files, {took}; a line as "
                    f"each file is done")
                start, since = time.monotonic(), time.time()
                with sources.compile_progress(
                        say, n, lambda: sources.objects_written_since(self.build_temp, since)):
                    super().run()
                say(f"zerocore: compiled zerocore._C in {time.monotonic() - start:.0f} s")
            info = {"torch": torch.__version__, "cuda": torch.version.cuda if with_cuda else None,
                    "cuda_arch_list": arch, "avx2": sources.built_with_avx2(),
                    "fingerprint": fp}
            # Beside the library (an editable install copies both into the source tree, where
            # a later install compares fingerprints with it).
            with open(os.path.join(os.path.dirname(target), "_C_build.json"), "w") as f:
                json.dump(info, f, indent=1)

    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildWithInfo.with_options(
        use_ninja=True)}}


setup(packages=find_packages(include=["zerocore", "zerocore.*", "neox", "neox.*"]),
      **extension_args())
