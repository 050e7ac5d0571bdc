// BF16 skinny-matrix product for small batches on x86-64 CPUs:
//     y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),  fp32 accumulation, bf16 or fp32 output.
//
// Two code paths, chosen at run time (see `pick_algo`):
//   * AVX512_BF16: `vdpbf16ps` dot products along K in register tiles -- 1 row of x by 16 rows
//     of W for M == 1, else up to 4 x 4 -- reduced horizontally at the end. Any K (masked tail).
//     Compute-bound from M ~ 4 on (one dot-product instruction per 32 MACs).
//   * AMX-BF16: y^T tiles = W-tile (16 rows of W x 32 k, loaded straight from W) times a packed
//     x-tile (16 k-pairs x 16 rows of x). Compute is then never the limit, only memory; needs
//     K % 32 == 0, M <= 32 and the OS granting the AMX tile state (`arch_prctl`).
// Both are parallel over N on torch's OpenMP pool (so torch.get_num_threads() is respected), with
// chunks of rows handed out dynamically, and read each row of W from memory once for all M rows.
//
// `bf16_linear_argmax` runs the same product (bf16 output) and returns the argmax of each row of
// y instead of y, each chunk of y scanned right after it is written (from L1/L2, where a separate
// argmax reads the whole [M, N] logits back from memory): greedy decoding over a large vocabulary.
// `argmax_bf16` is that scan alone over a bf16 [M, N] tensor. Both follow torch.argmax: the first
// maximum, a NaN counting as the maximum (the first NaN).
//
// Registered as torch.ops.pagedserve_cpu.{bf16_linear, bf16_linear_argmax, argmax_bf16,
// features}; the Python wrappers are pagedserve/kernels/cpu_gemm.py and cpu_argmax.py. No -m flags: the SIMD code carries target attributes, so the file
// builds with any x86-64 gcc >= 11 and its generic code runs anywhere. NOTE: callers must check
// `features()` before calling `bf16_linear` (it re-checks and throws), since the instructions fault
// on CPUs without them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

