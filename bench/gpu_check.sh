#!/usr/bin/env bash
# The GPU check, sized to fit 8 minutes of a lent GPU machine's time (no network needed). Run from
# the repository root:
#
#     bash bench/gpu_check.sh          # the check (a dry run where torch sees no GPU)
#     bash bench/gpu_check.sh --list   # the steps, their budgets and estimates; runs nothing
#
# Steps, in order, each under its own time budget (PLAN below: the budgets sum to 8 minutes):
#   1. environment  what machine, GPU, driver, compiler and torch this is
#   2. build        zerocore._C in place, with CUDA kernels for this GPU's architecture only
#   3. selftest     python -m zerocore.selftest on the CPU and the GPU: every op against its
#                   reference (and the CUDA kernels against the CPU's, bit for bit), the engine
#                   at world size 1 over NCCL against torch.optim.AdamW (on a model whose groups
#                   end in padding and on one whose groups end in real gradients), offload
#                   against none, a replicated NF4/fp8 frozen base against a sharded one (bit
#                   for bit) and against torch.optim.AdamW (issue 41), copy and fused-Adam
#                   bandwidth
#   4. two ranks    python -m zerocore.tools.job run: two processes on the one GPU (gloo over
#                   CUDA tensors: NCCL refuses two ranks on one GPU), the unpadded model against
#                   the unsharded one with torch.optim.AdamW; where c10d cannot, the step says
#                   so with c10d's error
#   5. bf16 vs CPU  python -m zerocore.tools.job compare: the same bf16 job on the GPU and on
#                   gloo CPU ranks, losses within bf16 rounding (the bound: zerocore/tools/job.py)
#   5b. mesh, qgZ   python -m zerocore.tools.job mesh: the job on a 1x1 DeviceMesh against flat
#                   sharding (bit for bit), and with qgZ (the replicas' all-reduce in int8: the
#                   quantization kernels and the all-to-all on CUDA tensors) over a 2x1 mesh of
#                   two ranks on the GPU against the exact all-reduce, within qgZ's loss bound
#                   (issue 30); its budget came out of build's (120 -> 105 s), the two-rank
#                   and bf16 steps' (45 -> 40, 60 -> 50 s) and layer cost's (25 -> 20 s)
#   6. CUDA tests   pytest tests -k cuda (the low-bit kernels' tests left to 7b)
#   7. benchmarks   bench/bench_kernels.py, CUDA variants only (the low-bit ones left to 7b)
#   7b. low-bit     the NF4 and fp8 dequantization kernels: their tests on CUDA (against the
#                   references, hence the CPU kernels, bit for bit) and their benchmark against
#                   the copy bandwidth (issue 41); its budget came out of the CUDA tests' (60 ->
#                   50 s) and the CUDA benchmarks' (30 -> 15 s), which no longer run them
#   8. example      examples/finetune_hf_trainer.py under torchrun on one GPU (Trainer, LoRA,
#                   offload, gradient checkpointing, bf16): PEFT's reload must generate the
#                   sharded model's line
#   9. layer cost   bench/layer_cost.py --device cuda at one rank: the engine's host cost per layer
#                   (both front doors, FSDP2) beside the unsharded stack's, mostly its kernels
#  10. offload    bench/offload_step.py --device cuda: a pythia-410m shape (4 blocks, bf16)
#                   with its parameter shards in pinned host memory, uploaded ahead of each
#                   gather (Offload(params=True)), against the resident step: target <= 1.3x
#                   (issue 31); with the optimizer in host memory, its CPU Adam pass overlapped
#                   with the next forward (Offload(optimizer=True), the default) and inside the
#                   step (overlap="off"), and one step late (overlap="delayed"): targets <= 1.15x
#                   overlapped, <= 1.05x delayed (issue 44); its budget grew
#                   by 15 s, out of build's (105 -> 90 s, its estimate 60 s)
# With COMPILED=1 a tenth: bench/compiled_units.py --device cuda (torch.compile per block, issue
# 23), beyond the 8 minutes: give it a call of its own (BUDGET=180 COMPILED=1 after a check, on a
# warm machine that kept the build).
# Results go to bench/results/ (gpu_*) and, when $OUT is set, to $OUT after every step, so a run
# cut short still returns what it did: the summary, the selftest's table, the test and benchmark
# logs, the example's log, the build log and a tarball of all gpu_* files (which carries the
# jobs' and the layer-cost tables too; 7 files, each far under 16 MiB).
#
# A failing step is recorded and the next one runs; the exit status is 1 if any failed. Without a
# GPU (torch sees none) this is a dry run: the GPU-only steps are skipped with a message, the
# existing build is imported instead of rebuilt, the selftest runs on the CPU (--quick), the
# two-rank job runs on CPU ranks, the bf16 comparison compares two CPU runs (bit for bit), and the
# CUDA tests and benchmarks are only collected (which catches a selection that matches nothing or
# a module that fails to import); it exits 0 when all of that worked, and writes to a temporary directory
# instead of bench/results/. A dry run's steps get DRY_FACTOR (default 4) times their budgets: a
# small CPU machine is slower than a GPU host's 16 cores at what the CPU does.
#
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default: this GPU's compute
# capability, to keep the build short), MAX_JOBS (default: all cores), STEP_TIMEOUT (seconds, one
# limit for every step instead of the budgets below), BUDGET (seconds for the whole check,
# default the budgets' sum, 480; a step never starts with less than 20 s of it left, and none
# runs past it).
set -uo pipefail

