// zerocore::dequantize_nf4_ and zerocore::dequantize_fp8_ on CPU: the low-bit frozen-weight
// formats (zerocore/kernels/formats.py) widened into the compute dtype, threads across cores
// (at::parallel_for) and SIMD inside each thread.
//
// The element loop is compiled once per instruction set (lowbit_{scalar,avx2,avx512}.cpp) and
// chosen at run time as fused_adam's is (isa_choice.h): ZEROCORE_CPU_ISA, or the hook op
// zerocore::_cpu_lowbit_isa for tests. Every choice computes the same bits as
// zerocore.reference: the code's exact float32 value times the block's scale, one IEEE product
// rounded once to the output dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../zerocore.h"
#include "isa_choice.h"
#include "lowbit_isa.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

IsaChoice<lowbit::Kernels>& isa_choice() {
  static IsaChoice<lowbit::Kernels> choice("lowbit", lowbit::scalar_kernels(),
                                           lowbit::avx2_kernels(), lowbit::avx512_kernels());
  return choice;
}

lowbit::Out out_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return lowbit::kF32;
    case at::kHalf: return lowbit::kF16;
    case at::kBFloat16: return lowbit::kBF16;
    default: TORCH_CHECK(false, "zerocore: unsupported output dtype ", t);
  }
}

void dequantize_lowbit_cpu(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                           int64_t block, lowbit::Format format) {
  const char* op = format == lowbit::kNf4 ? "dequantize_nf4_" : "dequantize_fp8_";
  check_dequantize_lowbit(out, q, scales, block, op, format == lowbit::kNf4 ? 4 : 8);
  TORCH_CHECK(out.device().is_cpu(), "zerocore.", op, " (CPU): out must be on the CPU");
  const int64_t n = out.numel();
  if (n == 0) return;
  const lowbit::RangeFn fn = isa_choice().active()->fn[format][out_of(out.scalar_type())];
  void* out_ptr = out.data_ptr();
  const uint8_t* q_ptr = q.data_ptr<uint8_t>();
  const float* s_ptr = scales.data_ptr<float>();
  // Threads take whole steps (kStep elements, whole bytes of NF4 codes), about kGrain elements
  // each, so every range but the last starts and ends on a step.
  const int64_t steps = (n + lowbit::kStep - 1) / lowbit::kStep;
  // Streaming stores (vec_io.h says when they pay), for fp32 outputs only: measured on a loaded
  // machine, they took fp32 outputs from 71-82% of the copy bandwidth to about 100-130%, and
  // gave 16-bit ones no clear gain (bench/records/2026-12-06-kernels-lowbit-dequant.md). They
  // need each vector's address aligned to its width, at most 64 bytes: every vector store
  // starts a multiple of its lanes from out, so an out aligned to 64 bytes gives all of them.
  const bool stream =
      out.scalar_type() == at::kFloat && reinterpret_cast<uintptr_t>(out_ptr) % 64 == 0 &&
      use_streaming_stores(n * static_cast<int64_t>(out.element_size()) + q.numel() +
                           scales.numel() * 4);
  at::parallel_for(0, steps, kGrain / lowbit::kStep, [&](int64_t s0, int64_t s1) {
    fn(out_ptr, q_ptr, s_ptr, block, s0 * lowbit::kStep, std::min(n, s1 * lowbit::kStep),
       stream);
  });
}

void dequantize_nf4_cpu(at::Tensor out, const at::Tensor& packed, const at::Tensor& scales,
                        int64_t block) {
  dequantize_lowbit_cpu(out, packed, scales, block, lowbit::kNf4);
}

void dequantize_fp8_cpu(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales,
                        int64_t block) {
  dequantize_lowbit_cpu(out, codes, scales, block, lowbit::kFp8);
}

std::string cpu_lowbit_isa(const c10::optional<std::string>& name) {
  return isa_choice().hook(name);
}

std::vector<std::string> cpu_lowbit_isas() { return isa_choice().runnable(); }

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) {
  m.impl("dequantize_nf4_", &dequantize_nf4_cpu);
  m.impl("dequantize_fp8_", &dequantize_fp8_cpu);
}

TORCH_LIBRARY_FRAGMENT(zerocore, m) {
  // Which CPU kernels dequantize_nf4_ and dequantize_fp8_ use ("scalar", "avx2", "avx512"); with
  // a name, use those from now on. For tests and benchmarks: every choice computes the same bits.
  m.def("_cpu_lowbit_isa(str? isa=None) -> str", &cpu_lowbit_isa);
  // The ISAs this CPU and build can run, narrowest first.
  m.def("_cpu_lowbit_isas() -> str[]", &cpu_lowbit_isas);
}

}  // namespace zerocore::cpu