namespace {

using bf16_t = uint16_t;

// Tiles of W up to this size get the next tile-sized stretch of W prefetched into L1 in one burst
// before they are computed (measured: +10-15% GB/s at M = 1, up to +80% at M = 2..4 on the
// AVX512_BF16 path; larger tiles would evict themselves from L1). The AMX path reads W as fast
// without it, and slower with any prefetch pattern tried.
constexpr int64_t kPrefetchMaxBytes = 32 * 1024;

inline void prefetch_l1(const bf16_t* from, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(from);
  // NOTE: may run past the end of W; prefetches are hints and never fault.
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// ----------------------------------------------------------------------------------------------
// CPU feature detection (cpuid + XCR0 + Linux AMX permission), computed once.
// ----------------------------------------------------------------------------------------------

struct Features {
  bool avx512bf16 = false;
  bool amx = false;
};

uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

Features detect_features() {
  Features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  if (!osxsave) return f;
  const uint64_t xcr0 = read_xcr0();
  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM state enabled by the OS.
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const unsigned max_subleaf = a;
  const bool avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  unsigned a1 = 0, b1, c1, d1;
  if (max_subleaf >= 1) __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool bf16 = (a1 >> 5) & 1;
  f.avx512bf16 = os_avx512 && avx512f && avx512bw && avx512vl && bf16;
  // AMX: XTILECFG (bit 17) and XTILEDATA (bit 18) in XCR0, plus Linux's per-process permission.
  if (f.avx512bf16 && amx_bf16 && amx_tile && ((xcr0 >> 17) & 3) == 3) {
#ifdef __linux__
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr long XFEATURE_XTILEDATA = 18;
    f.amx = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
  }
  return f;
}

const Features& features() {
  static const Features f = detect_features();  // thread-safe static init
  return f;
}

// ----------------------------------------------------------------------------------------------
// Output helpers.
// ----------------------------------------------------------------------------------------------

inline void store_out(void* y, bool out_fp32, int64_t idx, float v) {
  if (out_fp32) {
    static_cast<float*>(y)[idx] = v;
  } else {
    static_cast<c10::BFloat16*>(y)[idx] = c10::BFloat16(v);  // round to nearest even
  }
}

// 16 consecutive outputs y[idx .. idx + 16) = v (+ 16 bias values, if any).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store16(
    void* y, bool out_fp32, int64_t idx, __m512 v, const float* bias16) {
  if (bias16) v = _mm512_add_ps(v, _mm512_loadu_ps(bias16));
  if (out_fp32) {
    _mm512_storeu_ps(static_cast<float*>(y) + idx, v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<bf16_t*>(y) + idx),
                        (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even
  }
}

// ----------------------------------------------------------------------------------------------
// AVX512_BF16 path.
// ----------------------------------------------------------------------------------------------

// 16 fp32 vectors -> one vector whose lane L holds the sum of vector reduce_perm().perm[L].
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 reduce16(const __m512* v) {
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) {  // 16 -> 8: add the 256-bit halves, two vectors per result
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 8 -> 4: add the 128-bit quarters
    const __m512 a = s8[2 * i], b = s8[2 * i + 1];
    s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // 4 -> 2: add the 64-bit halves of each 128-bit lane
    const __m512d a = _mm512_castps_pd(s4[2 * i]), b = _mm512_castps_pd(s4[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // 2 -> 1: add adjacent floats
  return _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane -> input-vector index of reduce16, found once by reducing vectors filled with their index.
struct ReducePerm {
  int perm[16];              // lane L of reduce16's result holds the sum of input perm[L]
  alignas(64) int inv[16];   // lane of reduce16's result holding the sum of input j
};

__attribute__((target("avx512f,avx512bw,avx512vl"))) ReducePerm make_reduce_perm() {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(float(i));
  alignas(64) float r[16];
  _mm512_store_ps(r, reduce16(v));
  ReducePerm p;
  for (int l = 0; l < 16; ++l) p.perm[l] = int(r[l] / 16.0f + 0.5f);
  for (int l = 0; l < 16; ++l) p.inv[p.perm[l]] = l;
  return p;
}

const ReducePerm& reduce_perm() {
  // NOTE: only called after features().avx512bf16 was checked (it runs AVX-512 instructions).
  static const ReducePerm p = make_reduce_perm();
  return p;
}

// One register tile: rows x[0..MB) times rows w[0..NB) over all K; writes
// res[i * NB + j] = dot(x_i, w_j) in fp32.
template <int MB, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void dp_tile(
    const bf16_t* __restrict x, int64_t ldx, const bf16_t* __restrict w, int64_t ldw, int64_t K,
    float* __restrict res, const int* perm) {
  __m512 acc[MB * NB];
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) acc[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ldw + k);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]);
    }
  }
  if (k < K) {  // K tail: masked loads read zeros past the end of each row
    const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * ldw + k);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]);
    }
  }
  if constexpr (MB * NB == 16) {
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(acc));
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) res[perm[l]] = r[l];
  } else {
#pragma GCC unroll 16
    for (int t = 0; t < MB * NB; ++t) res[t] = _mm512_reduce_add_ps(acc[t]);
  }
}

template <int MB, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dp_block(
    const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t ldw, int64_t K, const float* bias,
    void* y, int64_t ldy, bool out_fp32, int64_t m0, int64_t n0, const int* perm) {
  float res[MB * NB];
  dp_tile<MB, NB>(x + m0 * ldx, ldx, w + n0 * ldw, ldw, K, res, perm);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float b = bias ? bias[n0 + j] : 0.f;
      store_out(y, out_fp32, (m0 + i) * ldy + n0 + j, res[i * NB + j] + b);
    }
}

// M == 1: 16 rows of W at once, reduced together and stored as one vector.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dp_row16(
    const bf16_t* __restrict x, const bf16_t* __restrict w, int64_t K, const float* bias, void* y,
    bool out_fp32, int64_t n0, const int* inv) {
  w += n0 * K;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(w + j * K + k));
    }
  }
  if (k < K) {
    const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * K + k));
  }
  const __m512 r = _mm512_permutexvar_ps(_mm512_load_si512(inv), reduce16(acc));
  store16(y, out_fp32, n0, r, bias ? bias + n0 : nullptr);
}

