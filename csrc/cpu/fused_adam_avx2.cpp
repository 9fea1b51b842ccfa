// The CPU fused Adam for AVX2 (+F16C): 8 floats per vector, 16 elements per block. Compiled for
// that target whatever the build's flags, and run only where cpuid reports AVX2 and F16C
// (fused_adam_cpu.cpp). See fused_adam_vec.h for the loop and fused_adam_common.h for the math.
#include "fused_adam_isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
// The headers below hold only templates and inline functions of an unnamed namespace, so every
// function this file emits is compiled for AVX2, internal to it. No FMA: each operation of the
// update must round on its own (and -ffp-contract=off keeps the compiler from fusing).
#include "fused_adam_vec.h"

namespace zerocore::cpu::adam {
namespace {

struct Avx2Ops {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr uintptr_t kStreamAlign = 32;  // one 256-bit streaming store

  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }

  template <class D>
  static V load(const typename D::T* src) {
    if constexpr (D::kDtype == kF32) {
      return _mm256_loadu_ps(src);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      if constexpr (D::kDtype == kF16) {
        return _mm256_cvtph_ps(h);
      } else {  // bf16: the top half of a float
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    }
  }

  static void fence() { _mm_sfence(); }

  static void store(float* dst, V x) { _mm256_storeu_ps(dst, x); }

  template <class M>
  static __m128i narrow(V x) {
    if constexpr (M::kDtype == kF16) {
      return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {  // bf16, as float_to_bf16: to nearest even in integer arithmetic, NaN -> 0x7fc0
      const __m256i b = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
      r = _mm256_srli_epi32(r, 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
      // Every lane is <= 0xffff, so the unsigned-saturating pack is exact.
      return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    }
  }

  template <class M, bool kStream>
  static void store_copy(typename M::T* dst, V a, V b) {
    if constexpr (M::kDtype == kF32) {
      if constexpr (kStream) {
        _mm256_stream_ps(dst, a);
        _mm256_stream_ps(dst + kLanes, b);
      } else {
        _mm256_storeu_ps(dst, a);
        _mm256_storeu_ps(dst + kLanes, b);
      }
    } else {
      const __m128i lo = narrow<M>(a), hi = narrow<M>(b);
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_set_m128i(hi, lo));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kLanes), hi);
      }
    }
  }
};

constexpr Kernels kAvx2 = make_table<VecKernels<Avx2Ops>::Range>("avx2");

}  // namespace

const Kernels* avx2_kernels() { return &kAvx2; }

}  // namespace zerocore::cpu::adam

#pragma GCC pop_options

#else  // not x86-64: no AVX2 kernels

namespace zerocore::cpu::adam {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace zerocore::cpu::adam

#endif
