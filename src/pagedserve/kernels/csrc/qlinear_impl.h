// One ISA's instance of the weight-format-generic linear kernel (csrc/qlinear.cpp includes this
// file once per ISA, inside `namespace isa_<name>` and between `#pragma GCC push_options /
// target(...)`, with PS_ISA set to that ISA's level). Nothing here may be used outside its ISA.
//
//   y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias),  fp32 accumulation,
//
// for bf16 and INT8 weights (the ggml formats go to qlinear_q8.h; their format loops here serve
// embedding lookups, `rows_f32`). W is walked in blocks of 16 rows: each block is dequantized once (to bf16 on the AMX and
// AVX512-BF16 levels, to fp32 on AVX512F and AVX2) into a thread's buffer -- bf16 weights on the
// bf16 levels are read in place -- and multiplied by every row of x from there.
//
// NOTE: batch invariance. Every output element y[m, n] is computed by the same instruction
// sequence whatever M is and wherever row m sits in its tile: one accumulator per (m, n) walks K
// in the same steps, then one fixed horizontal reduction (or, with AMX, one C-tile element that
// only ever sees row m of x and row n of W), then + bias and one rounding. A request's results
// therefore do not depend on the batch it runs in. Keep it so: no M-dependent paths.

#ifndef PS_ISA
#error "include from qlinear.cpp with PS_ISA defined"
#endif

#if PS_ISA >= 3  // kIsaAvx512Bf16
using WT = uint16_t;  // dequantized weights: bf16
#else
using WT = float;
#endif

// NOTE: these small helpers live here, compiled for this ISA, so that they inline into its
// code: a call from AVX code into generic (SSE) code costs an AVX-SSE state transition, which
// made the first version 30x slower.
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16, round to nearest even (as vcvtneps2bf16 and c10::BFloat16 for non-NaN values).
inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE half -> float (block scales).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: man * 2^-24
      const float f = float(man) * 5.9604644775390625e-8f;
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7F800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// y[m, n] = v + bias[n], rounded once to y's dtype.
inline void put_out(const Out& o, int64_t m, int64_t n, float v) {
  if (o.bias) v += o.bias[n];
  if (o.fp32) {
    static_cast<float*>(o.y)[m * o.ldy + (n - o.n0)] = v;
  } else {
    static_cast<uint16_t*>(o.y)[m * o.ldy + (n - o.n0)] = bf16_round(v);
  }
}

// Results of M rows for Stage::kCols columns at a time, staged in a thread's buffer and copied
// out a row at a time (`out` is where tiles put them; `flush_and_move(n)` copies columns
// [out.n0, n) to the result and starts the next stage at n).
// NOTE: why: y's rows are N elements apart, and when that is a multiple of 4 KiB (the
// 262,144-column LM head) the 16 columns of every row a block writes share one cache set:
// written in place they evicted each other (a product 3-5x slower at N = 16,384, M = 64 than at
// N = 4,096). Staging moves no arithmetic: the same values land in y.
// `allow_direct` (kernels that write whole 64-byte lines of a row at a time, the AMX epilogue):
// where 16 consecutive rows of y fall in at least 2 distinct L1 sets (8 rows a set, of 12 ways), the tiles write y in
// place (`direct`: `out` is y, flush_and_move does nothing): the copy cost ~10% of a prefill.
struct Stage {
  static constexpr int64_t kCols = 128;  // a multiple of the 16-column blocks
  const Out& dst;
  int64_t M;
  bool direct;
  std::unique_ptr<uint8_t[]> buf;  // uninitialized: a column is stored before it is flushed
  Out out;
  static bool rows_spread(const Out& o) {  // 16 rows of y over >= 2 of 64 L1 sets (4 KiB apart)
    const int64_t lines = o.ldy * (o.fp32 ? 4 : 2) / 64;
    bool seen[64] = {false};
    int distinct = 0;
    for (int64_t m = 0; m < 16; ++m) {
      const int64_t set = (m * lines) % 64;
      if (!seen[set]) seen[set] = true, ++distinct;
    }
    return (o.ldy * (o.fp32 ? 4 : 2)) % 64 == 0 && distinct >= 2;
  }
  Stage(const Out& result, int64_t rows, int64_t n0, bool allow_direct = false)
      : dst(result), M(rows), direct(allow_direct && rows_spread(result)),
        buf(direct ? nullptr : new uint8_t[size_t(rows * kCols) * (result.fp32 ? 4 : 2)]),
        out(direct ? result : Out{buf.get(), kCols, result.fp32, result.bias, n0}) {}
  void flush_and_move(int64_t n) {
    if (direct) return;
    const size_t esize = out.fp32 ? 4 : 2, bytes = size_t(n - out.n0) * esize;
    uint8_t* d = static_cast<uint8_t*>(dst.y) + size_t(out.n0 - dst.n0) * esize;
    const uint8_t* s = buf.get();
    const size_t ld = size_t(dst.ldy) * esize, ls = size_t(kCols) * esize;
    if (bytes % 64 == 0) {  // whole lines (the usual case): inline vector moves, no call per row
      for (int64_t m = 0; m < M; ++m, d += ld, s += ls)
        for (size_t b = 0; b < bytes; b += 64) __builtin_memcpy(d + b, s + b, 64);
    } else {
      for (int64_t m = 0; m < M; ++m, d += ld, s += ls) std::memcpy(d, s, bytes);
    }
    out.n0 = n;
  }
};