using DpBlockFn = void (*)(const bf16_t*, int64_t, const bf16_t*, int64_t, int64_t, const float*,
                           void*, int64_t, bool, int64_t, int64_t, const int*);

// kDpBlocks[mb - 1][nb - 1]
constexpr DpBlockFn kDpBlocks[4][4] = {
    {dp_block<1, 1>, dp_block<1, 2>, dp_block<1, 3>, dp_block<1, 4>},
    {dp_block<2, 1>, dp_block<2, 2>, dp_block<2, 3>, dp_block<2, 4>},
    {dp_block<3, 1>, dp_block<3, 2>, dp_block<3, 3>, dp_block<3, 4>},
    {dp_block<4, 1>, dp_block<4, 2>, dp_block<4, 3>, dp_block<4, 4>},
};
constexpr int64_t kDpNB = 4;  // rows of W per tile
constexpr int64_t kDpMB = 4;  // rows of x per tile

// Rows [n_begin, n_end) of W against all M rows of x.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dp_rows(
    const bf16_t* x, int64_t M, const bf16_t* w, int64_t K, const float* bias, void* y, int64_t N,
    bool out_fp32, int64_t n_begin, int64_t n_end) {
  const int* perm = reduce_perm().perm;
  if (M == 1) {
    const int* inv = reduce_perm().inv;
    const int64_t tile_bytes = 16 * K * int64_t(sizeof(bf16_t));
    for (; n_begin + 16 <= n_end; n_begin += 16) {
      // half a tile ahead (measured best for K = 640: 12.3 vs 11.8 GB/s a whole tile ahead)
      if (tile_bytes <= kPrefetchMaxBytes) prefetch_l1(w + n_begin * K + 8 * K, tile_bytes);
      dp_row16(x, w, K, bias, y, out_fp32, n_begin, inv);
    }
  }
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kDpNB) {
    const int64_t nb = std::min(kDpNB, n_end - n0);
    const int64_t tile_bytes = nb * K * int64_t(sizeof(bf16_t));
    if (tile_bytes <= kPrefetchMaxBytes) prefetch_l1(w + (n0 + nb) * K, tile_bytes);  // next tile
    // NOTE: the m loop is inside the n loop, so the NB rows of W come from memory once and from
    // L1 for the later m blocks.
    for (int64_t m0 = 0; m0 < M; m0 += kDpMB) {
      const int64_t mb = std::min(kDpMB, M - m0);
      kDpBlocks[mb - 1][nb - 1](x, K, w, K, K, bias, y, N, out_fp32, m0, n0, perm);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// AMX-BF16 path.
// ----------------------------------------------------------------------------------------------

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: tmm0..3 accumulators (C: 16 rows of W x 16 rows of x, fp32), tmm4/5 W tiles
// (A: 16 rows x 32 bf16), tmm6/7 packed x tiles (B: 16 k-pairs x 16 rows of x x 2 bf16).
__attribute__((target("amx-tile"))) void amx_configure() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// In-place 16 x 16 transpose of 32-bit elements: on return r[j] holds column j of the input rows.
// 32-bit and 64-bit interleaves within 128-bit lanes, then a 4 x 4 transpose of 128-bit blocks.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void transpose16x16(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j], lane l: rows 4i .. 4i + 3 of column 4l + j
    const __m512d a0 = _mm512_castps_pd(a[4 * i]), a1 = _mm512_castps_pd(a[4 * i + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * i + 2]), a3 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 c0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x44);
    const __m512 c1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xEE);
    const __m512 c2 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x44);
    const __m512 c3 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xEE);
    r[j] = _mm512_shuffle_f32x4(c0, c2, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(c0, c2, 0xDD);
    r[8 + j] = _mm512_shuffle_f32x4(c1, c3, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(c1, c3, 0xDD);
  }
}

