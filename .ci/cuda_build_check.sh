#!/usr/bin/env bash
# Compiles and links zerocore._C with its CUDA kernels against a CUDA build of torch, on a machine
# without a GPU, so that a CUDA compile or link error fails CI. Run from the repository root.
#
# The build goes to a temporary directory (setup.py build_ext --build-lib/--build-temp), so the
# in-place build of the working tree is left untouched. The result is then checked without a GPU:
# the library loads with every symbol resolved, registers a CUDA kernel for each op, and holds
# machine code for sm_90; zerocore.selftest imports with it, plans its CUDA checks and passes its
# CPU ones. Skipped (exit 0) where no CUDA compiler is installed.
#
# One architecture, sm_90 (the H100/H200 the GPU checks run on): no kernel has code of its own
# for an architecture (no __CUDA_ARCH__ in csrc/, checked below), so a second one compiled the
# same source again. Measured 2026-12-07 on this 2-core machine under the test suite's load:
# sm_80 and sm_90 342 s of CPU (build 417 s), sm_90 alone 255 s (258 s). A user's build
# (setup.py) keeps its default, 8.0;9.0+PTX: the same source for each.
#
# Environment: ZEROCORE_CUDA_VENV (default $HOME/.cache/zerocore-ci/venv-cuda, created with
# torch==2.14.1 if missing), CUDA_HOME (default /usr/local/cuda, else the toolkit of the nvcc on
# PATH), MAX_JOBS (default 2).
set -euo pipefail

# The toolkit: CUDA_HOME if set, else /usr/local/cuda, else the one around an nvcc on PATH (which
# may be a wrapper script, so /usr/local/cuda is tried first).
if [[ -z "${CUDA_HOME:-}" ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  fi
fi
if [[ -z "${CUDA_HOME:-}" || ! -x "$CUDA_HOME/bin/nvcc" ]]; then
  echo "cuda_build_check: SKIPPED (no CUDA toolkit: no nvcc in \$CUDA_HOME/bin, /usr/local/cuda/bin or on PATH)"
  exit 0
fi
export CUDA_HOME
NVCC="$CUDA_HOME/bin/nvcc"
VENV="${ZEROCORE_CUDA_VENV:-$HOME/.cache/zerocore-ci/venv-cuda}"
TORCH_PIN="torch==2.14.1"
ARCHS="9.0"
# The reason one architecture is enough holds only while no kernel branches on it.
if grep -rn "__CUDA_ARCH__" csrc; then
  echo "cuda_build_check: FAIL (csrc/ branches on __CUDA_ARCH__: build every architecture it" \
       "names, ARCHS above, not only $ARCHS)"
  exit 1
fi

fail() {
  echo "cuda_build_check: FAIL ($1)${WORK:+; build files and log kept in $WORK}"
  exit 1
}

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "cuda_build_check: creating $VENV with $TORCH_PIN (CUDA build)"
  python3 -m venv "$VENV"
  # --no-compile: pip byte-compiles every module of torch on install (thousands; this check
  # imports a few hundred, which Python compiles on first import). Measured 2026-12-07: 47 s of
  # CPU with it, 26 s without.
  "$VENV/bin/pip" install -q --no-compile "$TORCH_PIN" numpy setuptools wheel ninja
fi
"$VENV/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)" ||
  fail "torch in $VENV is not a CUDA build"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/zerocore-cuda-check.XXXXXX")"
echo "cuda_build_check: nvcc $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), torch \
$("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), arch $ARCHS, into $WORK"

start=$SECONDS
# The venv's bin first: torch's BuildExtension runs `ninja` from PATH.
if ! PATH="$VENV/bin:$PATH" TORCH_CUDA_ARCH_LIST="$ARCHS" MAX_JOBS="${MAX_JOBS:-2}" \
    "$VENV/bin/python" setup.py build_ext --build-lib "$WORK/lib" --build-temp "$WORK/tmp" \
    >"$WORK/build.log" 2>&1; then
  # The compiler's messages, without the Python traceback of the build that follows them.
  grep -E -A3 "(error|Error)[: ]" "$WORK/build.log" | grep -v -E "^\s+(File|raise|\^)" |
    head -n 60 || true
  fail "the extension did not build"
fi
build_s=$((SECONDS - start))
# Warnings in our own kernels are shown (not fatal) so they get noticed.
grep -E "csrc/.*warning" "$WORK/build.log" | sort -u || true

SO="$(find "$WORK/lib/zerocore" -maxdepth 1 -name '_C*.so' | head -n 1)"
[[ -n "$SO" ]] || fail "no zerocore/_C*.so in the build output"

# torch.ops.load_library dlopens with RTLD_NOW, so an unresolved symbol fails here.
"$VENV/bin/python" - "$SO" <<'EOF' || fail "the library did not load or lacks CUDA kernels"
import sys

import torch

torch.ops.load_library(sys.argv[1])
missing = [f"zerocore::{op} for {key}"
           for op in ("fused_adam", "fused_adam_multi", "grad_stats", "pack", "unpack", "quantize_blockwise",
                      "dequantize_blockwise_", "dequantize_nf4_", "dequantize_fp8_")
           for key in ("CPU", "CUDA")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"zerocore::{op}", key)]
