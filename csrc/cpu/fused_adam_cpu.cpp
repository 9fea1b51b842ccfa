// zerocore::fused_adam on CPU: one pass over (grad, param, exp_avg, exp_avg_sq[, model_copy]),
// threads across cores (at::parallel_for) and AVX2 inside each thread (at::vec). The loop is
// bound by memory bandwidth on a large shard (28 bytes per element for an fp16 gradient and model
// copy against ~10 flops, two divisions and a square root), so it makes exactly one pass.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../zerocore.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

// The update of one element, in the exact order of torch.optim.adam._single_tensor_adam, so the
// scalar tail and the vector body round identically to PyTorch's own float arithmetic.
template <typename G, typename M>
C10_ALWAYS_INLINE void adam_scalar(float* p, const G* g_ptr, float* m, float* v, M* copy,
                                   const AdamConsts& c) {
  float g = static_cast<float>(*g_ptr) * c.inv_grad_scale;
  float pv = *p;
  g = g + c.weight_decay * pv;  // Adam's L2 term; weight_decay is 0 here for AdamW
  pv = pv * c.decay_factor;     // AdamW's decoupled decay; decay_factor is 1 for Adam
  float mv = *m + c.one_minus_beta1 * (g - *m);
  float vv = *v * c.beta2 + c.one_minus_beta2 * (g * g);
  float denom = std::sqrt(vv) / c.bias_correction2_sqrt + c.eps;
  pv = pv + (-c.step_size) * (mv / denom);
  *p = pv;
  *m = mv;
  *v = vv;
  if (copy != nullptr) *copy = static_cast<M>(pv);
}

// The step's scalars broadcast once per thread. Held in locals rather than re-read through the
// AdamConsts reference, which the compiler must assume the stores to param may overwrite.
struct AdamVecs {
  Vec inv_grad_scale, weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2,
      bias_correction2_sqrt, eps, neg_step_size;
  explicit AdamVecs(const AdamConsts& c)
      : inv_grad_scale(c.inv_grad_scale), weight_decay(c.weight_decay),
        decay_factor(c.decay_factor), one_minus_beta1(c.one_minus_beta1), beta2(c.beta2),
        one_minus_beta2(c.one_minus_beta2), bias_correction2_sqrt(c.bias_correction2_sqrt),
        eps(c.eps), neg_step_size(-c.step_size) {}
};

// Always inlined: GCC otherwise leaves it out of line in most of the nine dtype instantiations,
// and each call passes the vectors through the stack (8-25% slower on a 2^24 shard here).
C10_ALWAYS_INLINE void adam_vec(Vec& p, Vec g, Vec& m, Vec& v, const AdamVecs& c) {
  g = g * c.inv_grad_scale;
  g = g + c.weight_decay * p;
  p = p * c.decay_factor;
  m = m + c.one_minus_beta1 * (g - m);
  v = v * c.beta2 + c.one_minus_beta2 * (g * g);
  Vec denom = v.sqrt() / c.bias_correction2_sqrt + c.eps;
  p = p + c.neg_step_size * (m / denom);
}

// One thread's share [begin, end). With kStream the model copy is written with streaming stores
// (vec_io.h): the elements before its first 32-byte boundary go through the scalar path, which
// rounds like the vector body, so the result does not depend on the alignment.
template <bool kStream, typename G, typename M>
void adam_range(float* p, const G* g, float* m, float* v, M* copy, int64_t begin, int64_t end,
                const AdamConsts& c) {
  const AdamVecs cv(c);
  int64_t i = begin;
  if constexpr (kStream) {
    const int64_t head = streaming_head(copy + begin);
    if (head < 0 || begin + head + kBlock > end) {
      adam_range<false>(p, g, m, v, copy, begin, end, c);
      return;
    }
    for (; i < begin + head; ++i) adam_scalar(p + i, g + i, m + i, v + i, copy + i, c);
  }
  for (; i + kBlock <= end; i += kBlock) {
    Vec p0 = Vec::loadu(p + i), p1 = Vec::loadu(p + i + Vec::size());
    Vec m0 = Vec::loadu(m + i), m1 = Vec::loadu(m + i + Vec::size());
    Vec v0 = Vec::loadu(v + i), v1 = Vec::loadu(v + i + Vec::size());
    Vec g0, g1;
    load2(g + i, g0, g1);
    adam_vec(p0, g0, m0, v0, cv);
    adam_vec(p1, g1, m1, v1, cv);
    p0.store(p + i);
    p1.store(p + i + Vec::size());
    m0.store(m + i);
    m1.store(m + i + Vec::size());
    v0.store(v + i);
    v1.store(v + i + Vec::size());
    if constexpr (kStream) {
      stream2(copy + i, p0, p1);
    } else {
      if (copy != nullptr) store2(copy + i, p0, p1);
    }
  }
  for (; i < end; ++i) {
    adam_scalar(p + i, g + i, m + i, v + i, copy == nullptr ? nullptr : copy + i, c);
  }
}

void fused_adam_cpu(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                    at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& model_copy, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    double inv_grad_scale, bool adamw) {
  const AdamConsts c = check_fused_adam(param, grad, exp_avg, exp_avg_sq, model_copy, lr, beta1,
                                        beta2, eps, weight_decay, step, inv_grad_scale, adamw);
  TORCH_CHECK(param.device().is_cpu(), "zerocore.fused_adam (CPU): param must be on the CPU");
  const int64_t n = param.numel();
  if (n == 0) return;
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const at::ScalarType copy_type =
      model_copy.has_value() ? model_copy->scalar_type() : at::kFloat;
  void* copy_raw = model_copy.has_value() ? model_copy->data_ptr() : nullptr;
  dispatch_float(grad.scalar_type(), [&](auto* g_tag) {
    using G = std::remove_pointer_t<decltype(g_tag)>;
    const G* g = static_cast<const G*>(grad.data_ptr());
    dispatch_float(copy_type, [&](auto* m_tag) {
      using M = std::remove_pointer_t<decltype(m_tag)>;
      M* copy = static_cast<M*>(copy_raw);
      // Only the model copy is worth streaming: param and the moments are stored to lines that
      // were just read, so they are in the cache already.
      const int64_t bytes = n * static_cast<int64_t>(3 * 2 * sizeof(float) + sizeof(G) +
                                                     (copy != nullptr ? sizeof(M) : 0));
      const bool stream = copy != nullptr && use_streaming_stores(bytes);
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        if (stream) {
          adam_range<true>(p, g, m, v, copy, begin, end, c);
          streaming_fence();
        } else {
          adam_range<false>(p, g, m, v, copy, begin, end, c);
        }
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) { m.impl("fused_adam", &fused_adam_cpu); }

}  // namespace zerocore::cpu
