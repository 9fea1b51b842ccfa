// Loading and storing 2 x Vectorized<float> (16 elements with AVX2) from float, Half or BFloat16
// memory (and int8, for the quantization kernels), so each CPU kernel is written once in float
// arithmetic for every dtype combination.
// Loads and normal stores are unaligned (loadu/storeu), so any offset into a buffer is correct;
// the streaming stores below need alignment, which their callers arrange.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

// Streaming stores and the int8 conversions are written with AVX2 intrinsics on the 256-bit
// at::vec types, so only when at::vec uses its AVX2 implementation (see zerocore/kernels/_sources.py);
// elsewhere they are normal stores and plain loops.
#if defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
#define ZEROCORE_AVX2_STREAMING 1
#include <immintrin.h>
#endif

namespace zerocore::cpu {

using Vec = at::vec::Vectorized<float>;
// Elements handled per vector iteration: two float vectors, i.e. one Vectorized<Half>.
constexpr int64_t kBlock = 2 * Vec::size();

template <typename T>
C10_ALWAYS_INLINE void load2(const T* src, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(src);
    b = Vec::loadu(src + Vec::size());
  } else {
    at::vec::load_to_float<T>(src, a, b);
  }
}

template <typename T>
C10_ALWAYS_INLINE void store2(T* dst, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(dst);
    b.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(dst);
  }
}

// 16 int8 values (kBlock) to two float vectors, exactly (every int8 is a float). at::vec has no
// int8 -> float load of this width, hence the intrinsics; elsewhere a loop the compiler
// vectorises as it can.
C10_ALWAYS_INLINE void load2_int8(const int8_t* src, Vec& a, Vec& b) {
#if defined(ZEROCORE_AVX2_STREAMING)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
#else
  float f[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) f[j] = static_cast<float>(src[j]);
  a = Vec::loadu(f);
  b = Vec::loadu(f + Vec::size());
#endif
}

// The reverse for vectors that already hold whole numbers in [-127, 127], so the conversion is
// exact (the saturating packs never saturate).
C10_ALWAYS_INLINE void store2_int8(int8_t* dst, const Vec& a, const Vec& b) {
#if defined(ZEROCORE_AVX2_STREAMING)
  // packs_epi32 interleaves the 128-bit lanes of its arguments (a0-3 b0-3 a4-7 b4-7 as int16);
  // the permute restores a0-7 b0-7 before the final pack to bytes.
  __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
  w = _mm256_permute4x64_epi64(w, 0xD8);
  const __m128i bytes =
      _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bytes);
#else
  float f[kBlock];
  a.store(f);
  b.store(f + Vec::size());
  for (int64_t j = 0; j < kBlock; ++j) dst[j] = static_cast<int8_t>(f[j]);
#endif
}

// Calls f with a null pointer of the C++ type of `t` (float, c10::Half or c10::BFloat16), so a
// kernel can be instantiated for the dtype of each argument.
template <typename F>
inline void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "zerocore: unsupported dtype ", t);
  }
}

// Streaming (non-temporal) stores. A normal store to a line that is not in the cache first reads
// the line from memory (write-allocate), so copying B bytes moves 3B; a streaming store writes
// whole lines straight to memory and moves 2B. The price is that the written data leaves the
// cache, so the kernels use them only when a call touches more bytes than kStreamingMinBytes,
// where the data would be evicted before anyone reads it anyway. Streaming stores need 32-byte
// aligned addresses: callers store a short head normally (streaming_head) and stream the rest.
#if defined(ZEROCORE_AVX2_STREAMING)
constexpr bool kHaveStreamingStores = true;
#else
constexpr bool kHaveStreamingStores = false;
#endif

// A fixed size rather than the cache size reported by the OS: sysconf reports 320 MiB of L3 in
// the development VM, whose CPU has 32 MiB, and 32 MiB is the last-level cache of one core
// complex of current server CPUs.
constexpr int64_t kStreamingMinBytes = int64_t{32} << 20;

inline bool use_streaming_stores(int64_t bytes_touched) {
  return kHaveStreamingStores && bytes_touched > kStreamingMinBytes;
}

// How many leading elements of dst to store normally so that the rest starts 32-byte aligned, or
// -1 when no element of dst is (an address that is not a multiple of sizeof(T)).
template <typename T>
inline int64_t streaming_head(const T* dst) {
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % 32);
  if (misalign % static_cast<int64_t>(sizeof(T)) != 0) return -1;
  return ((32 - misalign) % 32) / static_cast<int64_t>(sizeof(T));
}

// store2 with streaming stores; dst must be 32-byte aligned. Callers end each thread's share of
// work with streaming_fence().
template <typename T>
C10_ALWAYS_INLINE void stream2(T* dst, const Vec& a, const Vec& b) {
#if defined(ZEROCORE_AVX2_STREAMING)
  if constexpr (std::is_same_v<T, float>) {
    _mm256_stream_ps(dst, a);
    _mm256_stream_ps(dst + Vec::size(), b);
  } else {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), at::vec::convert_from_float<T>(a, b));
  }
#else
  store2(dst, a, b);
#endif
}

// Streaming stores are weakly ordered: fence them before another thread may read the data (the
// end of a parallel region).
inline void streaming_fence() {
#if defined(ZEROCORE_AVX2_STREAMING)
  _mm_sfence();
#endif
}

// Elements per task of at::parallel_for: large enough that thread start-up is amortised, small
// enough that two cores split a 2^24-element shard into many even pieces.
constexpr int64_t kGrain = 32768;

}  // namespace zerocore::cpu