# name|budget s|estimate s|what the dry run does instead. The estimates are guesses until a GPU
# run measures them (the summary records each step's time): none of these steps has run on a
# GPU yet.
PLAN=(
  "environment|10|3|the same"
  "build|90|60|imports the existing build"
  "selftest|60|40|the CPU half, --quick"
  "two ranks, one GPU|40|25|two CPU ranks"
  "bf16: GPU against gloo CPU|50|35|two CPU runs, bit for bit"
  "mesh and qgZ|35|25|the same jobs on CPU ranks"
  "CUDA tests|50|40|collected only"
  "CUDA benchmarks|15|10|collected only"
  "low-bit kernels|25|15|collected only"
  "Trainer example|40|30|--help only"
  "layer cost|20|15|--help only"
  "offload|45|35|--help only"
)
if [[ "${COMPILED:-0}" == 1 ]]; then
  PLAN+=("compiled units|150|90|--help only")
fi

# budget NAME: the step's budget in seconds.
budget() {
  local row
  for row in "${PLAN[@]}"; do
    if [[ "${row%%|*}" == "$1" ]]; then
      IFS='|' read -r _ b _ _ <<<"$row"
      echo "$b"
      return
    fi
  done
  echo "gpu_check: no step named '$1' in PLAN" >&2
  exit 2
}

# The plan as a Markdown table, with the budgets' total.
plan_table() {
  local row name b est dry total=0
  echo "| step | budget | estimate (unmeasured) | in a dry run |"
  echo "|---|---:|---|---|"
  for row in "${PLAN[@]}"; do
    IFS='|' read -r name b est dry <<<"$row"
    echo "| $name | $b s | estimate $est s | $dry |"
    total=$((total + b))
  done
  echo
  echo "Budgets: total $total s."
}

if [[ "${1:-}" == "--list" ]]; then
  plan_table
  exit 0
elif [[ -n "${1:-}" ]]; then
  echo "usage: bash bench/gpu_check.sh [--list]" >&2
  exit 2
fi

export PY="${PYTHON:-python3}"
failed=()
total_budget=0
for row in "${PLAN[@]}"; do
  IFS='|' read -r _ b _ _ <<<"$row"
  total_budget=$((total_budget + b))
done

if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  DRY_RUN=0
  DRY_FACTOR=1
  MODE="GPU run"
  export RES=bench/results
else
  DRY_RUN=1
  DRY_FACTOR="${DRY_FACTOR:-4}"
  MODE="DRY RUN: torch sees no CUDA device, so the GPU-only steps ran on the CPU, were skipped or only collected"
  # A dry run's results are not results: they go to a temporary directory, leaving the tree as
  # it was.
  export RES="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
fi
BUDGET="${BUDGET:-$((total_budget * DRY_FACTOR))}"
deadline=$((SECONDS + BUDGET))
mkdir -p "$RES"
SUMMARY="$RES/gpu_check_summary.md"
STEPS="$(mktemp)"
echo "gpu_check: $MODE; budget ${BUDGET} s; results in $RES"

