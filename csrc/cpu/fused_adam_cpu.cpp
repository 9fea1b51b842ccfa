// zerocore::fused_adam on CPU: one pass over (grad, param, exp_avg, exp_avg_sq[, model_copy]),
// threads across cores (at::parallel_for) and SIMD inside each thread. A large shard is bound by
// memory bandwidth (28 bytes per element for an fp32 gradient and no copy, against ~14 flops, two
// divisions and a square root), so the kernels stream through memory exactly once.
//
// The element loop is compiled once per instruction set (fused_adam_{scalar,avx2,avx512}.cpp,
// each for its own target whatever the build's flags) and chosen at run time: the widest the CPU
// supports (cpuid), or the one named by the environment variable ZEROCORE_CPU_ISA (scalar, avx2,
// avx512; read once, at the first step), or, for tests, by the op zerocore::_cpu_adam_isa. All of
// them compute the same bits (fused_adam_common.h), so the choice changes speed only.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "../zerocore.h"
#include "fused_adam_isa.h"
#include "vec_io.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ZEROCORE_X86_DISPATCH 1
#include <cpuid.h>
#endif

namespace zerocore::cpu {
namespace {

#if defined(ZEROCORE_X86_DISPATCH)
// XCR0 bits of the register state the OS saves and restores on a context switch: SSE and the
// upper halves of the ymm registers for AVX; with AVX-512 also the opmask registers, the upper
// halves of zmm0-15 and zmm16-31. A CPU can report AVX-512 in cpuid while the OS (or a
// hypervisor) does not save that state; its instructions then fault, or their registers are lost.
constexpr uint64_t kXcr0Avx = 0x6;
constexpr uint64_t kXcr0Avx512 = 0xe6;

// Whether the OS has enabled XSAVE (cpuid.1:ECX.OSXSAVE) and saves every state in `mask`.
// Checked here as well as by __builtin_cpu_supports (whose runtime does check XCR0 in current
// GCC and clang) so the rule does not depend on the compiler's runtime library.
bool os_saves(uint64_t mask) {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & bit_OSXSAVE) == 0) return false;
  uint32_t lo = 0, hi = 0;
  // xgetbv written out: its intrinsic needs the xsave target, and this file is built without it.
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  return (xcr0 & mask) == mask;
}
#endif

// The ISAs this build has kernels for and this CPU and OS can run, narrowest first.
std::vector<const adam::Kernels*> runnable_isas() {
  std::vector<const adam::Kernels*> out{adam::scalar_kernels()};
#if defined(ZEROCORE_X86_DISPATCH)
  if (adam::avx2_kernels() != nullptr && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("f16c") && os_saves(kXcr0Avx)) {
    out.push_back(adam::avx2_kernels());
    // The extensions fused_adam_avx512.cpp is compiled for, every one of them.
    if (adam::avx512_kernels() != nullptr && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && os_saves(kXcr0Avx512)) {
      out.push_back(adam::avx512_kernels());
    }
  }
#endif
  return out;
}

const adam::Kernels* find_isa(const std::string& name) {
  for (const adam::Kernels* k : runnable_isas()) {
    if (name == k->name) return k;
  }
  return nullptr;
}

std::string isa_names() {
  std::string names;
  for (const adam::Kernels* k : runnable_isas()) names += std::string(names.empty() ? "" : ", ") + k->name;
  return names;
}

std::atomic<const adam::Kernels*> g_isa{nullptr};
std::once_flag g_isa_once;

const adam::Kernels* active_isa() {
  std::call_once(g_isa_once, [] {
    const adam::Kernels* chosen = runnable_isas().back();
    const char* env = std::getenv("ZEROCORE_CPU_ISA");
    if (env != nullptr && *env != '\0' && std::string(env) != "auto") {
      chosen = find_isa(env);
      TORCH_CHECK(chosen != nullptr, "zerocore: ZEROCORE_CPU_ISA=", env, " is not one this CPU "
                  "and build can run (", isa_names(), ", or auto)");
    }
    const adam::Kernels* expected = nullptr;  // set only if _cpu_adam_isa did not run first
    g_isa.compare_exchange_strong(expected, chosen);
  });
  return g_isa.load(std::memory_order_relaxed);
}