// Packs x rows [m0, m0 + 16) (zero past M) for B tiles: xp[kc][p][r][e] = x[m0 + r][32kc + 2p + e],
// i.e. per 32-k chunk a 16 x 16 transpose of bf16 pairs. K % 32 == 0.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void amx_pack_x(
    const bf16_t* x, int64_t M, int64_t K, int64_t m0, bf16_t* xp) {
  const int64_t KC = K / 32;
  const int64_t rows = std::min<int64_t>(16, M - m0);
  for (int64_t kc = 0; kc < KC; ++kc) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(x + (m0 + i) * K + kc * 32))
                      : _mm512_setzero_ps();
    transpose16x16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_ps(reinterpret_cast<float*>(xp + kc * 512 + p * 32), r[p]);
  }
}

// Writes C tile `c` (c[n][m], 16 x 16 fp32, as stored from the tile) for W rows n0 .. n0 + 16
// and x rows m0 .. m0 + mcount: y[m0 + m][n0 + n] = c[n][m] + bias[n0 + n].
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void amx_store_c(
    const float* c, const float* bias, void* y, int64_t N, bool out_fp32, int64_t n0, int64_t m0,
    int64_t mcount) {
  const float* b16 = bias ? bias + n0 : nullptr;
  if (mcount <= 2) {  // gather the few columns needed
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int64_t m = 0; m < mcount; ++m)
      store16(y, out_fp32, (m0 + m) * N + n0, _mm512_i32gather_ps(idx, c + m, 4), b16);
    return;
  }
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + 16 * i);
  transpose16x16(r);
  for (int64_t m = 0; m < mcount; ++m) store16(y, out_fp32, (m0 + m) * N + n0, r[m], b16);
}