# Copies what exists so far to $OUT (when set): at most 8 files come back from a lent machine,
# so the many small files travel in one tarball as well.
to_out() {
  [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || return 0
  local out
  out="$(cd "$OUT" && pwd)"
  cp "$SUMMARY" "$RES"/gpu_selftest.txt "$RES"/gpu_tests.log "$RES"/gpu_bench.log \
    "$RES"/gpu_build.log "$RES"/gpu_example.log "$out/" 2>/dev/null
  (cd "$RES" && tar -czf "$out/gpu_results.tar.gz" gpu_* 2>/dev/null)
  return 0
}

# step NAME LOG CMD...: runs CMD (a program or a function below, exported so that the bash under
# `timeout` sees it) with its output in LOG, under STEP_TIMEOUT or the step's budget in PLAN
# (times DRY_FACTOR), cut to what is left of the whole budget; records how it went and
# refreshes the summary. A step whose log ends with "NOT POSSIBLE HERE: ..." and exits 3 is
# recorded as such, not as a failure: the machine cannot do it (c10d, not zerocore).
step() {
  local name="$1" log="$2"
  shift 2
  local limit="${STEP_TIMEOUT:-$(($(budget "$name") * DRY_FACTOR))}"
  local left=$((deadline - SECONDS - 10)) t0=$SECONDS status rc
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit} s; log: $log)"
  if ((left < 20)); then
    status="NOT RUN (budget of ${BUDGET} s spent)"
    failed+=("$name")
    echo "$status" >"$log"
  else
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$log" 2>&1
    rc=$?
    if ((rc == 0)); then
      status="ok"
    elif ((rc == 3)) && grep -q "^NOT POSSIBLE HERE: " "$log"; then
      status="not possible here: $(grep "^NOT POSSIBLE HERE: " "$log" | head -n 1 | cut -c20-300)"
    elif ((rc == 124 || rc == 137)); then
      status="TIMED OUT (limit ${limit} s)"
      failed+=("$name")
    else
      status="FAILED (exit $rc)"
      failed+=("$name")
    fi
  fi
  echo "   $name: $status after $((SECONDS - t0)) s (budget $(budget "$name") s)"
  echo "| $name | $status | $((SECONDS - t0)) s | $(budget "$name") s | \`$log\` |" >>"$STEPS"
  write_summary
}

# skipped NAME WHY: a step this machine cannot run, recorded as such.
skipped() {
  echo "== $1: SKIPPED ($2)"
  echo "| $1 | skipped: $2 | - | $(budget "$1") s | |" >>"$STEPS"
}

# 1. What machine this is.
gpu_env() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  local dirty=""
  git diff --quiet HEAD 2>/dev/null || dirty=" (plus uncommitted changes)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$dirty"
  local memory
  memory="$(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}')"
  echo "host: $(uname -srm), $(nproc) cores, ${memory:-memory unknown}"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
      --format=csv,noheader | sed 's/^/gpu: /'
  else
    echo "gpu: none (no nvidia-smi)"
  fi
  echo "nvcc: $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  "$PY" - <<'EOF'
import sys
import torch
print(f"python: {sys.version.split()[0]}; torch: {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"torch device 0: {p.name}, compute capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
else:
    print("torch sees no CUDA device")
EOF
}
export -f gpu_env

