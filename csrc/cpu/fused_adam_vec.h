// The vector body of the CPU fused Adam, written once over an Ops class of one ISA
// (fused_adam_avx2.cpp, fused_adam_avx512.cpp). Ops provides: V (a float vector of kLanes),
// set1/add/sub/mul/div/sqrt (IEEE, each rounded once), load<D> (kLanes elements of storage type D
// widened to float, exactly), store (kLanes floats), store_copy<M, kStream> (2 * kLanes floats
// narrowed to M, to nearest even; with kStream, non-temporal stores to a kStreamAlign-aligned
// address) and fence (orders those stores before the ones after it).
//
// Each call streams once through memory in blocks of 2 * kLanes elements: 64 bytes of every fp32
// array with AVX2, 128 with AVX-512, every load and store a full vector, no branch per element.
// The elements that do not fill a block (a thread's head or tail, at most one block each) are
// copied to a zero-padded block on the stack and run through the same vector code, so they round
// exactly as the body: where a shard is split between threads never changes a bit.
#pragma once

#include "fused_adam_common.h"

namespace zerocore::cpu::adam {
namespace {

template <class Ops>
struct VecKernels {
  static constexpr int kLanes = Ops::kLanes;
  static constexpr int64_t kBlock = 2 * kLanes;

  template <class G, class M, bool kStream>
  __attribute__((always_inline)) static inline void block(float* p, const typename G::T* g,
                                                          float* m, float* v,
                                                          typename M::T* copy,
                                                          const Consts<Ops>& c) {
    using V = typename Ops::V;
    V p0 = Ops::template load<F32>(p), p1 = Ops::template load<F32>(p + kLanes);
    V m0 = Ops::template load<F32>(m), m1 = Ops::template load<F32>(m + kLanes);
    V v0 = Ops::template load<F32>(v), v1 = Ops::template load<F32>(v + kLanes);
    const V g0 = Ops::template load<G>(g), g1 = Ops::template load<G>(g + kLanes);
    adam_math<Ops>(p0, g0, m0, v0, c);
    adam_math<Ops>(p1, g1, m1, v1, c);
    Ops::store(p, p0);
    Ops::store(p + kLanes, p1);
    Ops::store(m, m0);
    Ops::store(m + kLanes, m1);
    Ops::store(v, v0);
    Ops::store(v + kLanes, v1);
    if constexpr (M::kDtype != kNone) Ops::template store_copy<M, kStream>(copy, p0, p1);
  }

  // n (<= kBlock) elements through one block on the stack.
  template <class G, class M>
  static void partial(float* p, const typename G::T* g, float* m, float* v, typename M::T* copy,
                      int64_t n, const Consts<Ops>& c) {
    alignas(64) float lp[kBlock] = {}, lm[kBlock] = {}, lv[kBlock] = {};
    alignas(64) typename G::T lg[kBlock] = {};
    alignas(64) typename M::T lc[kBlock] = {};
    for (int64_t j = 0; j < n; ++j) {
      lp[j] = p[j];
      lm[j] = m[j];
      lv[j] = v[j];
      lg[j] = g[j];
    }
    block<G, M, false>(lp, lg, lm, lv, lc, c);
    for (int64_t j = 0; j < n; ++j) {
      p[j] = lp[j];
      m[j] = lm[j];
      v[j] = lv[j];
      if constexpr (M::kDtype != kNone) copy[j] = lc[j];
    }
  }

  // copy + i, without forming an offset null pointer when there is no model copy.
  template <class M>
  static typename M::T* at(typename M::T* copy, int64_t i) {
    if constexpr (M::kDtype == kNone) {
      return nullptr;
    } else {
      return copy + i;
    }
  }

  template <class G, class M, bool kStream>
  static void blocks(float* p, const typename G::T* g, float* m, float* v, typename M::T* copy,
                     int64_t i, int64_t end, const Consts<Ops>& c) {
    for (; i + kBlock <= end; i += kBlock) {
      block<G, M, kStream>(p + i, g + i, m + i, v + i, at<M>(copy, i), c);
    }
    if (i < end) partial<G, M>(p + i, g + i, m + i, v + i, at<M>(copy, i), end - i, c);
  }

  template <class G, class M>
  struct Range {
    static void run(float* p, const void* g_raw, float* m, float* v, void* copy_raw,
                    int64_t begin, int64_t end, const Scalars& s, bool stream) {
      const auto* g = static_cast<const typename G::T*>(g_raw);
      auto* copy = static_cast<typename M::T*>(copy_raw);
      const Consts<Ops> c(s);
      if constexpr (M::kDtype != kNone) {
        // Streaming stores need kStreamAlign-aligned addresses: the elements before the copy's
        // first aligned one go through the stack block.
        const auto addr = reinterpret_cast<uintptr_t>(copy + begin);
        if (stream && addr % sizeof(typename M::T) == 0) {
          int64_t head = static_cast<int64_t>((Ops::kStreamAlign - addr % Ops::kStreamAlign) %
                                              Ops::kStreamAlign) /
                         static_cast<int64_t>(sizeof(typename M::T));
          if (head > end - begin) head = end - begin;
          if (head > 0) partial<G, M>(p + begin, g + begin, m + begin, v + begin, copy + begin,
                                      head, c);
          blocks<G, M, true>(p, g, m, v, copy, begin + head, end, c);
          // Streaming stores are weakly ordered: fenced here, by the code that issued them, so
          // the copy is complete for any thread that synchronises with this one afterwards.
          Ops::fence();
          return;
        }
      }
      blocks<G, M, false>(p, g, m, v, copy, begin, end, c);
    }
  };
};

}  // namespace
}  // namespace zerocore::cpu::adam