// ---------------------------------------------------------------------------------------------
// Dequantization of one row (K values) into dst. Plain loops over a block: auto-vectorized for
// this ISA. Block layouts follow ggml (ggml-common.h).
// ---------------------------------------------------------------------------------------------

inline void put(float* dst, int64_t i, float v) { dst[i] = v; }
inline void put(uint16_t* dst, int64_t i, float v) { dst[i] = bf16_round(v); }

#if PS_ISA == 1  // the format loops: built once, for AVX2 (see dequant_to)
#include "qlinear_blocks.h"

template <typename T>
void dq_Int8(const uint8_t* row, int64_t K, T* dst) {
  float s;
  std::memcpy(&s, row, 4);
  const int8_t* q = reinterpret_cast<const int8_t*>(row + 4);
  for (int64_t k = 0; k < K; ++k) put(dst, k, s * float(q[k]));
}

template <typename T>
void dq_Bf16(const uint8_t* row, int64_t K, T* dst) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
  for (int64_t k = 0; k < K; ++k) put(dst, k, bf16_to_float(w[k]));
}

// One row of format fmt (every row of the table: qformats.h) -> dst.
template <typename T>
void dequant_row(int64_t fmt, const uint8_t* row, int64_t K, T* dst) {
#define PS_FMT_CALL_DENSE(Name) return dq_##Name(row, K, dst)
#define PS_FMT_CALL_DOT8(Name) return dq_blocks<Name>(row, K, dst)
  switch (fmt) { PS_QFORMATS(PS_FMT_CASE) }
#undef PS_FMT_CALL_DOT8
#undef PS_FMT_CALL_DENSE
}

#endif

#if PS_ISA >= 3  // kIsaAvx512Bf16
// One row of DOT8 blocks straight to bf16, 32 values at a time, with the block routines of
// qlinear_blocks.h (AVX2, inlined here): the same fp32 operations as its `dq_blocks` (d * q;
// d * sc * q - dmin * mn; Q4_1's d * q - (-m); (d * sc) * q), then vcvtne2ps2bf16.
template <class F>
inline void dequant_blocks_bf16(const uint8_t* row, int64_t K, uint16_t* dst) {
  for (int64_t u = 0; u < K / F::kUnit; ++u) {
    const uint8_t* wu = row + u * F::kBytes;
    const typename F::Head h = F::head(wu);
    alignas(32) float mins[8];
    if constexpr (F::kMins) _mm256_store_ps(mins, h.mins);
    for (int t = 0; t < F::kBlocks; ++t) {
      float d;
      __m256i mul = _mm256_setzero_si256();
      const __m256i q = F::block(h, wu, t, &d, &mul);
      __m512i lo, hi;
      if constexpr (F::kUnsigned) {
        lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q));
        hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1));
      } else {
        lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
        hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
      }
      if constexpr (F::kOffset != 0) {
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(F::kOffset));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(F::kOffset));
      }
      __m512 dlo = _mm512_set1_ps(d), dhi = dlo;
      if constexpr (F::kMul16) {  // Q6_K: an int16 multiplier per 16 values, times d first
        dlo = _mm512_set1_ps(d * float(int16_t(_mm256_extract_epi16(mul, 0))));
        dhi = _mm512_set1_ps(d * float(int16_t(_mm256_extract_epi16(mul, 8))));
      }
      __m512 flo = _mm512_mul_ps(dlo, _mm512_cvtepi32_ps(lo));
      __m512 fhi = _mm512_mul_ps(dhi, _mm512_cvtepi32_ps(hi));
      if constexpr (F::kMins) {
        flo = _mm512_sub_ps(flo, _mm512_set1_ps(mins[t]));
        fhi = _mm512_sub_ps(fhi, _mm512_set1_ps(mins[t]));
      }
      _mm512_storeu_si512(dst + u * F::kUnit + t * 32, (__m512i)_mm512_cvtne2ps_pbh(fhi, flo));
    }
  }
}