# The summary, rewritten after every step: machine, steps so far, the selftest's table, the
# test result, the kernel table. `write_summary final` once everything has run.
write_summary() {
  {
    echo "# GPU check"
    echo
    echo "$MODE."
    echo
    echo '```'
    cat "$RES/gpu_env.txt" 2>/dev/null
    echo '```'
    echo
    echo "| step | result | time | budget | log |"
    echo "|---|---|---:|---:|---|"
    cat "$STEPS"
    echo
    echo "## Plan"
    echo
    plan_table
    local job
    for job in gpu_two_ranks.log gpu_bf16_vs_cpu.log gpu_offload.txt; do
      if [[ -s "$RES/$job" ]]; then
        echo
        # The offload bench ends with a line per target (params, optimizer, delayed); a job with one.
        echo "$job: $(grep -E ' / resident: ' "$RES/$job" | tr '\n' ' ' | grep . \
                      || tail -n 1 "$RES/$job")"
      fi
    done
    if [[ -s "$RES/gpu_mesh.log" ]]; then  # its two results: the 1x1 mesh, then qgZ
      echo
      echo "gpu_mesh.log:"
      tail -n 2 "$RES/gpu_mesh.log"
    fi
    if [[ -s "$RES/gpu_selftest.txt" ]]; then
      echo
      echo "## Selftest"
      echo
      echo '```'
      cat "$RES/gpu_selftest.txt"
      echo '```'
    fi
    if [[ -s "$RES/gpu_tests.log" ]]; then
      echo
      echo "CUDA tests: $(tail -n 1 "$RES/gpu_tests.log")"
    fi
    if [[ -s "$RES/gpu_kernel_table.md" ]]; then
      echo
      echo "## Kernel benchmarks"
      echo
      cat "$RES/gpu_kernel_table.md"
    fi
    if [[ -s "$RES/gpu_lowbit_table.md" ]]; then
      echo
      echo "## Low-bit dequantization benchmarks"
      echo
      cat "$RES/gpu_lowbit_table.md"
    fi
    echo
    if ((${#failed[@]})); then
      echo "FAILED: ${failed[*]}"
    elif [[ "${1:-}" == final ]]; then
      echo "All steps passed."
    else
      echo "No step failed so far (the check is still running, or was cut short)."
    fi
  } >"$SUMMARY"
  to_out
}

echo "gpu_check: the plan (budgets$( ((DRY_RUN)) && echo ", each times $DRY_FACTOR in this dry run")):"
plan_table
step "environment" "$RES/gpu_env.txt" gpu_env

# 2. Build in place for this GPU (or, in a dry run, import the build that is there).
if ((DRY_RUN)); then
  echo "build: no GPU; the existing build is imported instead"
  step "build" "$RES/gpu_build.log" "$PY" -m zerocore
else
  capability="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export ARCH="${TORCH_CUDA_ARCH_LIST:-$capability}"
  build() {
    TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
      "$PY" setup.py build_ext --inplace &&
      "$PY" -c "import sys, zerocore; print(zerocore.BUILD); sys.exit(not zerocore.BUILD.has_cuda)"
  }
  export -f build
  echo "build: arch $ARCH"
  step "build" "$RES/gpu_build.log" build
fi

# 3. The selftest: it needs no pytest, so it says first whether the basics work. A dry run runs
# its CPU checks at their --quick sizes: the same checks, the step's plumbing exercised, in about
# a third of the time (the full sizes took 58 s of CI's GPU-check dry run on two cores).
selftest_args=()
((DRY_RUN)) && selftest_args=(--quick)
step "selftest" "$RES/gpu_selftest.txt" "$PY" -m zerocore.selftest "${selftest_args[@]}"

# 4. Two ranks on the one GPU (gloo over CUDA tensors), against the unsharded model; in a dry
# run two CPU ranks. Exit 3: c10d cannot run them here, and the log's last line says why.
two_ranks() {
  local device=cuda rc
  ((DRY_RUN)) && device=cpu
  "$PY" -m zerocore.tools.job run --device "$device" --nproc 2 --reference \
    --json "$RES/gpu_two_ranks.json"
  rc=$?
  if ((rc == 3)); then
    echo "NOT POSSIBLE HERE: two ranks on one GPU: see the line above (c10d's error)"
  fi
  return $rc
}
export -f two_ranks
export DRY_RUN
step "two ranks, one GPU" "$RES/gpu_two_ranks.log" two_ranks

# 5. The same bf16 job on the GPU and on gloo CPU ranks: the losses within bf16 rounding (one
# rank each where the GPU cannot hold two); in a dry run two CPU runs, which must agree bit for
# bit.
devices=cpu,cuda
((DRY_RUN)) && devices=cpu,cpu
step "bf16: GPU against gloo CPU" "$RES/gpu_bf16_vs_cpu.log" \
  "$PY" -m zerocore.tools.job compare --devices "$devices" --nproc 2 --dtype bf16 \
  --json "$RES/gpu_bf16_vs_cpu.json"

# 5b. A 1x1 mesh against flat sharding, bit for bit; qgZ over two replicas (two ranks on the
# GPU, gloo over CUDA tensors) against the exact all-reduce. Exit 3: c10d cannot run them.
mesh_jobs() {
  local device=cuda rc
  ((DRY_RUN)) && device=cpu
  "$PY" -m zerocore.tools.job mesh --device "$device"
  rc=$?
  if ((rc == 3)); then
    echo "NOT POSSIBLE HERE: qgZ with two ranks on one GPU: see the line above (c10d's error)"
  fi
  return $rc
}
export -f mesh_jobs
step "mesh and qgZ" "$RES/gpu_mesh.log" mesh_jobs

# 4. The CUDA variants of the tests. A run in which no CUDA test passed counts as a failure: the
# CUDA cases are skipped when torch sees no GPU, and that is not a pass of the GPU check.
if ((DRY_RUN)); then
  step "CUDA tests" "$RES/gpu_tests.log" \
    "$PY" -m pytest tests -k "cuda and not lowbit" --collect-only -q -p no:cacheprovider
else
  step "CUDA tests" "$RES/gpu_tests.log" \
    "$PY" -m pytest tests -k "cuda and not lowbit" -q -rfEs -p no:cacheprovider \
    --junitxml="$RES/gpu_tests.xml"
  if [[ "$(tail -n 1 "$RES/gpu_tests.log")" != *passed* ]]; then
    failed+=("CUDA tests (none passed)")
  fi
fi

# 5. The CUDA kernel benchmarks (the CPU variants are left out: not what this machine is for).
if ((DRY_RUN)); then
  step "CUDA benchmarks" "$RES/gpu_bench.log" \
    "$PY" -m pytest bench/bench_kernels.py -k "cuda and not lowbit" --collect-only -q \
    -p no:cacheprovider
else
  step "CUDA benchmarks" "$RES/gpu_bench.log" \
    "$PY" -m pytest bench/bench_kernels.py --benchmark-only -k "cuda and not lowbit" -q \
    -p no:cacheprovider --benchmark-json="$RES/gpu_bench.json" \
    --kernel-table="$RES/gpu_kernel_table.md"
  if [[ "$(tail -n 1 "$RES/gpu_bench.log")" != *passed* ]]; then
    failed+=("CUDA benchmarks (none ran)")
  fi
fi

# 7b. The NF4 and fp8 dequantization kernels on CUDA: their tests, then their benchmark against
# the copy bandwidth. Both must pass something: skipped CUDA cases are not a pass.
lowbit_kernels() {
  local collect=()
  ((DRY_RUN)) && collect=(--collect-only)
  "$PY" -m pytest tests/kernels/test_lowbit_ops.py -k cuda -q -rfEs -p no:cacheprovider \
    "${collect[@]}" --junitxml="$RES/gpu_lowbit_tests.xml" || return 1
  if ((DRY_RUN)); then
    "$PY" -m pytest bench/bench_kernels.py -k "lowbit and cuda" -q -p no:cacheprovider \
      --collect-only
  else
    "$PY" -m pytest bench/bench_kernels.py --benchmark-only -k "lowbit and cuda" -q \
      -p no:cacheprovider --benchmark-json="$RES/gpu_lowbit_bench.json" \
      --kernel-table="$RES/gpu_lowbit_table.md"
  fi
}
export -f lowbit_kernels
step "low-bit kernels" "$RES/gpu_lowbit.log" lowbit_kernels
if ((!DRY_RUN)) && [[ "$(tail -n 1 "$RES/gpu_lowbit.log")" != *passed* ]]; then
  failed+=("low-bit kernels (none passed)")
fi

# 6. The Trainer example on one GPU (NCCL, bf16 where the GPU has it). In a dry run, its --help
# (which imports transformers, peft and zerocore.hf_trainer).
if ((DRY_RUN)); then
  step "Trainer example" "$RES/gpu_example.log" \
    "$PY" examples/finetune_hf_trainer.py --help
else
  step "Trainer example" "$RES/gpu_example.log" \
    "$PY" -m torch.distributed.run --nproc-per-node 1 examples/finetune_hf_trainer.py \
    --steps 20 --out "$RES/gpu_hf_trainer"
  if ! grep -q "same as the sharded model's: True" "$RES/gpu_example.log"; then
    failed+=("Trainer example (PEFT's reload differs)")
  fi
fi

# 9, 10 (and 11 with COMPILED=1). The engine's cost per layer, parameter offload against the
# resident step, and compiled units on the GPU (in a dry run, their --help).
if ((DRY_RUN)); then
  step "layer cost" "$RES/gpu_layer_cost.txt" "$PY" bench/layer_cost.py --help
  step "offload" "$RES/gpu_offload.txt" "$PY" bench/offload_step.py --help
  if [[ "${COMPILED:-0}" == 1 ]]; then
    step "compiled units" "$RES/gpu_compiled.txt" "$PY" bench/compiled_units.py --help
  fi
else
  step "layer cost" "$RES/gpu_layer_cost.txt" \
    "$PY" bench/layer_cost.py --device cuda --nproc 1 --rounds 5
  step "offload" "$RES/gpu_offload.txt" \
    "$PY" bench/offload_step.py --device cuda --rounds 6
  if [[ "${COMPILED:-0}" == 1 ]]; then
    step "compiled units" "$RES/gpu_compiled.txt" \
      "$PY" bench/compiled_units.py --device cuda --rounds 10
  fi
fi

write_summary final
rm -f "$STEPS"
cat "$SUMMARY"
if ((${#failed[@]})); then
  exit 1
fi
