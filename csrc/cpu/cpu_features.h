// Which vector instruction sets this CPU and its OS can run, asked once of cpuid and XCR0. Shared
// by the run-time choice of kernels of every CPU op that has one file per instruction set
// (fused_adam_cpu.cpp, lowbit_cpu.cpp).
#pragma once

namespace zerocore::cpu {

// AVX2 and F16C, with the ymm state saved by the OS (what *_avx2.cpp files are compiled for).
bool cpu_runs_avx2();
// AVX-512 F, BW, VL and DQ on top of cpu_runs_avx2, with the zmm and opmask state saved by the OS
// (what *_avx512.cpp files are compiled for).
bool cpu_runs_avx512();

}  // namespace zerocore::cpu