// Whether fmt is a DOT8 format (dequant_blocks_bf16 takes it); if so, row to dst.
inline bool dequant_ggml_bf16(int64_t fmt, const uint8_t* row, int64_t K, uint16_t* dst) {
  return ::isa_avx2::visit_dot8(fmt, [&](auto f) { dequant_blocks_bf16<typename decltype(f)::type>(row, K, dst); });
}
#endif

// One row of weights into the kernel's weight type, with the AVX2 build of the format loops. On
// the bf16 levels ggml blocks go straight to bf16 (dequant_ggml_bf16); other rows go to fp32 in
// `tmp` (K floats), then are rounded 32 values at a time (vcvtne2ps2bf16: round to nearest even,
// as bf16_round).
inline void dequant_to(int64_t fmt, const uint8_t* row, int64_t K, WT* dst, float* tmp) {
#if PS_ISA >= 3  // kIsaAvx512Bf16
  if (dequant_ggml_bf16(fmt, row, K, dst)) return;
  ::isa_avx2::dequant_row<float>(fmt, row, K, tmp);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(tmp + k + 16),
                                                               _mm512_loadu_ps(tmp + k)));
  for (; k < K; ++k) dst[k] = bf16_round(tmp[k]);
#elif PS_ISA == 2  // kIsaAvx512
  (void)tmp;
  ::isa_avx2::dequant_row<float>(fmt, row, K, dst);
#else
  (void)tmp;
  dequant_row<float>(fmt, row, K, dst);
#endif
}

// dequant_to for a row of W walked in order (W's rows are contiguous, row_bytes apart), with the
// lines kPrefetchAhead bytes further on asked for first. NOTE: why: the GEMMs' dequantizing loops
// stream W from memory (the LM head, 178 MB a step) and, left to the hardware prefetchers,
// stalled on the row's first load and on the stores behind it: a 16-row Gemma 3 decode step
// ~47 -> ~37 ms on AMX (2.5 KiB ahead was best of 1-6 KiB). Past W's end the addresses leave it:
// prefetches never fault.
constexpr int64_t kPrefetchAhead = 2560;
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes) {
  const char* ahead = reinterpret_cast<const char*>(row) + kPrefetchAhead;
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
}
inline void dequant_ahead(int64_t fmt, const uint8_t* row, int64_t row_bytes, int64_t K, WT* dst, float* tmp) {
  prefetch_ahead(row, row_bytes);
  dequant_to(fmt, row, K, dst, tmp);
}

// ---------------------------------------------------------------------------------------------
// Dot-product tiles: rows x[0..MB) (stride K) times rows w[0..NB) (stride ldw) over all K.
// ---------------------------------------------------------------------------------------------

#if PS_ISA >= 3  // kIsaAvx512Bf16
using XT = uint16_t;  // x as bf16
constexpr int64_t kStep = 32;
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline Acc acc_step(Acc a, const XT* x, const WT* w) {
  return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}
