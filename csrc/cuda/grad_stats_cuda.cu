// zerocore::grad_stats on CUDA: the sum of squares of a gradient shard and whether any element is
// inf or nan, in one read of the shard and without synchronising with the host.
//
// Two launches on the current stream. The first reads the shard: each thread sums the squares of
// its elements in double (a float square is exact in double and only the additions round: even
// over a 2^31-element shard the error stays orders of magnitude below the float32 resolution of
// stats), each block reduces its threads and writes one partial (sum, flag) to a scratch tensor.
// The second, one block, adds the partials in a fixed order and updates stats. No atomics, so the
// result is bitwise reproducible run to run on a given GPU, and the scratch needs no zeroing.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../zerocore.h"
#include "cuda_common.cuh"

namespace zerocore::cuda {
namespace {

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  return x;
}

// The sum of x over the block, valid in thread 0. Called once per kernel (its shared scratch is
// not re-synchronised for a second use). blockDim.x must be kThreads.
__device__ __forceinline__ double block_sum(double x) {
  __shared__ double warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  x = warp_sum(x);
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) x = warp_sum(lane < kThreads / 32 ? warp_sums[lane] : 0.0);
  return x;
}

// partials[b] = sum of squares seen by block b; partials[gridDim.x + b] = 1 if block b saw an inf
// or nan, else 0. head: as in fused_adam (vector_head of the grad alone, so never negative for
// an element-aligned tensor; the scalar path is kept for safety).
template <typename G>
__global__ void __launch_bounds__(kThreads)
    grad_stats_partial_kernel(const G* __restrict__ grad, int64_t n, int64_t head,
                              double* __restrict__ partials) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double sum = 0.0;
  bool nonfinite = false;
  auto take = [&](G raw) {
    const float x = to_float(raw);
    nonfinite |= !isfinite(x);
    const double xd = x;
    sum += xd * xd;
  };

  if (head < 0) {
    for (int64_t i = tid; i < n; i += n_threads) take(grad[i]);
  } else {
    const int64_t n_vec = (n - head) / kVec;
    const int64_t vec_end = head + n_vec * kVec;
    if (tid < head) take(grad[tid]);
    if (tid < n - vec_end) take(grad[vec_end + tid]);
    for (int64_t k = tid; k < n_vec; k += n_threads) {
      G g[kVec];
      load_vec(grad + head + k * kVec, g);
#pragma unroll
      for (int j = 0; j < kVec; ++j) take(g[j]);
    }
  }

  const int any_nonfinite = __syncthreads_or(nonfinite);
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = sum;
    partials[gridDim.x + blockIdx.x] = any_nonfinite ? 1.0 : 0.0;
  }
}

// One block: adds the n_blocks partials in a fixed order and updates stats as the CPU kernel
// does (the float stats[0] widened to double, the sum added, rounded back once).
__global__ void __launch_bounds__(kThreads)
    grad_stats_finish_kernel(const double* __restrict__ partials, int n_blocks,
                             float* __restrict__ stats) {
  double sum = 0.0;
  bool nonfinite = false;
  for (int b = threadIdx.x; b < n_blocks; b += blockDim.x) {
    sum += partials[b];
    nonfinite |= partials[n_blocks + b] != 0.0;
  }
  const int any_nonfinite = __syncthreads_or(nonfinite);
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    stats[0] = static_cast<float>(static_cast<double>(stats[0]) + sum);
    if (any_nonfinite) stats[1] = 1.0f;
  }
}

void grad_stats_cuda(const at::Tensor& grad, at::Tensor stats) {
  check_grad_stats(grad, stats);
  // check_grad_stats has checked that stats is on grad's device.
  TORCH_CHECK(grad.is_cuda(), "zerocore.grad_stats (CUDA): grad must be a CUDA tensor, got one on ",
              grad.device());
  TORCH_CHECK(stats.is_contiguous(), "zerocore.grad_stats: stats must be contiguous");
  const int64_t n = grad.numel();
  if (n == 0) return;  // adds 0 and finds nothing non-finite: stats unchanged
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int64_t head = vector_head({{grad.data_ptr(), grad.element_size()}}, n);
  const int64_t work = head < 0 ? n : std::max<int64_t>((n - head) / kVec, kVec);

  dispatch_float(grad.scalar_type(), [&](auto* g_tag) {
    using G = std::remove_pointer_t<decltype(g_tag)>;
    const unsigned int blocks = grid_size(grad_stats_partial_kernel<G>, work);
    // Every slot is written by the first kernel, so the scratch needs no zeroing. Freeing it on
    // return is safe: the caching allocator hands the block only to work queued later on this
    // stream.
    at::Tensor partials = at::empty({2 * static_cast<int64_t>(blocks)},
                                    grad.options().dtype(at::kDouble));
    grad_stats_partial_kernel<G><<<blocks, kThreads, 0, stream>>>(
        static_cast<const G*>(grad.data_ptr()), n, head, partials.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // One block whatever the partial kernel's grid: its loop strides over the partials.
    grad_stats_finish_kernel<<<1, kThreads, 0, stream>>>(
        partials.data_ptr<double>(), static_cast<int>(blocks), stats.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CUDA, m) { m.impl("grad_stats", &grad_stats_cuda); }

}  // namespace zerocore::cuda