// Rows [n_begin, n_end) of W (a multiple of 64 rows, or the last block ending at a multiple of
// 16) for M <= 16 (one packed x group `xp`) or M <= 32 (two groups, xp and xp + KC * 512).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void amx_rows(
    const bf16_t* xp, int64_t M, const bf16_t* w, int64_t K, const float* bias, void* y,
    int64_t N, bool out_fp32, int64_t n_begin, int64_t n_end) {
  const int64_t KC = K / 32;
  const int64_t ldw_bytes = K * sizeof(bf16_t);
  alignas(64) float c[4][256];
  amx_configure();
  if (M <= 16) {
    // Blocks of 4 W tiles (64 rows) share each packed x tile; the last block may be shorter.
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 64) {
      const int64_t nt = std::min<int64_t>(4, (n_end - n0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const bf16_t* w0 = w + n0 * K;
      if (nt == 4) {
        for (int64_t kc = 0; kc < KC; ++kc) {
          _tile_loadd(6, xp + kc * 512, 64);
          _tile_loadd(4, w0 + kc * 32, ldw_bytes);
          _tile_loadd(5, w0 + 16 * K + kc * 32, ldw_bytes);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(4, w0 + 32 * K + kc * 32, ldw_bytes);
          _tile_loadd(5, w0 + 48 * K + kc * 32, ldw_bytes);
          _tile_dpbf16ps(2, 4, 6);
          _tile_dpbf16ps(3, 5, 6);
        }
      } else {
        for (int64_t kc = 0; kc < KC; ++kc) {
          _tile_loadd(6, xp + kc * 512, 64);
          _tile_loadd(4, w0 + kc * 32, ldw_bytes);
          _tile_dpbf16ps(0, 4, 6);
          if (nt > 1) {
            _tile_loadd(5, w0 + 16 * K + kc * 32, ldw_bytes);
            _tile_dpbf16ps(1, 5, 6);
          }
          if (nt > 2) {
            _tile_loadd(4, w0 + 32 * K + kc * 32, ldw_bytes);
            _tile_dpbf16ps(2, 4, 6);
          }
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int64_t t = 0; t < nt; ++t) amx_store_c(c[t], bias, y, N, out_fp32, n0 + 16 * t, 0, M);
    }
  } else {
    // 17 <= M <= 32: blocks of 2 W tiles (32 rows) x 2 packed x groups.
    const bf16_t* xp1 = xp + KC * 512;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 32) {
      const bool two = n_end - n0 >= 32;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const bf16_t* w0 = w + n0 * K;
      for (int64_t kc = 0; kc < KC; ++kc) {
        _tile_loadd(6, xp + kc * 512, 64);
        _tile_loadd(7, xp1 + kc * 512, 64);
        _tile_loadd(4, w0 + kc * 32, ldw_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, w0 + 16 * K + kc * 32, ldw_bytes);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      amx_store_c(c[0], bias, y, N, out_fp32, n0, 0, 16);
      amx_store_c(c[1], bias, y, N, out_fp32, n0, 16, M - 16);
      if (two) {
        amx_store_c(c[2], bias, y, N, out_fp32, n0 + 16, 0, 16);
        amx_store_c(c[3], bias, y, N, out_fp32, n0 + 16, 16, M - 16);
      }
    }
  }
  _tile_release();
}

// ----------------------------------------------------------------------------------------------
// Argmax of bf16 rows (torch.argmax's rule: first maximum, NaN counts as the maximum).
// ----------------------------------------------------------------------------------------------

// The best element seen so far of one row; idx < 0: none yet.
struct ArgBest {
  int64_t idx = -1;
  float val = 0.0f;
  bool nan = false;
};

// Whether a beats b in torch.argmax's order: any NaN beats any number, the larger number beats
// the smaller, and between equals (or two NaNs) the smaller index wins. NOTE: a total order on
// (element, index), so chunk results merge in any order to the row's argmax.
inline bool arg_better(const ArgBest& a, const ArgBest& b) {
  if (a.idx < 0) return false;
  if (b.idx < 0) return true;
  if (a.nan != b.nan) return a.nan;
  if (!a.nan && a.val != b.val) return a.val > b.val;
  return a.idx < b.idx;
}

// The argmax of row[begin, end) (indices into row).
__attribute__((target("avx512f,avx512bw,avx512vl"))) ArgBest scan_bf16(const bf16_t* row,
                                                                         int64_t begin, int64_t end) {
  ArgBest best;
  if (begin >= end) return best;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = end - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (end - i)) - 1u);
    __m256i raw = _mm256_maskz_loadu_epi16(m, row + i);
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    if (nan) {  // the first NaN of the range: nothing after it can win
      best.idx = i + __builtin_ctz(nan);
      best.nan = true;
      return best;
    }
    vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 target = _mm512_set1_ps(mx);
  // Second pass, from L1/L2: the first element equal to the maximum (-0 == +0, as torch compares).
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = end - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (end - i)) - 1u);
    __m256i raw = _mm256_maskz_loadu_epi16(m, row + i);
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    const __mmask16 eq = _mm512_mask_cmp_ps_mask(m, v, target, _CMP_EQ_OQ);
    if (eq) {
      best.idx = i + __builtin_ctz(eq);
      best.val = mx;
      return best;
    }
  }
  return best;  // not reached: the maximum is one of the elements
}

// Per-row results merged from chunks that finish on different threads.
class RowArgmax {
 public:
  explicit RowArgmax(int64_t rows) : best_(size_t(rows)) {}

  // Scans rows [first, end_row) of y (row stride ld) over columns [begin, end) and merges the
  // results into those rows'.
  void scan(const bf16_t* y, int64_t first, int64_t end_row, int64_t ld, int64_t begin,
            int64_t end) {
    ArgBest local[32];
    for (int64_t r0 = first; r0 < end_row; r0 += 32) {
      const int64_t n = std::min<int64_t>(32, end_row - r0);
      for (int64_t r = 0; r < n; ++r) local[r] = scan_bf16(y + (r0 + r) * ld, begin, end);
      std::lock_guard<std::mutex> guard(mu_);
      for (int64_t r = 0; r < n; ++r)
        if (arg_better(local[r], best_[r0 + r])) best_[r0 + r] = local[r];
    }
  }

  at::Tensor result(const at::TensorOptions& opts) const {
    at::Tensor out = at::empty({int64_t(best_.size())}, opts.dtype(at::kLong));
    int64_t* p = out.data_ptr<int64_t>();
    for (size_t r = 0; r < best_.size(); ++r) p[r] = std::max<int64_t>(best_[r].idx, 0);
    return out;
  }

 private:
  std::vector<ArgBest> best_;
  std::mutex mu_;
};

