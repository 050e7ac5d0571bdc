// The table of weight formats the linear kernel (qlinear.cpp) reads: ONE row per format. Every
// dispatch over formats in csrc (row sizes, dequantization, the 8-bit kernel, the GEMMs) and the
// Python format list (kernels/cpu_qlinear.py `FORMATS`, parsed from this file by
// kernels/build.py `quant_formats`) is generated from it, as ggml's `type_traits_cpu` table.
//
//   X(Name, code, block, bytes, head, kernel, gemm, ggml)
//
//   Name    the format's name: kFmt<Name> in C++; lower-cased, its Python name ("q4_k"). A DOT8
//           format's block routines are the struct <Name> of qlinear_blocks.h.
//   code    the number ops take (`fmt`); never reuse one.
//   block   values per block; a row holds K / block blocks (K % block == 0).
//   bytes   bytes per block.
//   head    bytes before a row's blocks (INT8: its fp32 scale), 0 for block formats.
//   kernel  DENSE: rows dequantized 16 at a time to bf16 / fp32 and multiplied with x as it is
//           (`dq_<Name>` in qlinear_impl.h); DOT8: x quantized to 8-bit blocks of 32 and integer
//           dot products with the blocks as stored (qlinear_q8.h, at every ISA level).
//   gemm    the blocked GEMM a DOT8 format takes from `gemm_rows` rows on (bf16 x):
//           NONE  the 8-bit kernel at every row count (batch-invariant);
//           Q8    the 8-bit GEMM on AVX2 (qlinear_q8_gemm.h), the bf16 one on AVX512-BF16
//                 (qlinear_bcast.h), AMX tiles on level 4, dequantized fp32 on AVX512F;
//           VNNI  as Q8, but the 8-bit GEMM of qlinear_vnni.h on AVX512-BF16.
//   ggml    the GGUF type name (gguf.GGMLQuantizationType) whose blocks these are, "" for none.
//
// Adding a format: a row here, its block struct in qlinear_blocks.h (`head`, `block` and the
// constants the kernels read, see there; a DENSE format: its row loop `dq_<Name>` there), and its
// tests. Nothing else changes.

#pragma once

#include <cstdint>

#define PS_QFORMATS(X)                                   \
  X(Bf16,  0,   1,   2, 0, DENSE, NONE, "")              \
  X(Q8_0,  1,  32,  34, 0, DOT8,  VNNI, "Q8_0")          \
  X(Q4_K,  2, 256, 144, 0, DOT8,  VNNI, "Q4_K")          \
  X(Q5_K,  3, 256, 176, 0, DOT8,  VNNI, "Q5_K")          \
  X(Q6_K,  4, 256, 210, 0, DOT8,  VNNI, "Q6_K")          \
  X(Int8,  5,   1,   1, 4, DENSE, NONE, "")              \
  X(Q5_0,  6,  32,  22, 0, DOT8,  VNNI, "Q5_0")          \
  X(Q4_0,  7,  32,  18, 0, DOT8,  VNNI, "Q4_0")          \
  X(Mxfp4, 8,  32,  17, 0, DOT8,  NONE, "MXFP4")         \
  X(Q4_1,  9,  32,  20, 0, DOT8,  VNNI, "Q4_1")          \
  X(Q4_Z, 10,  32,  21, 0, DOT8,  VNNI, "")              \
  X(Q8_F, 11,  32,  36, 0, DOT8,  VNNI, "")              \
  X(F8_E4M3, 12, 32, 36, 0, DENSE, NONE, "")

namespace ps_fmt {

enum Fmt : int64_t {
#define PS_FMT_ENUM(Name, code, block, bytes, head, kernel, gemm, ggml) kFmt##Name = code,
  PS_QFORMATS(PS_FMT_ENUM)
#undef PS_FMT_ENUM
};

enum class Kernel { DENSE, DOT8 };
enum class Gemm { NONE, Q8, VNNI };

// One format's row of the table.
struct FormatInfo {
  bool known;
  int64_t block, bytes, head;
  Kernel kernel;
  Gemm gemm;
};

inline constexpr FormatInfo format_info(int64_t fmt) {
  switch (fmt) {
#define PS_FMT_INFO(Name, code, block, bytes, head, kernel, gemm, ggml) \
  case code: return FormatInfo{true, block, bytes, head, Kernel::kernel, Gemm::gemm};
    PS_QFORMATS(PS_FMT_INFO)
#undef PS_FMT_INFO
  }
  return FormatInfo{false, 1, 0, 0, Kernel::DENSE, Gemm::NONE};
}

// Bytes of one row of K values in format fmt; -1 for an unknown format or a K that does not fit
// its blocks.
inline constexpr int64_t row_bytes(int64_t fmt, int64_t K) {
  const FormatInfo f = format_info(fmt);
  if (!f.known || K % f.block) return -1;
  return f.head + K / f.block * f.bytes;
}

// Whether fmt multiplies 8-bit x with its stored blocks (qlinear_q8.h).
inline constexpr bool dot8_format(int64_t fmt) { return format_info(fmt).kernel == Kernel::DOT8; }

// Whether a DOT8 format takes a blocked GEMM from gemm_rows rows on; and the VNNI one.
inline constexpr bool gemm_format(int64_t fmt) { return dot8_format(fmt) && format_info(fmt).gemm != Gemm::NONE; }
inline constexpr bool vnni_format(int64_t fmt) { return dot8_format(fmt) && format_info(fmt).gemm == Gemm::VNNI; }

}  // namespace ps_fmt

// `PS_QFORMATS(PS_FMT_CASE)` inside a switch over a format code: `case kFmt<Name>:
// PS_FMT_CALL_<kernel>(Name);` for every format, with PS_FMT_CALL_DENSE and PS_FMT_CALL_DOT8
// defined by the user (Name: a DOT8 format's block struct, a DENSE one's `dq_<Name>` loop).
// qlinear_blocks.h `visit_dot8` and qlinear_impl.h `dequant_row` are the users.
#define PS_FMT_CASE(Name, code, block, bytes, head, kernel, gemm, ggml) \
  case ::ps_fmt::kFmt##Name:                                            \
    PS_FMT_CALL_##kernel(Name);
