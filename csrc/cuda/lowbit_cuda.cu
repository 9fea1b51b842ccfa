// zerocore::dequantize_nf4_ and zerocore::dequantize_fp8_ on CUDA: the low-bit frozen-weight
// formats (zerocore/kernels/formats.py) widened into the compute dtype, on the current stream.
// Same bits as the CPU kernels and zerocore.reference: each code's exact float32 value (NF4:
// QLoRA's table; fp8: the e4m3fn bits decoded in integer arithmetic, as cpu/lowbit_common.h)
// times its block's scale with __fmul_rn (never contracted), rounded once by c10's conversions
// (to nearest even). NaN codes of fp8 give a NaN whose bits may differ from the CPU's.
//
// Each thread takes groups of kVec (8) elements, all in one block (blocks are multiples of 32):
// one load of their codes (4 bytes of NF4, 8 of fp8) where the codes are aligned for it, one
// 16-byte store per 16 bytes of out where out is aligned; otherwise element by element.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "../zerocore.h"
#include "cuda_common.cuh"

namespace zerocore::cuda {
namespace {

enum class Format { kNf4, kFp8 };

// QLoRA's NF4 values as float32, as csrc/cpu/lowbit_isa.h's kNf4Code. Copied into each thread
// block's shared memory: the 32 lanes of a warp read 32 different entries at once, which constant
// memory would serialise.
__constant__ float kNf4Code[16] = {
    -0x1p+0f,         -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f,
    -0x1.23449ap-2f,  -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f,
    0x1.45f5fep-4f,   0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c3497p-2f,    0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f};

// The float32 value of an e4m3fn code, exactly (see fp8_value in cpu/lowbit_common.h).
__device__ __forceinline__ float fp8_value(uint32_t v) {
  const uint32_t em = v & 0x7fu;
  if (em == 0x7fu) return __uint_as_float(0x7fc00000u);
  const float mag = em < 8 ? __fmul_rn(static_cast<float>(em), 0x1p-9f)
                           : __uint_as_float((em << 20) + (120u << 23));
  return __uint_as_float(__float_as_uint(mag) | ((v & 0x80u) << 24));
}

// Codes of kVec elements starting at element `base` (a multiple of kVec), as bytes: NF4 packs
// them into kVec / 2 bytes, fp8 takes kVec.
template <Format F>
constexpr int kCodeBytes = F == Format::kNf4 ? kVec / 2 : kVec;

template <Format F>
__device__ __forceinline__ float value_of(const uint8_t* codes, int j, const float* table) {
  if constexpr (F == Format::kNf4) {
    return table[(codes[j / 2] >> ((j % 2) * 4)) & 0xfu];
  } else {
    return fp8_value(codes[j]);
  }
}

template <Format F>
__device__ __forceinline__ float value_at(const uint8_t* q, int64_t i, const float* table) {
  if constexpr (F == Format::kNf4) {
    return table[(q[i / 2] >> ((i % 2) * 4)) & 0xfu];
  } else {
    return fp8_value(q[i]);
  }
}

// Index: uint32_t when every index formed fits (a 32-bit division per group is several times
// cheaper than a 64-bit one), int64_t otherwise. kVecQ: the codes are aligned for one load per
// group; kVecOut: out is 16-byte aligned, for 16-byte stores.
template <Format F, typename D, typename Index, bool kVecQ, bool kVecOut>
__global__ void __launch_bounds__(kThreads)
    dequantize_lowbit_kernel(D* __restrict__ out, const uint8_t* __restrict__ q,
                             const float* __restrict__ scales, Index n, Index block) {
  __shared__ float table[16];
  if constexpr (F == Format::kNf4) {
    if (threadIdx.x < 16) table[threadIdx.x] = kNf4Code[threadIdx.x];
    __syncthreads();
  }
  const Index groups = (n + kVec - 1) / kVec;
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index g = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
       g += stride) {
    const Index base = g * kVec;
    const float scale = scales[base / block];
    if (base + kVec <= n) {
      uint8_t codes[kCodeBytes<F>];
      const uint8_t* src = q + g * kCodeBytes<F>;
      if constexpr (kVecQ && F == Format::kNf4) {
        const uint32_t word = *reinterpret_cast<const uint32_t*>(src);
        memcpy(codes, &word, sizeof(word));
      } else if constexpr (kVecQ) {
        const uint2 word = *reinterpret_cast<const uint2*>(src);
        memcpy(codes, &word, sizeof(word));
      } else {
#pragma unroll
        for (int j = 0; j < kCodeBytes<F>; ++j) codes[j] = src[j];
      }
      D o[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) o[j] = from_float<D>(__fmul_rn(value_of<F>(codes, j, table), scale));
      if constexpr (kVecOut) {
        store_vec(out + base, o);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[base + j] = o[j];
      }
    } else {  // the last, partial group
      for (Index i = base; i < n; ++i) {
        out[i] = from_float<D>(__fmul_rn(value_at<F>(q, i, table), scale));
      }
    }
  }
}

template <Format F, typename D, typename Index>
void launch(D* out, const uint8_t* q, const float* scales, int64_t n, int64_t block,
            cudaStream_t stream) {
  const bool vec_q = reinterpret_cast<uintptr_t>(q) % kCodeBytes<F> == 0;
  const bool vec_out = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t groups = (n + kVec - 1) / kVec;
  auto go = [&](auto kernel) {
    const unsigned int blocks = grid_size(kernel, groups);
    kernel<<<blocks, kThreads, 0, stream>>>(out, q, scales, static_cast<Index>(n),
                                            static_cast<Index>(block));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vec_q && vec_out) {
    go(dequantize_lowbit_kernel<F, D, Index, true, true>);
  } else if (vec_q) {
    go(dequantize_lowbit_kernel<F, D, Index, true, false>);
  } else if (vec_out) {
    go(dequantize_lowbit_kernel<F, D, Index, false, true>);
  } else {
    go(dequantize_lowbit_kernel<F, D, Index, false, false>);
  }
}

template <Format F>
void dequantize_lowbit_cuda(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                            int64_t block) {
  const char* op = F == Format::kNf4 ? "dequantize_nf4_" : "dequantize_fp8_";
  check_dequantize_lowbit(out, q, scales, block, op, F == Format::kNf4 ? 4 : 8);
  TORCH_CHECK(out.is_cuda(), "zerocore.", op, " (CUDA): out must be a CUDA tensor, got one on ",
              out.device());
  const int64_t n = out.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // 32-bit indices when the largest one formed, a group's first element plus one grid stride of
  // groups, stays below 2^32: n < 2^31 and a grid of at most a few million threads.
  const bool small = n <= std::numeric_limits<int32_t>::max();
  dispatch_float(out.scalar_type(), [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    D* out_ptr = static_cast<D*>(out.data_ptr());
    if (small) {
      launch<F, D, uint32_t>(out_ptr, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, block,
                             stream);
    } else {
      launch<F, D, int64_t>(out_ptr, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, block,
                            stream);
    }
  });
}

void dequantize_nf4_cuda(at::Tensor out, const at::Tensor& packed, const at::Tensor& scales,
                         int64_t block) {
  dequantize_lowbit_cuda<Format::kNf4>(out, packed, scales, block);
}

void dequantize_fp8_cuda(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales,
                         int64_t block) {
  dequantize_lowbit_cuda<Format::kFp8>(out, codes, scales, block);
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CUDA, m) {
  m.impl("dequantize_nf4_", &dequantize_nf4_cuda);
  m.impl("dequantize_fp8_", &dequantize_fp8_cuda);
}

}  // namespace zerocore::cuda
