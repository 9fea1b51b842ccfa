// The CPU fused Adam for AVX-512 (F, BW, VL, DQ): 16 floats per vector, 32 elements (128 bytes of
// each fp32 array) per block. Compiled for that target whatever the build's flags, and run only
// where cpuid reports those extensions (fused_adam_cpu.cpp). See fused_adam_vec.h for the loop and
// fused_adam_common.h for the math.
#include "fused_adam_isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
// As in fused_adam_avx2.cpp: everything below is internal to this file and compiled for it.
#include "fused_adam_vec.h"

namespace zerocore::cpu::adam {
namespace {

// Every lane: the mask of the zero-masking (maskz) intrinsics used below. GCC 12's unmasked forms
// of sqrt, the shifts, the conversions and inserti64x4 pass an intentionally uninitialised
// vector (_mm512_undefined_*) as the merge source of an all-lanes mask, which
// -Wmaybe-uninitialized reports once inlined (GCC bug 105593). The maskz forms merge with zero
// instead, a defined value; with a constant all-ones mask GCC emits the same unmasked
// instruction, so this changes the warning only, not the code.
constexpr __mmask16 kAll16 = 0xffff;
constexpr __mmask8 kAll8 = 0xff;

struct Avx512Ops {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr uintptr_t kStreamAlign = 64;  // one 512-bit streaming store

  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_maskz_sqrt_ps(kAll16, a); }

  template <class D>
  static V load(const typename D::T* src) {
    if constexpr (D::kDtype == kF32) {
      return _mm512_loadu_ps(src);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      if constexpr (D::kDtype == kF16) {
        return _mm512_maskz_cvtph_ps(kAll16, h);
      } else {  // bf16: the top half of a float
        return _mm512_castsi512_ps(
            _mm512_maskz_slli_epi32(kAll16, _mm512_maskz_cvtepu16_epi32(kAll16, h), 16));
      }
    }
  }

  static void fence() { _mm_sfence(); }

  static void store(float* dst, V x) { _mm512_storeu_ps(dst, x); }

  template <class M>
  static __m256i narrow(V x) {
    if constexpr (M::kDtype == kF16) {
      return _mm512_maskz_cvtps_ph(kAll16, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      // bf16, as float_to_bf16: to nearest even in integer arithmetic, NaN -> 0x7fc0. Not
      // vcvtneps2bf16 (AVX512_BF16): it flushes subnormals to zero, which torch does not.
      const __m512i b = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(kAll16, b, 16),
                                             _mm512_set1_epi32(1));
      __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
      r = _mm512_maskz_srli_epi32(kAll16, r, 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                _mm512_set1_epi32(0x7fc0));
      return _mm512_maskz_cvtepi32_epi16(kAll16, r);  // every lane is <= 0xffff: truncation is exact
    }
  }

  template <class M, bool kStream>
  static void store_copy(typename M::T* dst, V a, V b) {
    if constexpr (M::kDtype == kF32) {
      if constexpr (kStream) {
        _mm512_stream_ps(dst, a);
        _mm512_stream_ps(dst + kLanes, b);
      } else {
        _mm512_storeu_ps(dst, a);
        _mm512_storeu_ps(dst + kLanes, b);
      }
    } else {
      const __m256i lo = narrow<M>(a), hi = narrow<M>(b);
      if constexpr (kStream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst),
                            _mm512_maskz_inserti64x4(kAll8, _mm512_castsi256_si512(lo), hi, 1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kLanes), hi);
      }
    }
  }
};

constexpr Kernels kAvx512 = make_table<VecKernels<Avx512Ops>::Range>("avx512");

}  // namespace

const Kernels* avx512_kernels() { return &kAvx512; }

}  // namespace zerocore::cpu::adam

#pragma GCC pop_options

#else  // not x86-64: no AVX-512 kernels

namespace zerocore::cpu::adam {
const Kernels* avx512_kernels() { return nullptr; }
}  // namespace zerocore::cpu::adam

#endif