if missing:
    print("no kernel registered:", ", ".join(missing))
    sys.exit(1)
EOF

# zerocore.selftest under this CUDA build of torch, with the library just built beside the
# package's Python files: it imports cleanly, its CUDA branch plans its checks and refuses to run
# them without a GPU (exit 2, with the reason), and its CPU checks pass (--quick).
# From $WORK: `python -m` puts the current directory first on sys.path, and the working tree's
# zerocore holds the CPU build for the other torch.
# Every module of the package, its subpackages too (build_ext writes only the library).
(cd zerocore && find . -name '*.py' -exec cp --parents {} "$WORK/lib/zerocore/" \;)
selftest() {
  (cd "$WORK" && PYTHONPATH="$WORK/lib" CUDA_VISIBLE_DEVICES="" \
    "$VENV/bin/python" -m zerocore.selftest "$@")
}
selftest --device cuda --list >"$WORK/selftest.txt" 2>&1 &&
  grep -q "^cuda:0: cuda kernels = cpu kernels" "$WORK/selftest.txt" ||
  { cat "$WORK/selftest.txt"; fail "selftest --device cuda --list did not plan the CUDA checks"; }
rc=0
selftest --device cuda >"$WORK/selftest.txt" 2>&1 || rc=$?
[[ $rc -eq 2 ]] && grep -q "torch sees no CUDA device" "$WORK/selftest.txt" ||
  { cat "$WORK/selftest.txt"; fail "selftest --device cuda without a GPU: exit $rc, expected 2"; }
selftest --device cpu --quick >"$WORK/selftest.txt" 2>&1 ||
  { cat "$WORK/selftest.txt"; fail "selftest --device cpu --quick failed under $TORCH_PIN"; }
tail -n 1 "$WORK/selftest.txt" | sed 's/^/cuda_build_check: /'

# cuobjdump comes with the CUDA toolkit, and with the triton package that CUDA builds of torch
# depend on.
CUOBJDUMP="$(command -v cuobjdump || true)"
for c in "$CUDA_HOME/bin/cuobjdump" "$VENV"/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump; do
  if [[ -z "$CUOBJDUMP" && -x "$c" ]]; then CUOBJDUMP="$c"; fi
done
if [[ -n "$CUOBJDUMP" ]]; then
  elfs="$("$CUOBJDUMP" --list-elf "$SO")" || fail "cuobjdump could not read $SO"
  for arch in ${ARCHS//;/ }; do
    sm="sm_${arch/./}"
    grep -q "\.$sm\.cubin" <<<"$elfs" || fail "no $sm machine code in $SO"
  done
  # Registers and stack frame per kernel and arch, for the log: a non-zero stack frame means
  # spills to local memory, a performance regression worth a look (not an error).
  "$CUOBJDUMP" --dump-resource-usage "$SO" >"$WORK/resources.txt"
  "$VENV/bin/python" - "$WORK/resources.txt" <<'EOF'
import re, shutil, subprocess, sys
arch, rows = "?", []
for line in open(sys.argv[1]):
    if m := re.match(r"\s*arch = (sm_\w+)", line):
        arch = m[1]
    elif m := re.match(r"\s*Function (\S+):", line):
        name = m[1]
    elif m := re.match(r"\s*REG:(\d+) STACK:(\d+)", line):
        rows.append((arch, name, int(m[1]), int(m[2])))
names = [r[1] for r in rows]
if shutil.which("c++filt"):
    names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                           text=True).stdout.splitlines()
for (arch, _, reg, stack), name in zip(rows, names):
    name = re.sub(r"\(.*", "", name.replace("zerocore::cuda::(anonymous namespace)::", ""))
    spills = "  <- spills" if stack else ""
    print(f"  {arch} {reg:3d} registers, {stack:4d} B stack{spills}  {name}")
EOF
else
  echo "cuda_build_check: no cuobjdump found; machine code for ${ARCHS} not checked"
fi

rm -rf "$WORK"
echo "cuda_build_check: PASS (built in ${build_s}s with MAX_JOBS=${MAX_JOBS:-2}; kernels registered for CPU and CUDA; arch ${ARCHS})"
