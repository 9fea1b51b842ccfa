// The portable CPU dequantization of NF4 and fp8: one element at a time, exact software
// conversions. The fallback where no vector ISA is available, and the path the vector kernels are
// tested against (ZEROCORE_CPU_ISA=scalar, or zerocore.ops._cpu_lowbit_isa("scalar")).
#include "lowbit_common.h"

namespace zerocore::cpu::lowbit {
namespace {

constexpr Kernels kScalar = make_table<ScalarRange>("scalar");

}  // namespace

const Kernels* scalar_kernels() { return &kScalar; }

}  // namespace zerocore::cpu::lowbit