// ----------------------------------------------------------------------------------------------
// Entry points.
// ----------------------------------------------------------------------------------------------

// Runs fn(row_begin, row_end) over [0, rows) in chunks of `unit`-row multiples, handed out
// dynamically to torch's threads: a thread the OS preempts (the machine is shared with the
// rest of the server) then delays one chunk, not a fixed half of the work.
template <typename Fn>
void parallel_rows(int64_t rows, int64_t unit, const Fn& fn) {
  const int64_t units = (rows + unit - 1) / unit;
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  // ~8 chunks per thread, each at least 64 rows (80 KB of W for K = 640)
  const int64_t chunk_units =
      std::max<int64_t>({1, (64 + unit - 1) / unit, units / (max_threads * 8)});
  const int64_t chunks = (units + chunk_units - 1) / chunk_units;
  const int64_t threads = std::min(max_threads, chunks);
  if (threads <= 1) {  // no OpenMP region for small products
    if (rows > 0) fn(0, rows);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c * chunk_units * unit, std::min(rows, (c + 1) * chunk_units * unit));
    }
  });
}

enum Algo : int64_t { kAuto = 0, kDp = 1, kAmx = 2 };

// Which path to use: AVX512_BF16 for M == 1 (it streams W a little faster there), AMX for
// 2 <= M <= 32 when usable (the dot-product path is compute-bound from M ~ 4 on), else AVX512_BF16.
int64_t pick_algo(int64_t requested, int64_t M, int64_t K) {
  const bool amx_ok = features().amx && K % 32 == 0 && M <= 32;
  if (requested == kAmx) {
    TORCH_CHECK(amx_ok, "bf16_linear: AMX path unavailable for this CPU/shape (M=", M, ", K=", K, ")");
    return kAmx;
  }
  if (requested == kDp) return kDp;
  return amx_ok && M >= 2 ? kAmx : kDp;
}