inline Acc acc_tail(Acc a, const XT* x, const WT* w, int64_t n) {
  const __mmask32 m = (__mmask32)((1ull << n) - 1);
  return _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, x),
                          (__m512bh)_mm512_maskz_loadu_epi16(m, w));
}
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
#elif PS_ISA == 2  // kIsaAvx512
using XT = float;
constexpr int64_t kStep = 16;
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline Acc acc_step(Acc a, const XT* x, const WT* w) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), a);
}
inline Acc acc_tail(Acc a, const XT* x, const WT* w, int64_t n) {
  const __mmask16 m = (__mmask16)((1u << n) - 1);
  return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x), _mm512_maskz_loadu_ps(m, w), a);
}
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
#else
using XT = float;
constexpr int64_t kStep = 8;
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline Acc acc_step(Acc a, const XT* x, const WT* w) {
  return _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(w), a);
}
inline Acc acc_tail(Acc a, const XT* x, const WT* w, int64_t n) {
  alignas(32) static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones + 8 - n));
  return _mm256_fmadd_ps(_mm256_maskload_ps(x, m), _mm256_maskload_ps(w, m), a);
}
inline float acc_sum(Acc a) {  // fixed tree: halves, then quarters, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// acc[i * NB + j] = x row i . w row j over all K (the tile's MB x NB accumulators).
template <int MB, int NB>
__attribute__((always_inline)) inline void dot_acc(const XT* __restrict x, int64_t K,
                                                   const WT* __restrict w, int64_t ldw, Acc* acc) {
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) acc[t] = acc_zero();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep)
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = acc_step(acc[i * NB + j], x + i * K + k, w + j * ldw + k);
  if (k < K)
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[i * NB + j] = acc_tail(acc[i * NB + j], x + i * K + k, w + j * ldw + k, K - k);
}

template <int MB, int NB>
__attribute__((always_inline)) inline void dot_tile(const XT* __restrict x, int64_t K,
                                                    const WT* __restrict w, int64_t ldw, float* res) {
  Acc acc[MB * NB];
  dot_acc<MB, NB>(x, K, w, ldw, acc);
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) res[t] = acc_sum(acc[t]);
}

#if PS_ISA >= 3  // kIsaAvx512Bf16
// The sums of a0..a3 (16 lanes each) as one vector, by one fixed tree: halves of pairs, quarters
// of the four, then within each quarter. ~13 instructions for the four, ~32 as four
// _mm512_reduce_add_ps.
inline __m128 acc_sum4(Acc a0, Acc a1, Acc a2, Acc a3) {
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xDD));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w));
}

// y[m, n .. n + 3] = v + bias, rounded once to y's dtype (vcvtneps2bf16: as bf16_round).
inline void put_out4(const Out& o, int64_t m, int64_t n, __m128 v) {
  if (o.bias) v = _mm_add_ps(v, _mm_loadu_ps(o.bias + n));
  const int64_t at = m * o.ldy + (n - o.n0);
  if (o.fp32) {
    _mm_storeu_ps(static_cast<float*>(o.y) + at, v);
  } else {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(o.y) + at), (__m128i)_mm_cvtneps_pbh(v));
  }
}
#endif

template <int MB>
inline void dot_rows(const XT* x, int64_t K, const WT* w, int64_t ldw, int64_t nr, const Out& out,
                     int64_t m0, int64_t n0) {
  float res[MB * 4];
  int64_t j = 0;
  for (; j + 4 <= nr; j += 4) {
#if PS_ISA >= 3  // kIsaAvx512Bf16: four columns reduced and stored together
    Acc acc[MB * 4];
    dot_acc<MB, 4>(x, K, w + j * ldw, ldw, acc);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i)
      put_out4(out, m0 + i, n0 + j, acc_sum4(acc[i * 4], acc[i * 4 + 1], acc[i * 4 + 2], acc[i * 4 + 3]));
#else
    dot_tile<MB, 4>(x, K, w + j * ldw, ldw, res);
    for (int i = 0; i < MB; ++i)
      for (int jj = 0; jj < 4; ++jj) put_out(out, m0 + i, n0 + j + jj, res[i * 4 + jj]);
#endif
  }
  for (; j < nr; ++j) {
    dot_tile<MB, 1>(x, K, w + j * ldw, ldw, res);
    for (int i = 0; i < MB; ++i) put_out(out, m0 + i, n0 + j, res[i]);
  }
}

