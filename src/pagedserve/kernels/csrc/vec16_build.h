// Compiles the row kernel header named by PS_VEC_KERNEL (written on csrc/vec16.h's V16) twice, as
// `isa_avx2::` (AVX2 + FMA + F16C, V16 = two 8-lane registers) and `isa_avx512bf16::`
// (AVX512F/BW/VL/DQ + AVX512-BF16, V16 = one register). The host code picks one per call with
// `use_avx512(isa)`. Both sit in the including file's anonymous namespace (see cpu_isa.h's NOTE
// on ISA namespaces).
//
//   #define PS_VEC_KERNEL "rms_norm_impl.h"
//   #include "vec16_build.h"
//
// NOTE: the target pragmas cover only these namespaces, never a whole file: the registration and
// static initialisation code must stay plain x86-64, or it could fault on older CPUs.

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace isa_avx2 {
#define PS_VEC 256
#include "vec16.h"
#include PS_VEC_KERNEL
#undef PS_VEC
}  // namespace isa_avx2
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace {
namespace isa_avx512bf16 {
#define PS_VEC 512
#include "vec16.h"
#include PS_VEC_KERNEL
#undef PS_VEC
}  // namespace isa_avx512bf16
}  // namespace
#pragma GCC pop_options

#undef PS_VEC_KERNEL
