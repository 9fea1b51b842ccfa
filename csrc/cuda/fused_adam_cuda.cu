// zerocore::fused_adam on CUDA: one pass over (grad, param, exp_avg, exp_avg_sq[, model_copy]),
// reading and writing each array once, with 16-byte accesses when every array is aligned and a
// grid-stride loop over 64-bit indices, so shards of any size and any offset work.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../zerocore.h"
#include "cuda_common.cuh"

namespace zerocore::cuda {
namespace {

// IEEE round-to-nearest operations that nvcc may not contract into FMAs. The CPU kernels are
// compiled with -ffp-contract=off, so with these the CUDA and CPU results are bitwise equal, and
// a result does not depend on how the compiler scheduled the arithmetic or on --use_fast_math.
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }

// The update of one element in the order of adam_math in cpu/fused_adam_common.h (which follows
// torch.optim.adam._single_tensor_adam).
__device__ __forceinline__ void adam_math(float& p, float g, float& m, float& v,
                                          const AdamConsts& c) {
  g = mul(g, c.inv_grad_scale);
  g = add(g, mul(c.weight_decay, p));  // Adam's L2 term; weight_decay is 0 for AdamW
  p = mul(p, c.decay_factor);          // AdamW's decoupled decay; decay_factor is 1 for Adam
  m = add(m, mul(c.one_minus_beta1, sub(g, m)));
  v = add(mul(v, c.beta2), mul(c.one_minus_beta2, mul(g, g)));
  const float denom = add(div(__fsqrt_rn(v), c.bias_correction2_sqrt), c.eps);
  p = add(p, mul(-c.step_size, div(m, denom)));
}

// head: see vector_head; elements [0, head) and the tail after the last whole vector are done
// one by one by the first threads, everything between in aligned kVec-element steps. head < 0:
// the arrays cannot all be aligned at once, so every element is done one by one. copy may be
// null (no model copy); M is then float and never written.
template <typename G, typename M>
__global__ void __launch_bounds__(kThreads)
    fused_adam_kernel(float* __restrict__ param, const G* __restrict__ grad,
                      float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                      M* __restrict__ copy, int64_t n, int64_t head, AdamConsts c) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;

  auto one = [&](int64_t i) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_math(p, to_float(grad[i]), m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (copy != nullptr) copy[i] = from_float<M>(p);
  };

  if (head < 0) {
    for (int64_t i = tid; i < n; i += n_threads) one(i);
    return;
  }
  const int64_t n_vec = (n - head) / kVec;
  const int64_t vec_end = head + n_vec * kVec;
  if (tid < head) one(tid);
  if (tid < n - vec_end) one(vec_end + tid);
  for (int64_t k = tid; k < n_vec; k += n_threads) {
    const int64_t i = head + k * kVec;
    float p[kVec], m[kVec], v[kVec];
    G g[kVec];
    load_vec(grad + i, g);
    load_vec(param + i, p);
    load_vec(exp_avg + i, m);
    load_vec(exp_avg_sq + i, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) adam_math(p[j], to_float(g[j]), m[j], v[j], c);
    store_vec(param + i, p);
    store_vec(exp_avg + i, m);
    store_vec(exp_avg_sq + i, v);
    if (copy != nullptr) {
      M out[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = from_float<M>(p[j]);
      store_vec(copy + i, out);
    }
  }
}

void fused_adam_cuda(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                     at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& model_copy,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     int64_t step, double inv_grad_scale, bool adamw) {
  const AdamConsts c = check_fused_adam(param, grad, exp_avg, exp_avg_sq, model_copy, lr, beta1,
                                        beta2, eps, weight_decay, step, inv_grad_scale, adamw);
  // check_fused_adam has checked that every argument is on param's device.
  TORCH_CHECK(param.is_cuda(), "zerocore.fused_adam (CUDA): param must be a CUDA tensor, got one "
              "on ", param.device());
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  // Without a model copy the kernel is instantiated with M = float and a null pointer.
  const at::ScalarType copy_type =
      model_copy.has_value() ? model_copy->scalar_type() : at::kFloat;
  void* copy_raw = model_copy.has_value() ? model_copy->data_ptr() : nullptr;
  const int64_t head = vector_head({{p, 4},
                                    {grad.data_ptr(), grad.element_size()},
                                    {m, 4},
                                    {v, 4},
                                    {copy_raw, model_copy.has_value() ? model_copy->element_size()
                                                                     : 4}},
                                   n);
  // One thread per vector, and at least kVec threads for the scalar head and tail.
  const int64_t work = head < 0 ? n : std::max<int64_t>((n - head) / kVec, kVec);

  dispatch_float(grad.scalar_type(), [&](auto* g_tag) {
    using G = std::remove_pointer_t<decltype(g_tag)>;
    dispatch_float(copy_type, [&](auto* m_tag) {
      using M = std::remove_pointer_t<decltype(m_tag)>;
      // Each dtype pair is its own kernel with its own register count, hence its own occupancy.
      const unsigned int blocks = grid_size(fused_adam_kernel<G, M>, work);
      fused_adam_kernel<G, M><<<blocks, kThreads, 0, stream>>>(
          p, static_cast<const G*>(grad.data_ptr()), m, v, static_cast<M*>(copy_raw), n, head, c);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CUDA, m) { m.impl("fused_adam", &fused_adam_cuda); }

}  // namespace zerocore::cuda