// All M rows of x times the nr (<= 16) rows of one dequantized block.
inline void dot_block(const XT* x, int64_t M, int64_t K, const WT* w, int64_t ldw, int64_t nr,
                      const Out& out, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_rows<4>(x + m * K, K, w, ldw, nr, out, m, n0);
  switch (M - m) {
    case 3: dot_rows<3>(x + m * K, K, w, ldw, nr, out, m, n0); break;
    case 2: dot_rows<2>(x + m * K, K, w, ldw, nr, out, m, n0); break;
    case 1: dot_rows<1>(x + m * K, K, w, ldw, nr, out, m, n0); break;
  }
}

#if PS_ISA >= 3  // kIsaAvx512Bf16
#include "qlinear_bcast.h"
#endif
#if PS_ISA == 3  // kIsaAvx512Bf16 (with VNNI)
#include "qlinear_vnni.h"
#endif

#if PS_ISA >= 4  // kIsaAmx
// AMX: C (16 rows of W x 16 rows of x, fp32) += A (16 rows of W x 32 k, bf16) . B (x packed: 16
// k-pairs x 16 rows x 2). Two blocks of W (A tiles 4, 5) times two row groups of x (B tiles 6,
// 7) into four C tiles (0-3): each tile load feeds two products, and four independent
// accumulators keep the tile unit busy (one C tile's products wait on each other).
// NOTE: a C element walks K in chunks of 32, in order, from zero, whichever tiles run beside it:
// the same bits for any M, any blocking and any row of the batch.
#include "amx_tiles.h"

