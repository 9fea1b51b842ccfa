// zerocore::fused_adam on CUDA: one pass over (grad, param, exp_avg, exp_avg_sq[, model_copy]),
// reading and writing each array once, with 16-byte accesses when every array is aligned and a
// grid-stride loop over 64-bit indices, so shards of any size and any offset work.
// zerocore::fused_adam_multi steps many shards in one launch: a table of the shards and of their
// chunks goes to the device first, and each block takes one chunk of one shard.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

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

// Element i of one shard, one by one. copy may be null (no model copy); M is then float and
// never written.
template <typename G, typename M>
__device__ __forceinline__ void adam_one(float* __restrict__ param, const G* __restrict__ grad,
                                         float* __restrict__ exp_avg,
                                         float* __restrict__ exp_avg_sq, M* __restrict__ copy,
                                         int64_t i, const AdamConsts& c) {
  float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
  adam_math(p, to_float(grad[i]), m, v, c);
  param[i] = p;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if (copy != nullptr) copy[i] = from_float<M>(p);
}

// Elements [i, i + kVec) of one shard, with 16-byte accesses: element i of every array must be
// 16-byte aligned.
template <typename G, typename M>
__device__ __forceinline__ void adam_vec(float* __restrict__ param, const G* __restrict__ grad,
                                         float* __restrict__ exp_avg,
                                         float* __restrict__ exp_avg_sq, M* __restrict__ copy,
                                         int64_t i, const AdamConsts& c) {
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

// head: see vector_head; elements [0, head) and the tail after the last whole vector are done
// one by one by the first threads, everything between in aligned kVec-element steps. head < 0:
// the arrays cannot all be aligned at once, so every element is done one by one.
template <typename G, typename M>
__global__ void __launch_bounds__(kThreads)
    fused_adam_kernel(float* __restrict__ param, const G* __restrict__ grad,
                      float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                      M* __restrict__ copy, int64_t n, int64_t head, AdamConsts c) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (head < 0) {
    for (int64_t i = tid; i < n; i += n_threads) {
      adam_one(param, grad, exp_avg, exp_avg_sq, copy, i, c);
    }
    return;
  }
  const int64_t n_vec = (n - head) / kVec;
  const int64_t vec_end = head + n_vec * kVec;
  if (tid < head) adam_one(param, grad, exp_avg, exp_avg_sq, copy, tid, c);
  if (tid < n - vec_end) adam_one(param, grad, exp_avg, exp_avg_sq, copy, vec_end + tid, c);
  for (int64_t k = tid; k < n_vec; k += n_threads) {
    adam_vec(param, grad, exp_avg, exp_avg_sq, copy, head + k * kVec, c);
  }
}

// fused_adam_multi: the shards' arrays and scalars, and the chunks the grid walks, one block per
// chunk. A chunk is a stretch of one shard, either vectorised (begin 16-byte aligned in every
// array, a whole number of vectors long) or done one element at a time (a shard's unaligned head
// and tail, or all of a shard whose arrays cannot be aligned together).
struct MultiShard {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;  // null: no model copy
  AdamConsts c;
};

struct MultiChunk {
  int64_t begin;
  int64_t end;
  int32_t shard;
  int32_t vectorised;
};

// Elements per chunk: a block of kThreads threads takes 8 vectors each, enough work to amortise
// reading the chunk's and shard's descriptors, small enough that a few shards fill the GPU.
constexpr int64_t kChunk = int64_t{kThreads} * kVec * 8;

