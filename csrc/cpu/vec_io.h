// Loading and storing 2 x Vectorized<float> (16 elements with AVX2) from float, Half or BFloat16
// memory, so each CPU kernel is written once in float arithmetic for every dtype combination.
// All loads and stores are unaligned (loadu/storeu), so any offset into a buffer is correct.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace zerocore::cpu {

using Vec = at::vec::Vectorized<float>;
// Elements handled per vector iteration: two float vectors, i.e. one Vectorized<Half>.
constexpr int64_t kBlock = 2 * Vec::size();

template <typename T>
inline void load2(const T* src, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(src);
    b = Vec::loadu(src + Vec::size());
  } else {
    at::vec::load_to_float<T>(src, a, b);
  }
}

template <typename T>
inline void store2(T* dst, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(dst);
    b.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(dst);
  }
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

// Elements per task of at::parallel_for: large enough that thread start-up is amortised, small
// enough that two cores split a 2^24-element shard into many even pieces.
constexpr int64_t kGrain = 32768;

}  // namespace zerocore::cpu