// C tiles 0-3 over K: TW / TX say whether the second W block / the second x group is there.
template <bool TW, bool TX>
inline void amx_kloop(const uint16_t* w0, const uint16_t* w1, int64_t ldw, const uint16_t* b0,
                      const uint16_t* b1, int64_t KC) {
  for (int64_t kc = 0; kc < KC; ++kc) {
    _tile_loadd(4, w0 + kc * 32, ldw * 2);
    _tile_loadd(6, b0 + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TX) {
      _tile_loadd(7, b1 + kc * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TW) {
      _tile_loadd(5, w1 + kc * 32, ldw * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (TX) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// A stored C tile (row i: column n0 + i over the 16 rows of group mb) into y's rows.
inline void amx_put(const float* c, const Out& out, int64_t M, int64_t mb, int64_t n0, int64_t nr) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * 16);
  bcast_store(out, M, mb, r, n0, nr);  // transposed, a vector store per row of x
}

// Row groups [mb0, mb1) of packed x times one or two dequantized W blocks: w0 (columns n0 ..,
// nr0 rows) and w1 (columns n0 + 16 .., nr1 rows; nullptr: none). Rows past nr are zeros.
inline void amx_pair(const uint16_t* xpk, int64_t M, int64_t K, int64_t mb0, int64_t mb1,
                     const uint16_t* w0, const uint16_t* w1, int64_t ldw, int64_t nr0, int64_t nr1,
                     const Out& out, int64_t n0) {
  const int64_t KC = K / 32;
  alignas(64) float c[4][256];
  const bool tw = w1 != nullptr;
  for (int64_t mb = mb0; mb < mb1; mb += 2) {
    const bool tx = mb + 1 < mb1;
    const uint16_t* b0 = xpk + mb * KC * 512;
    const uint16_t* b1 = b0 + KC * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (tw && tx) amx_kloop<true, true>(w0, w1, ldw, b0, b1, KC);
    else if (tw) amx_kloop<true, false>(w0, w1, ldw, b0, b1, KC);
    else if (tx) amx_kloop<false, true>(w0, w1, ldw, b0, b1, KC);
    else amx_kloop<false, false>(w0, w1, ldw, b0, b1, KC);
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    amx_put(c[0], out, M, mb, n0, nr0);
    if (tx) amx_put(c[1], out, M, mb + 1, n0, nr0);
    if (tw) amx_put(c[2], out, M, mb, n0 + 16, nr1);
    if (tw && tx) amx_put(c[3], out, M, mb + 1, n0 + 16, nr1);
  }
}

// Output columns [nb, ne) (whole 16-row blocks of W, format fmt) of the product with x packed
// for the B tiles. Blocked for the caches as bcast_range is: kBlocks weight blocks dequantized
// at once (their bf16 rows stay in L2: 4 to 8 blocks, as many as ~1 MiB holds), multiplied by
// slabs of kSlab row groups of x (a slab stays in L2 across the blocks); all of x is read once
// per kBlocks blocks. bf16 weights are read in place (a partial block is copied).
// NOTE: the blocks are all dequantized before the first product: AMX tile loads of lines just
// written stall on the store buffer, and the first pair's rows were written kBlocks blocks ago.
inline void amx_range(int64_t fmt, const uint16_t* xpk, int64_t M, int64_t K, const uint8_t* w,
                      int64_t row_bytes, int64_t N, const Out& out, int64_t nb, int64_t ne) {
  constexpr int64_t kSlab = 4;
  (void)N;
  const bool bf16_w = fmt == kFmtBf16;
  const int64_t MBk = (M + 15) / 16;
  const int64_t ldb = K + 32;  // see the NOTE on ldw in run_range
  const int64_t kBlocks = std::min<int64_t>(8, std::max<int64_t>(4, (int64_t(1) << 20) / (16 * ldb * 2)));
  // uninitialized: the rows a tile reads are written (dequantized, or zeros past N) before use
  std::unique_ptr<uint16_t[]> buf(new uint16_t[size_t(kBlocks * 16 * ldb + 32)]);
  std::vector<float> tmp(static_cast<size_t>(K));
  uint16_t* wb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.get()) + 63) & ~uintptr_t(63));
  amx_config();
  Stage st(out, M, nb, /*allow_direct=*/true);
  for (int64_t g0 = nb; g0 < ne; g0 += kBlocks * 16) {
    const int64_t g1 = std::min(ne, g0 + kBlocks * 16);
    // NOTE: the stage must hold the whole group: kBlocks (4-8) blocks of 16 columns need not
    // divide its kCols (K = 4096: 7 blocks, 112 columns; a group that ran past it overflowed).
    if (g1 - st.out.n0 > Stage::kCols) st.flush_and_move(g0);
    const int64_t filled = g1 - g0, padded = (filled + 15) / 16 * 16;
    const uint16_t* blk = wb;
    int64_t ldw = ldb;
    if (bf16_w && filled == padded) {
      blk = reinterpret_cast<const uint16_t*>(w + g0 * row_bytes);
      ldw = K;
    } else {
      for (int64_t n = g0; n < g1; ++n) dequant_ahead(fmt, w + n * row_bytes, row_bytes, K, wb + (n - g0) * ldb, tmp.data());
      if (filled < padded) std::memset(wb + filled * ldb, 0, size_t((padded - filled) * ldb) * 2);
    }
    for (int64_t s0 = 0; s0 < MBk; s0 += kSlab)
      for (int64_t n0 = g0; n0 < g1; n0 += 32) {
        const bool two = n0 + 16 < g1;
        amx_pair(xpk, M, K, s0, std::min(MBk, s0 + kSlab), blk + (n0 - g0) * ldw,
                 two ? blk + (n0 + 16 - g0) * ldw : nullptr, ldw, std::min<int64_t>(16, g1 - n0),
                 two ? std::min<int64_t>(16, g1 - n0 - 16) : 0, st.out, n0);
      }
  }
  if (nb < ne) st.flush_and_move(ne);
  _tile_release();
}
#endif

// The per-call state of a product: x packed as bf16 pairs (pack_x_pairs) for AMX tiles, or on
// the AVX512-BF16 level for `bcast_block` when asked (`pack`: the ggml formats' GEMM); nothing
// on other levels.
struct RunPrep {
  std::unique_ptr<uint16_t[]> packed;  // uninitialized: pack_x_pairs writes every element
  const uint16_t* xpk = nullptr;
};

