// The CPU dequantization of the low-bit frozen-weight formats (NF4, fp8 e4m3fn; see
// zerocore/kernels/formats.py), one implementation per instruction set (lowbit_scalar.cpp,
// lowbit_avx2.cpp, lowbit_avx512.cpp), chosen at run time by lowbit_cpu.cpp.
//
// As fused_adam_isa.h: this header and the per-ISA files include no ATen, c10 or standard-library
// header with inline functions, so that no function compiled for AVX-512 can be picked by the
// linker for the AVX2 or scalar callers. They share plain C++ types and constants only.
#pragma once

#include <cstdint>

namespace zerocore::cpu::lowbit {

enum Format : int { kNf4 = 0, kFp8 = 1 };
// The output's dtype.
enum Out : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Elements per vector step of every ISA (16 bytes of NF4 codes, 32 of fp8). Blocks are whole
// steps (a multiple of kStep elements), so a step never spans two scales.
constexpr int64_t kStep = 32;

// QLoRA's NF4 values as float32 (zerocore.kernels.formats.NF4_CODE, written as hex floats so
// every bit is explicit).
constexpr float kNf4Code[16] = {
    -0x1p+0f,         -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f,
    -0x1.23449ap-2f,  -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f,
    0x1.45f5fep-4f,   0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c3497p-2f,    0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f};

// Dequantizes elements [begin, end) of out (float, or fp16 / bf16 bits as uint16_t): out[i] =
// value(code i) * scales[i / block], the fp32 product rounded once to out's dtype, to nearest
// even. q: the packed codes of the whole tensor (NF4: element i in byte i / 2, low nibble for an
// even i; fp8: byte i). begin is a multiple of kStep, block a multiple of kStep. With stream
// (an fp32 out, 64-byte aligned), the vector steps write with non-temporal stores, fenced
// before the function returns; the scalar kernels ignore the flag.
using RangeFn = void (*)(void* out, const uint8_t* q, const float* scales, int64_t block,
                         int64_t begin, int64_t end, bool stream);

struct Kernels {
  const char* name;  // "scalar", "avx2", "avx512"
  RangeFn fn[2][3];  // [Format][Out]
};

// Each returns its table, or null where that ISA was not compiled in (a non-x86 build).
const Kernels* scalar_kernels();
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();

}  // namespace zerocore::cpu::lowbit
