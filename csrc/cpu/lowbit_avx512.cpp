// The CPU dequantization of NF4 and fp8 for AVX-512 (F, BW, VL, DQ): 16 floats per vector.
// Compiled for that target whatever the build's flags, and run only where cpuid reports those
// extensions (lowbit_cpu.cpp). See lowbit_common.h for the loop.
#include "lowbit_isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
// As in fused_adam_avx512.cpp: everything below is internal to this file and compiled for it.
#include "lowbit_common.h"

namespace zerocore::cpu::lowbit {
namespace {

struct Avx512Ops {
  using V = __m512;
  static constexpr int64_t kLanes = 16;

  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }

  // 16 codes from 8 bytes: each byte twice (shuffle), widened to 32 bits, the low nibble of the
  // even lanes and the high nibble of the odd ones, looked up in the 16-entry table at once.
  static V nf4(const uint8_t* src) {
    const __m128i pairs = _mm_shuffle_epi8(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)),
        _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const __m512i code = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(pairs), shift), _mm512_set1_epi32(0xf));
    return _mm512_permutexvar_ps(code, _mm512_loadu_ps(kNf4Code));
  }

  // 16 codes from 16 bytes, lane by lane as fp8_value.
  static V fp8(const uint8_t* src) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i em = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const V normal = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    const V subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0x1p-9f));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    const V value = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(_mm512_mask_blend_ps(is_sub, normal, subnormal)), sign));
    const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f));
    return _mm512_mask_blend_ps(is_nan, value, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
  }

  static void fence() { _mm_sfence(); }

  // bf16 as float_to_bf16: to nearest even in integer arithmetic, NaN -> 0x7fc0; every lane
  // is <= 0xffff, so the truncating narrow keeps it whole.
  static __m256i to_bf16(V x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }

  template <Out O, bool kStream>
  static void store(typename OutType<O>::T* dst, V x) {
    if constexpr (O == kF32) {
      if constexpr (kStream) {
        _mm512_stream_ps(dst, x);
      } else {
        _mm512_storeu_ps(dst, x);
      }
    } else {  // fp16 / bf16, never streamed
      const __m256i h = O == kF16
                            ? _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                            : to_bf16(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    }
  }
};

template <Format F, Out O>
using Avx512Range = VecRange<Avx512Ops, F, O>;

constexpr Kernels kAvx512 = make_table<Avx512Range>("avx512");

}  // namespace

const Kernels* avx512_kernels() { return &kAvx512; }

}  // namespace zerocore::cpu::lowbit

#pragma GCC pop_options

#else  // not x86-64: no AVX-512 kernels

namespace zerocore::cpu::lowbit {
const Kernels* avx512_kernels() { return nullptr; }
}  // namespace zerocore::cpu::lowbit

#endif
