// The CPU dequantization of NF4 and fp8 for AVX2 (+F16C): 8 floats per vector. Compiled for that
// target whatever the build's flags, and run only where cpuid reports AVX2 and F16C
// (lowbit_cpu.cpp). See lowbit_common.h for the loop.
#include "lowbit_isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
// As in fused_adam_avx2.cpp: everything below is internal to this file and compiled for it.
#include "lowbit_common.h"

namespace zerocore::cpu::lowbit {
namespace {

struct Avx2Ops {
  using V = __m256;
  static constexpr int64_t kLanes = 8;

  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }

  // 8 codes from 4 bytes: each byte twice (shuffle), widened to 32 bits, the low nibble of the
  // even lanes and the high nibble of the odd ones; the table's halves looked up by the low 3
  // bits of the code, and bit 3 (moved to the sign bit) chooses between them.
  static V nf4(const uint8_t* src) {
    int32_t word;
    __builtin_memcpy(&word, src, 4);
    const __m128i pairs = _mm_shuffle_epi8(
        _mm_cvtsi32_si128(word), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i code = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_cvtepu8_epi32(pairs), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
        _mm256_set1_epi32(0xf));
    const V lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kNf4Code), code);
    const V hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kNf4Code + 8), code);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
  }

  // 8 codes from 8 bytes, lane by lane as fp8_value.
  static V fp8(const uint8_t* src) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    const __m256i em = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
    const V normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    const V subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-9f));
    const V is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
    const V sign = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24));
    const V value = _mm256_or_ps(_mm256_blendv_ps(normal, subnormal, is_sub), sign);
    const V is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f)));
    return _mm256_blendv_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), is_nan);
  }

  static void fence() { _mm_sfence(); }

  // bf16 as float_to_bf16: to nearest even in integer arithmetic, NaN -> 0x7fc0; every lane
  // is <= 0xffff, so the unsigned-saturating pack is exact.
  static __m128i to_bf16(V x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }

  template <Out O, bool kStream>
  static void store(typename OutType<O>::T* dst, V x) {
    if constexpr (O == kF32) {
      if constexpr (kStream) {
        _mm256_stream_ps(dst, x);
      } else {
        _mm256_storeu_ps(dst, x);
      }
    } else {  // fp16 / bf16, never streamed
      const __m128i h = O == kF16
                            ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                            : to_bf16(x);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
    }
  }
};

template <Format F, Out O>
using Avx2Range = VecRange<Avx2Ops, F, O>;

constexpr Kernels kAvx2 = make_table<Avx2Range>("avx2");

}  // namespace

const Kernels* avx2_kernels() { return &kAvx2; }

}  // namespace zerocore::cpu::lowbit

#pragma GCC pop_options

#else  // not x86-64: no AVX2 kernels

namespace zerocore::cpu::lowbit {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace zerocore::cpu::lowbit

#endif