inline void run_prepare(const XT* x, int64_t M, int64_t K, RunPrep& prep, bool pack) {
#if PS_ISA >= 3  // kIsaAvx512Bf16
  if (K % 32 == 0 && pack) {
    prep.packed.reset(new uint16_t[size_t(((M + 15) / 16) * (K / 32) * 512 + 32)]);
    uint16_t* xpk = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(prep.packed.get()) + 63) & ~uintptr_t(63));
    pack_x_pairs(x, M, K, xpk);
    prep.xpk = xpk;
  }
#else
  (void)x, (void)M, (void)K, (void)prep, (void)pack;
#endif
}

// Output columns [nb, ne) (whole 16-row blocks of W) of the product. x: [M, K] bf16 (bf16
// levels) or fp32; w: rows of row_bytes bytes; prep from run_prepare.
inline void run_range(int64_t fmt, const XT* x, int64_t M, int64_t K, const uint8_t* w,
                      int64_t row_bytes, int64_t N, const Out& out, const RunPrep& prep,
                      int64_t nb, int64_t ne) {
#if PS_ISA == 3  // kIsaAvx512Bf16: x packed for the ggml formats' GEMM
  if (prep.xpk) return bcast_range(fmt, prep.xpk, M, K, w, row_bytes, N, out, nb, ne);
#endif
#if PS_ISA >= 4  // kIsaAmx: x packed for the B tiles
  if (prep.xpk) return amx_range(fmt, prep.xpk, M, K, w, row_bytes, N, out, nb, ne);
#endif
  // bf16 weights on the bf16 levels are used in place (no buffer)
  const bool in_place = fmt == kFmtBf16 && sizeof(WT) == 2;
  // Two buffers: block i + 1 is dequantized before block i is multiplied, so the products
  // read stores that have left the store buffer. A partial block's missing rows are zeros.
  // NOTE: the buffer's rows are 64 bytes longer than K values: at K = 2048 bf16 (4 KiB) rows
  // of 16 columns read side by side (bcast_block reads one pair of each per step) otherwise
  // share one L1 set and evict each other (half the speed).
  const int64_t ldw = in_place ? K : K + 64 / int64_t(sizeof(WT));
  std::vector<WT> buf(in_place ? 0 : size_t(2 * 16 * ldw + 64));
  std::vector<float> tmp(sizeof(WT) == 2 && !in_place ? size_t(K) : 0);
  WT* wb[2] = {nullptr, nullptr};
  if (!in_place) {
    wb[0] = reinterpret_cast<WT*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    wb[1] = wb[0] + 16 * ldw;
  }
  auto fill = [&](int64_t n0, WT* dst) {
    const int64_t nr = std::min<int64_t>(16, N - n0);
    for (int64_t r = 0; r < nr; ++r) dequant_ahead(fmt, w + (n0 + r) * row_bytes, row_bytes, K, dst + r * ldw, tmp.data());
    if (nr < 16) std::memset(dst + nr * ldw, 0, size_t((16 - nr) * ldw) * sizeof(WT));
  };
  Stage st(out, M, nb);
  if (!in_place && nb < ne) fill(nb, wb[0]);
  for (int64_t n0 = nb, i = 0; n0 < ne; n0 += 16, ++i) {
    if (n0 - st.out.n0 == Stage::kCols) st.flush_and_move(n0);
    const int64_t nr = std::min<int64_t>(16, N - n0);
    const WT* blk;
    if (in_place) {
      blk = reinterpret_cast<const WT*>(w + n0 * row_bytes);
    } else {
      if (n0 + 16 < ne) fill(n0 + 16, wb[(i + 1) & 1]);
      blk = wb[i & 1];
    }
    dot_block(x, M, K, blk, ldw, nr, st.out, n0);
  }
  if (nb < ne) st.flush_and_move(ne);
}

// Rows `ids` of W dequantized to fp32 (embedding lookups).
inline void rows_f32(int64_t fmt, const uint8_t* w, int64_t row_bytes, int64_t K,
                     const int64_t* ids, int64_t T, float* dst) {
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) ::isa_avx2::dequant_row<float>(fmt, w + ids[t] * row_bytes, K, dst + t * K);
  });
}
