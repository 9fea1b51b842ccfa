// The CPU fused Adam step, one implementation per instruction set (fused_adam_scalar.cpp,
// fused_adam_avx2.cpp, fused_adam_avx512.cpp), chosen at run time by fused_adam_cpu.cpp.
//
// This header and the per-ISA files include no ATen, c10 or standard-library header with inline
// functions: a file compiled for AVX-512 must not emit an out-of-line copy of an inline function
// that the linker could then pick for the AVX2 or scalar callers too (one definition rule), which
// would crash a CPU without AVX-512. They share plain C++ types only.
#pragma once

#include <cstdint>

namespace zerocore::cpu::adam {

// The scalars of one step (zerocore::AdamConsts, as the kernels use them).
struct Scalars {
  float inv_grad_scale;         // multiplies the gradient first
  float weight_decay;           // Adam's L2 term; 0 for AdamW
  float decay_factor;           // AdamW's decoupled decay 1 - lr * wd; 1 for Adam
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;          // -lr / (1 - beta1^step)
};

// Storage types of the gradient and the model copy; kNone: no model copy.
enum Dtype : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 3 };

// Steps elements [begin, end) of the flat shard. p, m, v: fp32 master, exp_avg, exp_avg_sq; g:
// the gradient in its Dtype; copy: the model copy in its Dtype, or null with kNone. With stream,
// the model copy is written with non-temporal stores, fenced before the function returns; the
// scalar kernels ignore the flag.
using RangeFn = void (*)(float* p, const void* g, float* m, float* v, void* copy, int64_t begin,
                         int64_t end, const Scalars& c, bool stream);

struct Kernels {
  const char* name;     // "scalar", "avx2", "avx512"
  RangeFn fn[3][4];     // [grad Dtype][copy Dtype]
};

// Each returns its table, or null where that ISA was not compiled in (a non-x86 build). Whether
// the CPU can run it is the caller's question (fused_adam_cpu.cpp asks cpuid).
const Kernels* scalar_kernels();
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();

// Bit patterns of IEEE fp16 and bfloat16 as the ISA files store them (uint16_t).
using Bits16 = uint16_t;

}  // namespace zerocore::cpu::adam
