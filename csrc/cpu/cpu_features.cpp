// cpu_features.h on x86-64 (cpuid, XCR0); elsewhere no vector ISA is reported.
#include "cpu_features.h"

#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ZEROCORE_X86_DISPATCH 1
#include <cpuid.h>
#endif

namespace zerocore::cpu {

#if defined(ZEROCORE_X86_DISPATCH)
namespace {

// XCR0 bits of the register state the OS saves and restores on a context switch: SSE and the
// upper halves of the ymm registers for AVX; with AVX-512 also the opmask registers, the upper
// halves of zmm0-15 and zmm16-31. A CPU can report AVX-512 in cpuid while the OS (or a
// hypervisor) does not save that state; its instructions then fault, or their registers are lost.
constexpr uint64_t kXcr0Avx = 0x6;
constexpr uint64_t kXcr0Avx512 = 0xe6;

// Whether the OS has enabled XSAVE (cpuid.1:ECX.OSXSAVE) and saves every state in `mask`.
// Checked here as well as by __builtin_cpu_supports (whose runtime does check XCR0 in current
// GCC and clang) so the rule does not depend on the compiler's runtime library.
bool os_saves(uint64_t mask) {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & bit_OSXSAVE) == 0) return false;
  uint32_t lo = 0, hi = 0;
  // xgetbv written out: its intrinsic needs the xsave target, and this file is built without it.
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  return (xcr0 & mask) == mask;
}

}  // namespace

bool cpu_runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && os_saves(kXcr0Avx);
}

bool cpu_runs_avx512() {
  return cpu_runs_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && os_saves(kXcr0Avx512);
}
#else
bool cpu_runs_avx2() { return false; }
bool cpu_runs_avx512() { return false; }
#endif

}  // namespace zerocore::cpu
