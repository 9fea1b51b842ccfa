// What every ISA file of the CPU fused Adam shares: the update of one element (or one vector of
// elements) in a single operation order, and the exact scalar conversions between fp32 and the
// 16-bit storage types. Everything is in an unnamed namespace, so each ISA file compiles its own
// private copy for its own target (see fused_adam_isa.h for why nothing here may be shared).
#pragma once

#include <cstdint>

#include "fused_adam_isa.h"

namespace zerocore::cpu::adam {
namespace {

// Storage type tags: the C++ type in memory and the Dtype of the kernel table.
struct F32 { using T = float; static constexpr Dtype kDtype = kF32; };
struct F16 { using T = Bits16; static constexpr Dtype kDtype = kF16; };
struct BF16 { using T = Bits16; static constexpr Dtype kDtype = kBF16; };
struct NoCopy { using T = float; static constexpr Dtype kDtype = kNone; };

inline uint32_t bits_of(float x) { return __builtin_bit_cast(uint32_t, x); }
inline float float_of(uint32_t b) { return __builtin_bit_cast(float, b); }

// The step's scalars as values of V (a float or a SIMD vector): broadcast once per call and held
// in locals, not re-read through the Scalars reference, which the compiler must assume the stores
// to param may overwrite.
template <class Ops>
struct Consts {
  using V = typename Ops::V;
  V inv_grad_scale, weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2,
      bias_correction2_sqrt, eps, neg_step_size;
  explicit Consts(const Scalars& c)
      : inv_grad_scale(Ops::set1(c.inv_grad_scale)), weight_decay(Ops::set1(c.weight_decay)),
        decay_factor(Ops::set1(c.decay_factor)), one_minus_beta1(Ops::set1(c.one_minus_beta1)),
        beta2(Ops::set1(c.beta2)), one_minus_beta2(Ops::set1(c.one_minus_beta2)),
        bias_correction2_sqrt(Ops::set1(c.bias_correction2_sqrt)), eps(Ops::set1(c.eps)),
        neg_step_size(Ops::set1(c.neg_step_size)) {}
};

// The update, in the order of torch.optim.adam._single_tensor_adam and of adam_math in
// cuda/fused_adam_cuda.cu: every operation a separately rounded IEEE add, subtract, multiply,
// divide or square root (the files are compiled with -ffp-contract=off and Ops has no fused
// multiply-add), so every lane of every ISA computes the same bits as the CUDA kernel and the
// float32 replay in tests/test_ops.py. Nothing is skipped when a constant is 0 or 1: g + 0 * p
// is not g when g is -0 or p is infinite, and the point is the same bits everywhere.
template <class Ops>
__attribute__((always_inline)) inline void adam_math(typename Ops::V& p, typename Ops::V g,
                                                     typename Ops::V& m, typename Ops::V& v,
                                                     const Consts<Ops>& c) {
  g = Ops::mul(g, c.inv_grad_scale);
  g = Ops::add(g, Ops::mul(c.weight_decay, p));  // Adam's L2 term; weight_decay is 0 for AdamW
  p = Ops::mul(p, c.decay_factor);               // AdamW's decay; decay_factor is 1 for Adam
  m = Ops::add(m, Ops::mul(c.one_minus_beta1, Ops::sub(g, m)));
  v = Ops::add(Ops::mul(v, c.beta2), Ops::mul(c.one_minus_beta2, Ops::mul(g, g)));
  const typename Ops::V denom =
      Ops::add(Ops::div(Ops::sqrt(v), c.bias_correction2_sqrt), c.eps);
  p = Ops::add(p, Ops::mul(c.neg_step_size, Ops::div(m, denom)));
}

// Exact scalar conversions, written out in integer arithmetic so the scalar kernels need no
// F16C and round exactly as the vector instructions (vcvtps2ph with round-to-nearest-even) and
// as torch's .to(torch.float16 / torch.bfloat16).

inline float f16_to_float(Bits16 h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {  // inf, or a NaN, quieted as vcvtph2ps does
    return float_of(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
  }
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return float_of(sign | bits_of(mag));
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline Bits16 float_to_f16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) {  // NaN: quiet, the payload's top bits kept (as vcvtps2ph)
    return static_cast<Bits16>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) return static_cast<Bits16>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {  // a normal fp16 (>= 2^-14): drop 13 mantissa bits, to nearest even
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
    return static_cast<Bits16>(sign | ((rounded - 0x38000000u) >> 13));
  }
  // Below 2^-14: a multiple of 2^-24 (the fp16 subnormal spacing). Adding 0.5, whose float ulp is
  // 2^-24, rounds |f| to that multiple to nearest even in one IEEE addition; the low mantissa
  // bits of the sum are then the fp16 bits (1024, the carry into the exponent, is 2^-14 itself).
  const float sum = float_of(ax) + 0.5f;
  return static_cast<Bits16>(sign | (bits_of(sum) - 0x3f000000u));
}

inline float bf16_to_float(Bits16 b) { return float_of(static_cast<uint32_t>(b) << 16); }

// c10::BFloat16's rounding: to nearest even, and every NaN becomes 0x7fc0.
inline Bits16 float_to_bf16(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<Bits16>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

template <class D>
inline float load_scalar(const typename D::T* src) {
  if constexpr (D::kDtype == kF16) {
    return f16_to_float(*src);
  } else if constexpr (D::kDtype == kBF16) {
    return bf16_to_float(*src);
  } else {
    return *src;
  }
}

template <class D>
inline void store_scalar(typename D::T* dst, float x) {
  if constexpr (D::kDtype == kF16) {
    *dst = float_to_f16(x);
  } else if constexpr (D::kDtype == kBF16) {
    *dst = float_to_bf16(x);
  } else if constexpr (D::kDtype == kF32) {
    *dst = x;
  }
}

// Builds a Kernels table from a template Range<G, M> with a static run(...) of RangeFn's
// signature (taking typed pointers cast from void*).
template <template <class, class> class Range>
constexpr Kernels make_table(const char* name) {
  // Columns in Dtype order of the copy: kF32, kF16, kBF16, kNone.
  return Kernels{name,
                 {{&Range<F32, F32>::run, &Range<F32, F16>::run, &Range<F32, BF16>::run,
                   &Range<F32, NoCopy>::run},
                  {&Range<F16, F32>::run, &Range<F16, F16>::run, &Range<F16, BF16>::run,
                   &Range<F16, NoCopy>::run},
                  {&Range<BF16, F32>::run, &Range<BF16, F16>::run, &Range<BF16, BF16>::run,
                   &Range<BF16, NoCopy>::run}}};
}

}  // namespace
}  // namespace zerocore::cpu::adam
