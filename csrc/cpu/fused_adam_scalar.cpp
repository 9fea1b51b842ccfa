// The portable CPU fused Adam: one element at a time, exact software conversions. The fallback
// where no vector ISA is available, and the reference the vector kernels are tested against
// (ZEROCORE_CPU_ISA=scalar, or zerocore.ops._cpu_adam_isa("scalar")).
#include "fused_adam_common.h"

namespace zerocore::cpu::adam {
namespace {

struct ScalarOps {
  using V = float;
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return __builtin_sqrtf(a); }  // IEEE, correctly rounded
};

template <class G, class M>
struct ScalarRange {
  static void run(float* p, const void* g_raw, float* m, float* v, void* copy_raw, int64_t begin,
                  int64_t end, const Scalars& s, bool /*stream*/) {
    const auto* g = static_cast<const typename G::T*>(g_raw);
    auto* copy = static_cast<typename M::T*>(copy_raw);
    const Consts<ScalarOps> c(s);
    for (int64_t i = begin; i < end; ++i) {
      float pv = p[i], mv = m[i], vv = v[i];
      adam_math<ScalarOps>(pv, load_scalar<G>(g + i), mv, vv, c);
      p[i] = pv;
      m[i] = mv;
      v[i] = vv;
      if constexpr (M::kDtype != kNone) store_scalar<M>(copy + i, pv);
    }
  }
};

constexpr Kernels kScalar = make_table<ScalarRange>("scalar");

}  // namespace

const Kernels* scalar_kernels() { return &kScalar; }

}  // namespace zerocore::cpu::adam
