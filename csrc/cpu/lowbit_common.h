// What every ISA file of the low-bit dequantization shares: the value of one code, the exact
// scalar conversion to the output dtype, the loop over vector steps and the table of kernels.
// Everything is in an unnamed namespace (as fused_adam_common.h, whose exact fp16 and bf16
// conversions it uses), so each ISA file compiles a private copy for its own target.
#pragma once

#include <cstdint>

#include "fused_adam_common.h"
#include "lowbit_isa.h"

namespace zerocore::cpu::lowbit {
namespace {

using adam::bits_of;
using adam::float_of;

// The float32 value of an e4m3fn code: 1 sign, 4 exponent (bias 7) and 3 mantissa bits. Every
// value is a float32, so this is exact. The NaN codes S.1111.111 give the positive quiet NaN.
inline float fp8_value(uint8_t v) {
  const uint32_t em = v & 0x7fu;  // exponent and mantissa
  if (em == 0x7fu) return float_of(0x7fc00000u);
  // A subnormal (exponent 0) is m * 2^-9; a normal one moves to float32's bias (7 -> 127) and
  // its 3 mantissa bits to the top of float32's 23. No float32 subnormal is formed, so a CPU
  // that flushes them (DAZ/FTZ) gives the same bits.
  const float mag = em < 8 ? static_cast<float>(em) * 0x1p-9f : float_of((em << 20) + (120u << 23));
  return float_of(bits_of(mag) | (static_cast<uint32_t>(v & 0x80u) << 24));
}

template <Format F>
inline float code_value(const uint8_t* q, int64_t i) {
  if constexpr (F == kNf4) {
    return kNf4Code[(q[i >> 1] >> ((i & 1) * 4)) & 0xfu];
  } else {
    return fp8_value(q[i]);
  }
}

// The C++ type of each output dtype in memory.
template <Out O> struct OutType { using T = uint16_t; };
template <> struct OutType<kF32> { using T = float; };

template <Out O>
inline void store_scalar(typename OutType<O>::T* dst, float x) {
  if constexpr (O == kF16) {
    *dst = adam::float_to_f16(x);
  } else if constexpr (O == kBF16) {
    *dst = adam::float_to_bf16(x);
  } else {
    *dst = x;
  }
}

// Elements [begin, end) one at a time: the scalar kernel, and every vector kernel's tail.
template <Format F, Out O>
inline void dequantize_scalar(typename OutType<O>::T* out, const uint8_t* q, const float* scales,
                              int64_t block, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    store_scalar<O>(out + i, code_value<F>(q, i) * scales[i / block]);  // fp32 product, no FMA
  }
}

// The vector loop over whole steps of kStep elements, each within one block, then the scalar
// tail. Ops: V, kLanes, set1, mul, nf4(bytes of kLanes codes), fp8(bytes of kLanes codes),
// store<O, kStream>(dst, V) to the output dtype rounding to nearest even as store_scalar does
// (kStream, fp32 only: a non-temporal store, dst aligned to its width) and fence().
template <class Ops, Format F, Out O>
struct VecRange {
  template <bool kStream>
  static void steps(typename OutType<O>::T* out, const uint8_t* q, const float* scales,
                    int64_t block, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += kStep) {
      const typename Ops::V s = Ops::set1(scales[i / block]);
      for (int64_t j = i; j < i + kStep; j += Ops::kLanes) {
        const typename Ops::V v = F == kNf4 ? Ops::nf4(q + j / 2) : Ops::fp8(q + j);
        Ops::template store<O, kStream>(out + j, Ops::mul(v, s));
      }
    }
  }

  static void run(void* out_raw, const uint8_t* q, const float* scales, int64_t block,
                  int64_t begin, int64_t end, bool stream) {
    auto* out = static_cast<typename OutType<O>::T*>(out_raw);
    const int64_t vec_end = begin + (end - begin) / kStep * kStep;
    bool streamed = false;
    if constexpr (O == kF32) {  // the only output streamed (lowbit_cpu.cpp says why)
      if (stream) {
        steps<true>(out, q, scales, block, begin, vec_end);
        Ops::fence();
        streamed = true;
      }
    }
    if (!streamed) steps<false>(out, q, scales, block, begin, vec_end);
    dequantize_scalar<F, O>(out, q, scales, block, vec_end, end);
  }
};

template <Format F, Out O>
struct ScalarRange {
  static void run(void* out, const uint8_t* q, const float* scales, int64_t block,
                  int64_t begin, int64_t end, bool /*stream*/) {
    dequantize_scalar<F, O>(static_cast<typename OutType<O>::T*>(out), q, scales, block, begin,
                            end);
  }
};

// A Kernels table from a template R<F, O>::run of RangeFn's signature.
template <template <Format, Out> class R>
constexpr Kernels make_table(const char* name) {
  return Kernels{name,
                 {{&R<kNf4, kF32>::run, &R<kNf4, kF16>::run, &R<kNf4, kBF16>::run},
                  {&R<kFp8, kF32>::run, &R<kFp8, kF16>::run, &R<kFp8, kBF16>::run}}};
}

}  // namespace
}  // namespace zerocore::cpu::lowbit
