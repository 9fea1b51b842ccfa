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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../zerocore.h"
#include "fused_adam_isa.h"
#include "isa_choice.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

// Constructed at the first call (a function-local static: thread-safe, and no CPU query at load).
IsaChoice<adam::Kernels>& isa_choice() {
  static IsaChoice<adam::Kernels> choice("adam", adam::scalar_kernels(), adam::avx2_kernels(),
                                         adam::avx512_kernels());
  return choice;
}

const adam::Kernels* active_isa() { return isa_choice().active(); }

std::string cpu_adam_isa(const c10::optional<std::string>& name) {
  return isa_choice().hook(name);
}

std::vector<std::string> cpu_adam_isas() { return isa_choice().runnable(); }

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