// The test hook: with a name, makes that ISA's kernels the ones used from now on (in this
// process); returns the name of the ISA in use.
std::string cpu_adam_isa(const c10::optional<std::string>& name) {
  active_isa();
  if (name.has_value()) {
    const adam::Kernels* k = find_isa(*name);
    TORCH_CHECK(k != nullptr, "zerocore._cpu_adam_isa: '", *name, "' is not one this CPU and "
                "build can run (", isa_names(), ")");
    g_isa.store(k);
  }
  return active_isa()->name;
}

std::vector<std::string> cpu_adam_isas() {
  std::vector<std::string> out;
  for (const adam::Kernels* k : runnable_isas()) out.emplace_back(k->name);
  return out;
}

adam::Dtype dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return adam::kF32;
    case at::kHalf: return adam::kF16;
    case at::kBFloat16: return adam::kBF16;
    default: TORCH_CHECK(false, "zerocore.fused_adam: unsupported dtype ", t);
  }
}

// Threads take whole units of 64 elements (256 bytes of each fp32 array, a multiple of every
// ISA's block), so no cache line of an aligned shard is written by two threads.
constexpr int64_t kUnit = 64;

void fused_adam_cpu(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                    at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& model_copy, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    double inv_grad_scale, bool adamw) {
  const AdamConsts c = check_fused_adam(param, grad, exp_avg, exp_avg_sq, model_copy, lr, beta1,
                                        beta2, eps, weight_decay, step, inv_grad_scale, adamw);
  TORCH_CHECK(param.device().is_cpu(), "zerocore.fused_adam (CPU): param must be on the CPU");
  const int64_t n = param.numel();
  if (n == 0) return;
  const adam::Scalars s{c.inv_grad_scale, c.weight_decay,  c.decay_factor,
                        c.one_minus_beta1, c.beta2,         c.one_minus_beta2,
                        c.bias_correction2_sqrt, c.eps,     -c.step_size};
  const adam::Dtype gd = dtype_of(grad.scalar_type());
  const adam::Dtype cd = model_copy.has_value() ? dtype_of(model_copy->scalar_type()) : adam::kNone;
  const adam::Kernels* isa = active_isa();
  const adam::RangeFn fn = isa->fn[gd][cd];
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const void* g = grad.data_ptr();
  void* copy = model_copy.has_value() ? model_copy->data_ptr() : nullptr;
  // Only the model copy is worth streaming: param and the moments are stored to lines that were
  // just read, so they are in the cache already, while a normal store of the copy first reads
  // each of its lines from memory.
  const int64_t bytes = n * static_cast<int64_t>(3 * 2 * sizeof(float) + grad.element_size() +
                                                 (copy != nullptr ? model_copy->element_size() : 0));
  const bool stream = copy != nullptr && bytes > kStreamingMinBytes;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, kGrain / kUnit, [&](int64_t u0, int64_t u1) {
    fn(p, g, m, v, copy, u0 * kUnit, std::min(n, u1 * kUnit), s, stream);  // fences its own
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) { m.impl("fused_adam", &fused_adam_cpu); }

// Ops without tensor arguments (so no dispatch key): kernels for every backend at once.
TORCH_LIBRARY_FRAGMENT(zerocore, m) {
  // Which CPU kernels zerocore.fused_adam uses ("scalar", "avx2", "avx512"); with a name, use
  // those from now on. For tests and benchmarks: every choice computes the same bits.
  m.def("_cpu_adam_isa(str? isa=None) -> str", &cpu_adam_isa);
  // The ISAs this CPU and build can run, narrowest first.
  m.def("_cpu_adam_isas() -> str[]", &cpu_adam_isas);
}

}  // namespace zerocore::cpu
