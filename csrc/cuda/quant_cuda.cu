// zerocore::quantize_blockwise and zerocore::dequantize_blockwise_ on CUDA: symmetric int8
// quantization with one fp32 scale per block of consecutive elements (see quant_cpu.cpp for what
// they are for). Both launch on the current stream and give the CPU kernels' and
// zerocore.reference's results bit for bit: divisions and products are the correctly rounded
// intrinsics (__fdiv_rn, __fmul_rn), whatever the compiler flags, rounding to an integer is rintf
// (half to even), and c10's conversions round to nearest even.
//
// Dequantization runs after every gather of frozen weights, so it is the one tuned for bandwidth:
// 16-byte stores of out wherever out is aligned, and 8-byte loads of q where q is aligned alike.
// Quantization prepares weights once and keeps to plain coalesced accesses.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "../zerocore.h"
#include "cuda_common.cuh"

namespace zerocore::cuda {
namespace {

constexpr float kQMax = 127.0f;

// max(m, a) that is NaN when either is NaN (fmaxf drops a NaN), so that a block holding a NaN gets
// a NaN scale, which the op then reports.
__device__ __forceinline__ float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

// One warp per block of x, a grid-stride loop over blocks: the warp's lanes take the absmax
// together (coalesced reads, a butterfly reduction that leaves it in every lane), then quantize.
// The loop bound depends on the warp only, so every lane reaches each shuffle.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, int8_t* __restrict__ q, float* __restrict__ scales,
                    int64_t n_blocks, int64_t block) {
  const int lane = threadIdx.x % 32;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t b = first; b < n_blocks; b += n_warps) {
    const T* xb = x + b * block;
    int8_t* qb = q + b * block;
    float m = 0.0f;
    for (int64_t i = lane; i < block; i += 32) m = nan_max(m, fabsf(to_float(xb[i])));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    const float scale = __fdiv_rn(m, kQMax);
    if (lane == 0) scales[b] = scale;
    // A zero scale gives q = 0; a non-finite one is reported by the host after the kernel, and
    // zeros keep the float -> int conversion defined.
    const bool zero = !(scale != 0.0f && isfinite(scale));
    for (int64_t i = lane; i < block; i += 32) {
      int8_t v = 0;
      if (!zero) {
        const float r = rintf(__fdiv_rn(to_float(xb[i]), scale));
        v = static_cast<int8_t>(static_cast<int>(fminf(kQMax, fmaxf(-kQMax, r))));
      }
      qb[i] = v;
    }
  }
}

// One output element: the fp32 product (never contracted into a multiply-add) rounded once to D.
template <typename D>
__device__ __forceinline__ D dequantize_one(int8_t v, float scale) {
  return from_float<D>(__fmul_rn(static_cast<float>(v), scale));
}

// Index: uint32_t when every index the kernel forms fits (a 32-bit division per element or step
// is several times cheaper than a 64-bit one), int64_t otherwise.

// Element by element with a division for each: any block size, any alignment.
template <typename D, typename Index>
__global__ void __launch_bounds__(kThreads)
    dequantize_scalar_kernel(D* __restrict__ out, const int8_t* __restrict__ q,
                             const float* __restrict__ scales, Index n, Index block) {
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index i = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    out[i] = dequantize_one<D>(q[i], scales[i / block]);
  }
}

// Steps of kVec elements from element `head` on, where out is 16-byte aligned: one 16-byte store
// per step for Half/BFloat16, two for float. kQVec: q + head is 8-byte aligned too, and each step
// loads its 8 values of q at once; otherwise byte by byte (still coalesced across the warp). The
// head and the tail (< kVec elements each) go to the first threads of the grid. block >= kVec, so
// a step spans at most two blocks: one division per step finds the first, and the lanes past its
// end take the next block's scale.
template <typename D, typename Index, bool kQVec>
__global__ void __launch_bounds__(kThreads)
    dequantize_vector_kernel(D* __restrict__ out, const int8_t* __restrict__ q,
                             const float* __restrict__ scales, Index n, Index block, Index head) {
  const Index tid = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x;
  const Index stride = static_cast<Index>(gridDim.x) * kThreads * kVec;
  const Index vec_end = head + (n - head) / kVec * kVec;
  if (tid < head) out[tid] = dequantize_one<D>(q[tid], scales[tid / block]);
  if (tid < n - vec_end) {
    const Index i = vec_end + tid;
    out[i] = dequantize_one<D>(q[i], scales[i / block]);
  }
  for (Index base = head + tid * kVec; base < vec_end; base += stride) {
    int8_t v[kVec];
    if constexpr (kQVec) {
      const uint2 word = *reinterpret_cast<const uint2*>(q + base);
      memcpy(v, &word, sizeof(word));
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = q[base + j];
    }
    const Index b = base / block;
    const Index k = (b + 1) * block - base;  // lanes of this step in block b, >= 1
    const float s0 = scales[b];
    // Block b + 1 exists when k < kVec: its first element, base + k, is before vec_end <= n.
    const float s1 = k < static_cast<Index>(kVec) ? scales[b + 1] : s0;
    D o[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      o[j] = dequantize_one<D>(v[j], static_cast<Index>(j) < k ? s0 : s1);
    }
    store_vec(out + base, o);
  }
}

