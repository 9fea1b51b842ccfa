// Helpers shared by zerocore's CUDA kernels: 16-byte vector loads/stores of float, Half and
// BFloat16, the alignment test that decides whether a kernel may use them, launch sizing from
// each kernel's occupancy, and the dtype dispatch that instantiates one kernel per dtype
// combination.
//
// The kernels include c10/cuda headers only, not ATen/cuda/CUDAContext.h: that one pulls in the
// cuBLAS/cuSPARSE/cuSOLVER headers, which a minimal CUDA toolkit (the compiler alone, as on CI)
// lacks. c10::cuda::getCurrentCUDAStream is the function at::cuda::getCurrentCUDAStream names.
#pragma once

// Tensor and at::empty alone, not ATen/ATen.h (see ../zerocore.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>

namespace zerocore::cuda {

// Threads per block of every zerocore kernel; the reductions assume a multiple of 32.
constexpr int kThreads = 256;
// Elements per vector step. 8 is one 16-byte access for Half/BFloat16 and two for float, so every
// array of a step moves whole 16-byte words whatever the dtype mix.
constexpr int kVec = 8;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

// Round to nearest even for Half and BFloat16 (c10's device conversions), as the CPU kernels do.
template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// dst[0..N) = src[0..N) with 16-byte loads. src must be 16-byte aligned. Loads go through uint4
// so the compiler emits one 128-bit instruction per word whatever T is.
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* src, T (&dst)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "a vector must be whole 16-byte words");
  constexpr int kPerWord = 16 / sizeof(T);
#pragma unroll
  for (int w = 0; w < N / kPerWord; ++w) {
    const uint4 word = reinterpret_cast<const uint4*>(src)[w];
    memcpy(&dst[w * kPerWord], &word, 16);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* dst, const T (&src)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "a vector must be whole 16-byte words");
  constexpr int kPerWord = 16 / sizeof(T);
#pragma unroll
  for (int w = 0; w < N / kPerWord; ++w) {
    uint4 word;
    memcpy(&word, &src[w * kPerWord], 16);
    reinterpret_cast<uint4*>(dst)[w] = word;
  }
}

// An array a kernel walks element by element: its first element and its element size.
struct Span {
  const void* ptr;
  int64_t elem_size;
};

// The smallest h in [0, kVec) such that element h of every array is 16-byte aligned, clamped to
// n; or -1 when no such h exists (arrays misaligned relative to each other, e.g. a float view at
// an odd element offset next to an aligned one), in which case the kernel runs scalar throughout.
// Null arrays (an absent optional output) are ignored. From element h on, every kVec-th element is
// aligned too, because kVec elements are a whole number of 16-byte words for every dtype.
inline int64_t vector_head(std::initializer_list<Span> arrays, int64_t n) {
  for (int64_t h = 0; h < kVec; ++h) {
    bool aligned = true;
    for (const Span& a : arrays) {
      if (a.ptr == nullptr) continue;
      const uintptr_t addr = reinterpret_cast<uintptr_t>(a.ptr) + h * a.elem_size;
      aligned = aligned && addr % 16 == 0;
    }
    if (aligned) return std::min(h, n);
  }
  return -1;
}

// Blocks of `kernel` (launched with kThreads threads and no dynamic shared memory) that the
// current device runs at once: its multiprocessors times the blocks one of them keeps resident,
// which the kernel's registers and static shared memory decide (the driver's occupancy
// calculator). A fixed 8 blocks per multiprocessor (2048 threads) is more than a kernel using
// over 32 registers a thread can hold, and the blocks beyond the resident ones then run as a
// short second wave after the first has done an equal share.
//
// The answer depends only on the device and the compiled kernel, so it is queried once per
// (device, kernel) and kept in a function-local static table: a launch then costs a map lookup
// instead of two driver calls. This is process-wide state, the way PyTorch's own kernels cache
// device properties (at::cuda::getDeviceProperties), and it is safe to share: the values never
// change while the process runs, and the mutex makes the first queries from concurrent host
// threads (one per device, say) safe.
inline int64_t resident_blocks(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, const void*>, int64_t> table;
  const c10::DeviceIndex device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = table.find({device, kernel});
  if (it != table.end()) return it->second;
  int per_multiprocessor = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel,
                                                               kThreads, /*dynamicSMem=*/0));
  // Every kernel is compiled with __launch_bounds__(kThreads), so at least one block fits.
  TORCH_CHECK(per_multiprocessor > 0, "zerocore: a kernel cannot run with ", kThreads,
              " threads per block on CUDA device ", static_cast<int>(device),
              " (occupancy 0); this is a build problem: rebuild zerocore for this GPU");
  int multiprocessors = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks = static_cast<int64_t>(per_multiprocessor) * multiprocessors;
  table.emplace(std::make_pair(device, kernel), blocks);
  return blocks;
}

// Blocks for `work_items` items of kThreads each, at most what the device runs of `kernel` at
// once (more would only queue behind the first wave). Every kernel walks its work with a
// grid-stride loop, so any grid from 1 block up covers all of it; this picks the fastest.
template <typename Kernel>
inline unsigned int grid_size(Kernel* kernel, int64_t work_items) {
  const int64_t wanted = (work_items + kThreads - 1) / kThreads;
  const int64_t resident = resident_blocks(reinterpret_cast<const void*>(kernel));
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(wanted, resident)));
}

// Calls f with a null pointer of the C++ type of `t` (float, c10::Half or c10::BFloat16), so a
// kernel is instantiated for the dtype of each argument.
template <typename F>
inline void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "zerocore: unsupported dtype ", t);
  }
}

}  // namespace zerocore::cuda