template <typename G, typename M>
__global__ void __launch_bounds__(kThreads)
    fused_adam_multi_kernel(const MultiShard* __restrict__ shards,
                            const MultiChunk* __restrict__ chunks) {
  const MultiChunk ch = chunks[blockIdx.x];
  const MultiShard sh = shards[ch.shard];
  float* param = sh.param;
  const G* grad = static_cast<const G*>(sh.grad);
  M* copy = static_cast<M*>(sh.copy);
  if (ch.vectorised) {
    const int64_t n_vec = (ch.end - ch.begin) / kVec;
    for (int64_t k = threadIdx.x; k < n_vec; k += blockDim.x) {
      adam_vec(param, grad, sh.exp_avg, sh.exp_avg_sq, copy, ch.begin + k * kVec, sh.c);
    }
  } else {
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x) {
      adam_one(param, grad, sh.exp_avg, sh.exp_avg_sq, copy, i, sh.c);
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

// Appends shard `index`'s chunks: [begin, end) cut into kChunk-element pieces.
void add_chunks(std::vector<MultiChunk>& chunks, int32_t index, int64_t begin, int64_t end,
                bool vectorised) {
  for (int64_t b = begin; b < end; b += kChunk) {
    chunks.push_back(MultiChunk{b, std::min(end, b + kChunk), index, vectorised ? 1 : 0});
  }
}

void fused_adam_multi_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList model_copies,
                           at::ArrayRef<double> lrs, at::ArrayRef<double> weight_decays,
                           double beta1, double beta2, double eps, int64_t step,
                           double inv_grad_scale, bool adamw) {
  const std::vector<AdamConsts> consts =
      check_fused_adam_multi(params, grads, exp_avgs, exp_avg_sqs, model_copies, lrs,
                             weight_decays, beta1, beta2, eps, step, inv_grad_scale, adamw);
  if (params.empty()) return;
  TORCH_CHECK(params[0].is_cuda(), "zerocore.fused_adam_multi (CUDA): params must be CUDA "
              "tensors, got one on ", params[0].device());
  TORCH_CHECK(params.size() <= static_cast<size_t>(INT32_MAX),
              "zerocore.fused_adam_multi: too many shards in one call (", params.size(), ")");
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  std::vector<MultiShard> shards;
  std::vector<MultiChunk> chunks;
  shards.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const bool has_copy = !model_copies.empty();
    void* copy = has_copy ? model_copies[i].data_ptr() : nullptr;
    shards.push_back(MultiShard{params[i].data_ptr<float>(), grads[i].data_ptr(),
                                exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
                                copy, consts[i]});
    const int64_t n = params[i].numel();
    const int64_t head = vector_head({{shards[i].param, 4},
                                      {shards[i].grad, grads[i].element_size()},
                                      {shards[i].exp_avg, 4},
                                      {shards[i].exp_avg_sq, 4},
                                      {copy, has_copy ? model_copies[i].element_size() : 4}},
                                     n);
    const auto index = static_cast<int32_t>(i);
    if (head < 0) {
      add_chunks(chunks, index, 0, n, false);
      continue;
    }
    const int64_t vec_end = head + (n - head) / kVec * kVec;
    add_chunks(chunks, index, 0, head, false);
    add_chunks(chunks, index, head, vec_end, true);
    add_chunks(chunks, index, vec_end, n, false);
  }
  if (chunks.empty()) return;  // every shard empty
  TORCH_CHECK(chunks.size() <= static_cast<size_t>(INT32_MAX),
              "zerocore.fused_adam_multi: too many elements in one call");

  // The descriptors go to the device in one copy from pinned memory, ordered on this stream
  // before the kernel. torch's caching host allocator keeps the pinned block until that copy is
  // done (the copy records its use on the stream), and the device buffer returns to the caching
  // allocator on this stream, where later work is ordered after the kernel.
  const int64_t shard_bytes = static_cast<int64_t>(shards.size() * sizeof(MultiShard));
  const int64_t chunk_bytes = static_cast<int64_t>(chunks.size() * sizeof(MultiChunk));
  static_assert(sizeof(MultiShard) % alignof(MultiChunk) == 0, "chunks follow shards aligned");
  at::Tensor host = at::empty({shard_bytes + chunk_bytes},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), shards.data(), shard_bytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + shard_bytes, chunks.data(), chunk_bytes);
  at::Tensor table = at::empty({shard_bytes + chunk_bytes},
                               at::TensorOptions().dtype(at::kByte).device(params[0].device()));
  table.copy_(host, /*non_blocking=*/true);
  const auto* dev_shards = reinterpret_cast<const MultiShard*>(table.data_ptr());
  const auto* dev_chunks =
      reinterpret_cast<const MultiChunk*>(static_cast<char*>(table.data_ptr()) + shard_bytes);

  const at::ScalarType copy_type =
      model_copies.empty() ? at::kFloat : model_copies[0].scalar_type();
  dispatch_float(grads[0].scalar_type(), [&](auto* g_tag) {
    using G = std::remove_pointer_t<decltype(g_tag)>;
    dispatch_float(copy_type, [&](auto* m_tag) {
      using M = std::remove_pointer_t<decltype(m_tag)>;
      fused_adam_multi_kernel<G, M><<<static_cast<unsigned int>(chunks.size()), kThreads, 0,
                                      stream>>>(dev_shards, dev_chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CUDA, m) {
  m.impl("fused_adam", &fused_adam_cuda);
  m.impl("fused_adam_multi", &fused_adam_multi_cuda);
}

}  // namespace zerocore::cuda