template <typename D, typename Index>
void launch_dequantize(D* out, const int8_t* q, const float* scales, int64_t n, int64_t block,
                       cudaStream_t stream) {
  // Element h of out is 16-byte aligned; from there every kVec-th element is too (kVec elements
  // are one or two 16-byte words). -1 only for an address that is not a multiple of sizeof(D).
  const int64_t head = vector_head({{out, static_cast<int64_t>(sizeof(D))}}, n);
  if (block < kVec || head < 0) {
    const unsigned int blocks = grid_size(dequantize_scalar_kernel<D, Index>, n);
    dequantize_scalar_kernel<D, Index><<<blocks, kThreads, 0, stream>>>(
        out, q, scales, static_cast<Index>(n), static_cast<Index>(block));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t steps = (n - head + kVec - 1) / kVec;
  const bool q_aligned = reinterpret_cast<uintptr_t>(q + head) % sizeof(uint2) == 0;
  auto launch = [&](auto kernel) {
    const unsigned int blocks = grid_size(kernel, std::max<int64_t>(steps, 1));
    kernel<<<blocks, kThreads, 0, stream>>>(out, q, scales, static_cast<Index>(n),
                                            static_cast<Index>(block), static_cast<Index>(head));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (q_aligned) {
    launch(dequantize_vector_kernel<D, Index, true>);
  } else {
    launch(dequantize_vector_kernel<D, Index, false>);
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda(const at::Tensor& x, int64_t block) {
  check_quantize_blockwise(x, block);
  TORCH_CHECK(x.is_cuda(), "zerocore.quantize_blockwise (CUDA): x must be a CUDA tensor, got one "
              "on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  const int64_t n_blocks = n / block;
  at::Tensor q = at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({n_blocks}, x.options().dtype(at::kFloat));
  if (n_blocks > 0) {
    dispatch_float(x.scalar_type(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      // One warp (32 threads) per block of x.
      const unsigned int blocks = grid_size(quantize_kernel<T>, n_blocks * 32);
      quantize_kernel<T><<<blocks, kThreads, 0, stream>>>(
          static_cast<const T*>(x.data_ptr()), q.data_ptr<int8_t>(), scales.data_ptr<float>(),
          n_blocks, block);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  check_quantized_finite(scales, block);
  return {q, scales};
}

void dequantize_blockwise_cuda(at::Tensor out, const at::Tensor& q, const at::Tensor& scales,
                               int64_t block) {
  check_dequantize_blockwise(out, q, scales, block);
  TORCH_CHECK(out.is_cuda(), "zerocore.dequantize_blockwise_ (CUDA): out must be a CUDA tensor, "
              "got one on ", out.device());
  const int64_t n = q.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // 32-bit indices when the largest one formed, an index plus one grid stride, stays below 2^32:
  // n < 2^31 and a grid stride of at most a few million elements.
  const bool small = n <= std::numeric_limits<int32_t>::max();
  dispatch_float(out.scalar_type(), [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    D* out_ptr = static_cast<D*>(out.data_ptr());
    if (small) {
      launch_dequantize<D, uint32_t>(out_ptr, q.data_ptr<int8_t>(), scales.data_ptr<float>(), n,
                                     block, stream);
    } else {
      launch_dequantize<D, int64_t>(out_ptr, q.data_ptr<int8_t>(), scales.data_ptr<float>(), n,
                                    block, stream);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CUDA, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cuda);
  m.impl("dequantize_blockwise_", &dequantize_blockwise_cuda);
}

}  // namespace zerocore::cuda
