#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and a CUDA build of torch (no network needed),
# builds zerocore._C in place with its CUDA kernels, measures the device's copy bandwidth, runs
# the CUDA variants of the tests and the CUDA kernel benchmarks, and writes what it found under
# bench/results/ (and into $OUT too when that is set). Run from the repository root:
#
#     bash bench/gpu_check.sh
#
# A failing step is recorded and the script goes on to the next; it exits non-zero at the end if
# any step failed. PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default: this GPU's compute
# capability only, to keep the build short), MAX_JOBS (default: all cores) and STEP_TIMEOUT
# (seconds per step, default 1200) override the defaults.
set -uo pipefail

export PY="${PYTHON:-python3}"
export RES=bench/results
mkdir -p "$RES"
SUMMARY="$RES/gpu_check_summary.md"
STEPS="$RES/.gpu_check_steps.tmp"
: >"$STEPS"
failed=()

# step NAME LOG CMD...: runs CMD (a program or one of the functions below, exported so that the
# bash under `timeout` sees them) with its output in LOG, and records how it went.
step() {
  local name="$1" log="$2"
  shift 2
  local t0=$SECONDS status
  echo "== $name (log: $log)"
  if timeout "${STEP_TIMEOUT:-1200}" bash -c '"$@"' "$name" "$@" >"$log" 2>&1; then
    status="ok"
  else
    status="FAILED (exit $?)"
    failed+=("$name")
  fi
  echo "   $name: $status after $((SECONDS - t0)) s"
  echo "| $name | $status | $((SECONDS - t0)) s | \`$log\` |" >>"$STEPS"
}

# 1. What machine this is.
gpu_env() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  local dirty=""
  git diff --quiet HEAD 2>/dev/null || dirty=" (plus uncommitted changes)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$dirty"
  echo "host: $(uname -srm), $(nproc) cores"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader | sed 's/^/gpu: /'
  echo "nvcc: $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  "$PY" - <<'EOF'
import sys
import torch
print(f"python: {sys.version.split()[0]}; torch: {torch.__version__} (CUDA {torch.version.cuda})")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"torch device 0: {p.name}, compute capability {p.major}.{p.minor}, "
      f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
EOF
}
export -f gpu_env
step "environment" "$RES/gpu_env.txt" gpu_env

# 2. Device-to-device copy bandwidth, counting bytes read plus written: the ceiling the kernel
# benchmarks are compared with. 1 GiB buffers, far larger than L2, timed with CUDA events.
copy_bandwidth() {
  "$PY" - <<'EOF'
import statistics
import torch
n = 1 << 30
src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
times = []
for _ in range(20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
med = statistics.median(times)
print(f"copy bandwidth: {2 * n / med / 1e9:.0f} GB/s (read + write, median of 20 copies of "
      f"1 GiB, {1e3 * med:.3f} ms each; best {2 * n / min(times) / 1e9:.0f} GB/s)")
EOF
}
export -f copy_bandwidth
step "copy bandwidth" "$RES/gpu_copy_bandwidth.txt" copy_bandwidth

# 3. Build in place for this GPU.
capability="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' \
  2>/dev/null || echo "8.0;9.0")"
export ARCH="${TORCH_CUDA_ARCH_LIST:-$capability}"
build() {
  TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    "$PY" setup.py build_ext --inplace &&
    "$PY" -c "import sys, zerocore; print(zerocore.BUILD); sys.exit(not zerocore.BUILD.has_cuda)"
}
export -f build
step "build (arch $ARCH)" "$RES/gpu_build.log" build

# 4. The CUDA variants of the tests. A run in which no CUDA test passed counts as a failure: the
# CUDA cases are skipped when torch sees no GPU, and that is not a pass of the GPU check.
step "CUDA tests" "$RES/gpu_tests.log" \
  "$PY" -m pytest tests -k cuda -q -rfEs -p no:cacheprovider --junitxml="$RES/gpu_tests.xml"
test_summary="$(tail -n 1 "$RES/gpu_tests.log")"
if [[ "$test_summary" != *passed* ]]; then
  failed+=("CUDA tests (none passed)")
fi

# 5. The CUDA kernel benchmarks (the CPU variants are left out: not what this machine is for).
step "CUDA benchmarks" "$RES/gpu_bench.log" \
  "$PY" -m pytest bench/bench_kernels.py --benchmark-only -k cuda -q -p no:cacheprovider \
  --benchmark-json="$RES/gpu_bench.json" --kernel-table="$RES/gpu_kernel_table.md"
if [[ "$(tail -n 1 "$RES/gpu_bench.log")" != *passed* ]]; then
  failed+=("CUDA benchmarks (none ran)")
fi

# 6. The summary: machine, bandwidth, steps, test result, kernel table.
{
  echo "# GPU check"
  echo
  echo '```'
  cat "$RES/gpu_env.txt" "$RES/gpu_copy_bandwidth.txt" 2>/dev/null
  echo '```'
  echo
  echo "| step | result | time | log |"
  echo "|---|---|---:|---|"
  cat "$STEPS"
  echo
  echo "CUDA tests: ${test_summary:-no summary line}"
  echo
  if [[ -s "$RES/gpu_kernel_table.md" ]]; then
    echo "## Kernel benchmarks"
    echo
    cat "$RES/gpu_kernel_table.md"
    echo
  fi
  if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
  else
    echo "All steps passed."
  fi
} >"$SUMMARY"
rm -f "$STEPS"

if [[ -n "${OUT:-}" ]]; then
  cp "$SUMMARY" "$RES/gpu_build.log" "$RES/gpu_tests.log" "$RES/gpu_tests.xml" \
    "$RES/gpu_bench.log" "$RES/gpu_bench.json" "$OUT/" 2>/dev/null || true
fi

cat "$SUMMARY"
if ((${#failed[@]})); then
  exit 1
fi
