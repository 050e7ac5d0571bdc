// Which ISA level this CPU (and OS) runs, for the kernels of the pagedserve_cpu extension
// (kernels.cpu_isa names the levels), and the check each op makes of the level its caller asks
// for. Included by the extension's sources; plain x86-64 code (no target attributes).

#pragma once

#include <c10/util/Exception.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace ps_isa {

// NOTE: ISA code has one naming scheme in every extension: a namespace `isa_<level>` named by the
// lowest level above that runs it (isa_avx2, isa_avx512, isa_avx512bf16, isa_amx), inside the
// file's anonymous namespace and its own `#pragma GCC target` region. Internal linkage is what
// keeps two files that build the same header for the same level (vec16_build.h, qlinear_impl.h)
// from clashing at link time: without it the linker may keep one file's copy of an inline function
// for both, compiled for another level or another kernel header (an ODR violation, silent).
enum Isa : int64_t { kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Bf16 = 3, kIsaAmx = 4 };

inline uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// The highest level this CPU (and OS) runs.
inline int64_t detect_isa() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kIsaNone;
  const bool fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, f16c = (c >> 29) & 1;
  if (!osxsave) return kIsaNone;
  const uint64_t x = xcr0();
  if ((x & 0x6) != 0x6) return kIsaNone;  // SSE + AVX state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return kIsaNone;
  const unsigned max_sub = a;
  const bool avx2 = (b >> 5) & 1;
  if (!(avx2 && fma && f16c)) return kIsaNone;
  const bool f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  if (!(f && dq && bw && vl && (x & 0xE0) == 0xE0)) return kIsaAvx2;
  unsigned a1 = 0, b1, c1, d1;
  if (max_sub >= 1) __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  // the AVX512-BF16 level's 8-bit GEMM needs AVX512-VNNI (every CPU with AVX512-BF16 has it)
  const bool vnni = (c >> 11) & 1;
  if (!((a1 >> 5) & 1) || !vnni) return kIsaAvx512;
  if (amx_bf16 && amx_tile && ((x >> 17) & 3) == 3) {
#ifdef __linux__
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) return kIsaAmx;
#endif
  }
  return kIsaAvx512Bf16;
}

inline int64_t cpu_isa() {
  static const int64_t isa = detect_isa();
  return isa;
}

inline int64_t check_isa(const char* op, int64_t isa) {
  TORCH_CHECK(isa >= kIsaAvx2 && isa <= kIsaAmx, op, ": isa must be 1..4, got ", isa);
  TORCH_CHECK(isa <= cpu_isa(), op, ": ISA level ", isa, " is above this CPU's (", cpu_isa(), ")");
  return isa;
}

// Whether a row kernel of vec16_build.h runs its isa_avx512bf16 build at `isa` (else isa_avx2).
inline bool use_avx512(int64_t isa) { return isa >= kIsaAvx512Bf16; }

}  // namespace ps_isa