// y = x @ W^T (+ bias) into y ([M, N], allocated by the caller); after(nb, ne) runs on the thread
// that wrote rows [nb, ne) of W's outputs (columns of y), right after writing them, for stretches
// of at most `step` rows (0: whole chunks). NOTE: a chunk streams megabytes of W through the
// caches; a stretch of 512 rows leaves its outputs in L1 for `after`.
template <typename After>
void run_product(const bf16_t* xp, int64_t M, const bf16_t* wp, int64_t K, int64_t N,
                 const float* bias_ptr, void* yp, bool out_fp32, int64_t algo, int64_t step,
                 const After& after) {
  if (pick_algo(algo, M, K) == kAmx) {
    const int64_t KC = K / 32;
    std::vector<bf16_t> packed(size_t(KC * 512 * 2 + 32));
    // NOTE: amx_pack_x stores with aligned stores: align the packed buffer to 64 bytes by hand.
    bf16_t* xpk = reinterpret_cast<bf16_t*>((reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t(63));
    amx_pack_x(xp, M, K, 0, xpk);
    if (M > 16) amx_pack_x(xp, M, K, 16, xpk + KC * 512);
    const int64_t n_amx = N / 16 * 16;  // the tail rows (N % 16) go through the dp path
    // NOTE: amx_rows wants ranges of whole 64-row (M <= 16) or 32-row blocks, except at n_amx.
    parallel_rows(n_amx, M <= 16 ? 64 : 32, [&](int64_t nb, int64_t ne) {
      // (step is a multiple of 64: every stretch but the last is whole blocks)
      for (int64_t s = nb, e; s < ne; s = e) {
        e = step ? std::min(ne, s + step) : ne;
        amx_rows(xpk, M, wp, K, bias_ptr, yp, N, out_fp32, s, e);
        after(s, e);
      }
    });
    if (n_amx < N) {
      dp_rows(xp, M, wp, K, bias_ptr, yp, N, out_fp32, n_amx, N);
      after(n_amx, N);
    }
    return;
  }
  // NOTE: split N in units of 16 rows, so that M == 1 runs dp_row16 on all but the last rows.
  parallel_rows(N, 16, [&](int64_t nb, int64_t ne) {
    for (int64_t s = nb, e; s < ne; s = e) {
      e = step ? std::min(ne, s + step) : ne;
      dp_rows(xp, M, wp, K, bias_ptr, yp, N, out_fp32, s, e);
      after(s, e);
    }
  });
}

void check_product_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(features().avx512bf16, op, ": this CPU lacks AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              op, ": x and weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, op, ": x must be [M, K], weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), op, ": contiguous tensors only");
  TORCH_CHECK(weight.size(1) == x.size(1), op, ": x is [", x.size(0), ", ", x.size(1),
              "] but weight is [", weight.size(0), ", ", weight.size(1), "]");
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool out_fp32, int64_t algo) {
  check_product_args("bf16_linear", x, weight);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bias_ptr = nullptr;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N,
                "bf16_linear: bias must be a CPU tensor of shape [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f32.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias_ptr ? y.copy_(bias_f32.expand({M, N})) : y.zero_();

  run_product(reinterpret_cast<const bf16_t*>(x.data_ptr()), M,
              reinterpret_cast<const bf16_t*>(weight.data_ptr()), K, N, bias_ptr, y.data_ptr(),
              out_fp32, algo, 0, [](int64_t, int64_t) {});
  return y;
}

// Rows of W per stretch scanned by bf16_linear_argmax: 16 KB of outputs at M = 16.
constexpr int64_t kScanRows = 512;

// argmax over N of x @ W^T, rounded to bf16 as bf16_linear's output: [M] int64.
at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& weight, int64_t algo) {
  check_product_args("bf16_linear_argmax", x, weight);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(N > 0, "bf16_linear_argmax: weight has no rows (argmax of an empty row)");
  if (M == 0) return at::empty({0}, x.options().dtype(at::kLong));
  at::Tensor y = at::empty({M, N}, x.options());
  if (K == 0) y.zero_();
  const auto* yp = reinterpret_cast<const bf16_t*>(y.data_ptr());
  RowArgmax best(M);
  if (K == 0) {
    best.scan(yp, 0, M, N, 0, N);
  } else {
    run_product(reinterpret_cast<const bf16_t*>(x.data_ptr()), M,
                reinterpret_cast<const bf16_t*>(weight.data_ptr()), K, N, nullptr, y.data_ptr(),
                false, algo, kScanRows, [&](int64_t nb, int64_t ne) { best.scan(yp, 0, M, N, nb, ne); });
  }
  return best.result(x.options());
}

// argmax over the last dim of a bf16 [M, N] tensor: [M] int64 (rows split into pieces of 32K
// elements, so that one long row still uses every thread).
at::Tensor argmax_bf16(const at::Tensor& x) {
  TORCH_CHECK(features().avx512bf16, "argmax_bf16: this CPU lacks AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous(),
              "argmax_bf16: x must be a contiguous [M, N] bfloat16 CPU tensor");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N > 0 || M == 0, "argmax_bf16: argmax of an empty row");
  if (M == 0) return at::empty({0}, x.options().dtype(at::kLong));
  constexpr int64_t kPiece = 32768;
  const int64_t pieces = (N + kPiece - 1) / kPiece;
  const auto* xp = reinterpret_cast<const bf16_t*>(x.data_ptr());
  RowArgmax best(M);
  at::parallel_for(0, M * pieces, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = u / pieces, p = u % pieces;
      best.scan(xp, r, r + 1, N, p * kPiece, std::min(N, (p + 1) * kPiece));
    }
  });
  return best.result(x.options());
}

// [avx512bf16, amx] as ints (0/1), for the Python side to decide whether to call bf16_linear.
std::vector<int64_t> cpu_features() {
  const Features& f = features();
  return {int64_t(f.avx512bf16), int64_t(f.amx)};
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias, bool out_fp32, int algo) -> Tensor");
  m.def("bf16_linear_argmax(Tensor x, Tensor weight, int algo) -> Tensor");
  m.def("argmax_bf16(Tensor x) -> Tensor");
  m.def("features() -> int[]", &cpu_features);  // catch-all: no tensor arguments to dispatch on
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_argmax", &bf16_linear_argmax);
  m.impl("argmax_bf16", &argmax_bf16);
}
