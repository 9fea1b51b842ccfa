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

#include <algorithm>
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

adam::Scalars scalars_of(const AdamConsts& c) {
  return adam::Scalars{c.inv_grad_scale, c.weight_decay,  c.decay_factor,
                       c.one_minus_beta1, c.beta2,         c.one_minus_beta2,
                       c.bias_correction2_sqrt, c.eps,     -c.step_size};
}

// The arrays of one shard, as the per-ISA range functions take them.
struct Shard {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* copy;  // null: no model copy
  int64_t n;
  adam::Scalars s;
};

Shard shard_of(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
               at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& model_copy,
               const AdamConsts& c) {
  TORCH_CHECK(param.device().is_cpu(), "zerocore.fused_adam (CPU): param must be on the CPU");
  return Shard{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(),
               exp_avg_sq.data_ptr<float>(),
               model_copy.has_value() ? model_copy->data_ptr() : nullptr, param.numel(),
               scalars_of(c)};
}

// Only the model copy is worth streaming: param and the moments are stored to lines that were
// just read, so they are in the cache already, while a normal store of the copy first reads each
// of its lines from memory. Decided once per call, over all its shards.
bool streams_copy(int64_t elements, int64_t grad_bytes, int64_t copy_bytes) {
  const int64_t bytes = elements * (3 * 2 * static_cast<int64_t>(sizeof(float)) + grad_bytes +
                                    copy_bytes);
  return copy_bytes > 0 && bytes > kStreamingMinBytes;
}

// Steps every shard in one parallel region: threads take whole units of every shard (a unit
// never spans two shards), so one call over many shards costs one wake-up of the thread pool
// instead of one per shard, and each element is computed as fused_adam alone would.
void step_shards(const std::vector<Shard>& shards, adam::RangeFn fn, bool stream) {
  std::vector<int64_t> first_unit(shards.size() + 1, 0);  // shard i: units [first[i], first[i+1])
  for (size_t i = 0; i < shards.size(); ++i) {
    first_unit[i + 1] = first_unit[i] + (shards[i].n + kUnit - 1) / kUnit;
  }
  at::parallel_for(0, first_unit.back(), kGrain / kUnit, [&](int64_t u0, int64_t u1) {
    // The shard holding unit u0, then each shard the range reaches into.
    size_t i = std::upper_bound(first_unit.begin(), first_unit.end(), u0) - first_unit.begin() - 1;
    for (int64_t u = u0; u < u1; ++i) {
      const int64_t end_unit = std::min(u1, first_unit[i + 1]);
      const Shard& sh = shards[i];
      const int64_t begin = (u - first_unit[i]) * kUnit;
      const int64_t end = std::min(sh.n, (end_unit - first_unit[i]) * kUnit);
      if (begin < end) fn(sh.p, sh.g, sh.m, sh.v, sh.copy, begin, end, sh.s, stream);  // fences
      u = end_unit;
    }
  });
}

void fused_adam_cpu(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                    at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& model_copy, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    double inv_grad_scale, bool adamw) {
  const AdamConsts c = check_fused_adam(param, grad, exp_avg, exp_avg_sq, model_copy, lr, beta1,
                                        beta2, eps, weight_decay, step, inv_grad_scale, adamw);
  const Shard sh = shard_of(param, grad, exp_avg, exp_avg_sq, model_copy, c);
  if (sh.n == 0) return;
  const adam::Dtype cd = model_copy.has_value() ? dtype_of(model_copy->scalar_type()) : adam::kNone;
  const adam::RangeFn fn = active_isa()->fn[dtype_of(grad.scalar_type())][cd];
  step_shards({sh}, fn,
              streams_copy(sh.n, grad.element_size(),
                           model_copy.has_value() ? model_copy->element_size() : 0));
}

void fused_adam_multi_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList model_copies,
                          at::ArrayRef<double> lrs, at::ArrayRef<double> weight_decays,
                          double beta1, double beta2, double eps, int64_t step,
                          double inv_grad_scale, bool adamw) {
  const std::vector<AdamConsts> consts =
      check_fused_adam_multi(params, grads, exp_avgs, exp_avg_sqs, model_copies, lrs,
                             weight_decays, beta1, beta2, eps, step, inv_grad_scale, adamw);
  if (params.empty()) return;
  std::vector<Shard> shards;
  shards.reserve(params.size());
  int64_t elements = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    // The lists hold handles to the caller's tensors: stepping through them writes those.
    at::Tensor param = params[i], exp_avg = exp_avgs[i], exp_avg_sq = exp_avg_sqs[i];
    const c10::optional<at::Tensor> copy =
        model_copies.empty() ? c10::nullopt : c10::optional<at::Tensor>(model_copies[i]);
    shards.push_back(shard_of(param, grads[i], exp_avg, exp_avg_sq, copy, consts[i]));
    elements += shards.back().n;
  }
  const adam::Dtype cd = model_copies.empty() ? adam::kNone
                                              : dtype_of(model_copies[0].scalar_type());
  const adam::RangeFn fn = active_isa()->fn[dtype_of(grads[0].scalar_type())][cd];
  step_shards(shards, fn,
              streams_copy(elements, grads[0].element_size(),
                           model_copies.empty() ? 0 : model_copies[0].element_size()));
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) {
  m.impl("fused_adam", &fused_adam_cpu);
  m.impl("fused_adam_multi", &fused_adam_multi_cpu);
}

// Ops without tensor arguments (so no dispatch key): kernels for every backend at once.
TORCH_LIBRARY_FRAGMENT(zerocore, m) {
  // Which CPU kernels zerocore.fused_adam uses ("scalar", "avx2", "avx512"); with a name, use
  // those from now on. For tests and benchmarks: every choice computes the same bits.
  m.def("_cpu_adam_isa(str? isa=None) -> str", &cpu_adam_isa);
  // The ISAs this CPU and build can run, narrowest first.
  m.def("_cpu_adam_isas() -> str[]", &cpu_adam_isas);
}

}  // namespace zerocore::cpu
