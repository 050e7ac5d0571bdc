// Attention of a prompt chunk over its context on AVX512-BF16 CPUs (bf16 q, k, v):
//
//   out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, g]) v[j, g],   g = h / (Hq / Hkv),
//   j in [max(0, p_i - window + 1), p_i],  p_i = ctx - n + i  (the chunk is the context's tail)
//
// For each query head and block of 16 query rows (rows in the 16 vector lanes): the scores of
// every key the block can see, by vdpbf16ps over q packed as bf16 pairs with each key's pairs
// broadcast (no horizontal sums); an exact softmax per lane over them (max, exp, sum: vertical
// operations, the scores of a block stay in a thread's buffer); then the weights, rounded to bf16
// and packed as pairs, times V packed once per call as pairs of keys ([ctx / 2][D][2] per KV
// head), 4 rows x 64 dimensions of accumulators at a time. Causal: a block reads keys up to its
// last row (at most 15 masked keys computed per row); a sliding window skips whole key ranges.
// What torch's SDPA did here ran at ~37 GFLOP/s per core at 160 tokens and ~15 at 512 (2-core
// Zen 4, docs/benchmarks.md).
//
// Registered as torch.ops.pagedserve_cpu.prefill_attention; the Python wrapper is
// kernels/cpu_attention.py (AMX, AVX512-BF16 and AVX2 builds below; SDPA without AVX2).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_isa.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// One call's shapes, read by every ISA's kernel below.
struct Shape {
  int64_t n, ctx, Hq, Hkv, D;
  int64_t sq, sk, so;  // row strides (elements) of q, k / v, out
  float scale;
  int64_t window;  // 0: none
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {
namespace isa_avx512bf16 {

// The V16 operations (csrc/vec16.h) as one AVX-512 register: its softmax exp (the same
// polynomial as the decode kernels').
namespace v16 {
#define PS_VEC 512
#include "vec16.h"
#undef PS_VEC
}  // namespace v16

inline __m512 exp16(__m512 x) { return v16::v_exp_neg(v16::V16{x}).v; }

// v [ctx, Hkv, D] -> vp [Hkv][ceil(ctx / 2)][D][2]: the pairs of keys 2p, 2p + 1 side by side
// for each dimension (a missing last key: zeros).
void pack_v(const uint16_t* v, const Shape& s, uint16_t* vp) {
  const int64_t P = (s.ctx + 1) / 2;
  at::parallel_for(0, s.Hkv * P, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t g = t / P, p = t % P;
      const uint16_t* v0 = v + (2 * p) * s.sk + g * s.D;
      const bool has1 = 2 * p + 1 < s.ctx;
      uint16_t* dst = vp + (g * P + p) * s.D * 2;
      for (int64_t d = 0; d < s.D; d += 16) {  // 16 dimensions: 32 bf16 interleaved
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d));
        const __m256i c = has1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + s.sk + d))
                               : _mm256_setzero_si256();
        // 16-bit interleave of a and c: widen to 32 bits, then c << 16 | a
        const __m512i a32 = _mm512_cvtepu16_epi32(a), c32 = _mm512_cvtepu16_epi32(c);
        _mm512_storeu_si512(dst + d * 2, _mm512_or_si512(a32, _mm512_slli_epi32(c32, 16)));
      }
    }
  });
}

// Rows lane0 .. lane0 + 3 of a block of 16 times pairs [p0, p1) of the weights pp ([pairs][16
// lanes] of bf16 pairs) and V (vg: this KV head's packed pairs), dimensions d0 .. d0 + 16 NC:
// acc, continued from the partial sums in `part` ([16][D] fp32) unless it is null.
template <int NC>
inline void pv_tile(const uint32_t* pp, const uint16_t* vg, int64_t D, int64_t p0, int64_t p1,
                    int64_t lane0, int64_t d0, __m512* acc /* [4][NC] */, const float* part) {
#pragma GCC unroll 16
  for (int t = 0; t < 4 * NC; ++t)
    acc[t] = part ? _mm512_loadu_ps(part + (lane0 + t / NC) * D + d0 + (t % NC) * 16) : _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* vrow = vg + p * D * 2 + d0 * 2;
    __m512bh vv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vrow + c * 32);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pp[p * 16 + lane0 + i]));
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[i * NC + c] = _mm512_dpbf16_ps(acc[i * NC + c], vv[c], w);
    }
  }
}

// Pairs of keys per chunk of the weighted sum of values (as the AVX2 kernel's kPvKeys, below):
// 64 pairs' values (64 KiB at D = 256) stay in L2 while the block's tiles walk them; up to
// kPvWholePairs in one pass.
constexpr int64_t kPvPairs = 64, kPvWholePairs = 320;

// One (query head, block of 16 rows) task. st: scores [keys][16], pp: [pairs][16], part: [16][D]
// scratch.
void attend_block(const uint16_t* q, const uint16_t* k, const uint16_t* vp, uint16_t* out,
                  const Shape& s, int64_t h, int64_t i0, float* st, uint32_t* pp, float* part,
                  const uint16_t* zeros) {
  const int64_t r = std::min<int64_t>(16, s.n - i0), g = h / (s.Hq / s.Hkv);
  const int64_t q0 = s.ctx - s.n;                 // position of query row 0
  const int64_t hi = q0 + i0 + r;                  // keys [lo, hi) seen by some row of the block
  int64_t lo = s.window ? std::max<int64_t>(0, q0 + i0 - s.window + 1) : 0;
  lo &= ~int64_t(1);                               // pairs start at even keys
  const int64_t P2 = s.D / 2;
  // q rows packed as pairs: qp[p][lane]
  alignas(64) uint32_t qp[512 * 16];  // D <= 1024
  for (int64_t p = 0; p < P2; ++p)
    for (int64_t i = 0; i < 16; ++i) {
      uint32_t val = 0;
      if (i < r) std::memcpy(&val, q + (i0 + i) * s.sq + h * s.D + 2 * p, 4);
      qp[p * 16 + i] = val;
    }
  // Scores, 16 keys at a time.
  const int64_t nkeys = hi - lo;
  for (int64_t j0 = lo; j0 < hi; j0 += 16) {
    const uint32_t* kr[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t key = j0 + j;
      kr[j] = reinterpret_cast<const uint32_t*>(key < hi ? k + key * s.sk + g * s.D : zeros);
    }
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P2; ++p) {
      const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * 16);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_set1_epi32(int(kr[j][p])));
    }
    for (int j = 0; j < 16; ++j) _mm512_store_ps(st + (j0 - lo + j) * 16, acc[j]);
  }
  // Softmax per lane over the keys it sees: row i sees key j iff j <= q0 + i0 + i and, with a
  // window, q0 + i0 + i - j < window. Lanes past r see every key (their results are dropped).
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 pad = (__mmask16)~((1u << r) - 1);
  auto visible = [&](int64_t j) -> __mmask16 {
    const int64_t d = j - q0 - i0;  // row i sees j iff i >= d (and i < d + window)
    __mmask16 m = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(int(std::max<int64_t>(-1, std::min<int64_t>(16, d)))));
    if (s.window) m &= _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(int(std::max<int64_t>(-1, std::min<int64_t>(17, d + s.window)))));
    return m | pad;
  };
  const __m512 sc = _mm512_set1_ps(s.scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nkeys; ++j)
    mx = _mm512_mask_max_ps(mx, visible(lo + j), mx, _mm512_mul_ps(_mm512_load_ps(st + j * 16), sc));
  __m512 sum = _mm512_setzero_ps();
  const int64_t npairs = (nkeys + 1) / 2;
  for (int64_t t = 0; t < npairs; ++t) {
    __m512 e[2];
    for (int u = 0; u < 2; ++u) {
      const int64_t j = 2 * t + u;
      if (j < nkeys) {
        const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(st + j * 16), sc), mx);
        e[u] = _mm512_maskz_mov_ps(visible(lo + j), exp16(x));
      } else {
        e[u] = _mm512_setzero_ps();
      }
      sum = _mm512_add_ps(sum, e[u]);
    }
    // bf16 pairs (key 2t, key 2t + 1) per lane: rounded as vcvtneps2bf16
    const __m512i a32 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[0]));
    const __m512i b32 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[1]));
    _mm512_store_si512(pp + t * 16, _mm512_or_si512(a32, _mm512_slli_epi32(b32, 16)));
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
  // Weighted sum of values: 4 rows x up to 4 chunks of 16 dimensions at a time, over chunks of
  // kPvPairs pairs of keys; between them the partial sums wait in `part` (long contexts: the
  // values are read from memory once per block, not once per tile). NOTE: fp32 partial sums
  // stored and reloaded are exact: each lane still adds its pairs in order from zero.
  const int64_t P = (s.ctx + 1) / 2;
  const uint16_t* vg = vp + g * P * s.D * 2;
  const uint32_t* ppl = pp - (lo / 2) * 16;  // indexed by absolute pair
  const int64_t chunks = s.D / 16;
  const int64_t span = npairs <= kPvWholePairs ? npairs : kPvPairs;
  for (int64_t pa = 0; pa < npairs; pa += span) {
    const int64_t pb = std::min<int64_t>(npairs, pa + span);
    const float* from = pa == 0 ? nullptr : part;
    const bool last = pb == npairs;
    for (int64_t ig = 0; ig < r; ig += 4) {
      for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        const int nc = int(std::min<int64_t>(4, chunks - c0));
        const int64_t p0 = lo / 2 + pa, p1 = lo / 2 + pb;
        __m512 acc[16];
        switch (nc) {
          case 4: pv_tile<4>(ppl, vg, s.D, p0, p1, ig, c0 * 16, acc, from); break;
          case 3: pv_tile<3>(ppl, vg, s.D, p0, p1, ig, c0 * 16, acc, from); break;
          case 2: pv_tile<2>(ppl, vg, s.D, p0, p1, ig, c0 * 16, acc, from); break;
          default: pv_tile<1>(ppl, vg, s.D, p0, p1, ig, c0 * 16, acc, from); break;
        }
        if (!last) {  // rows ig .. ig + 3 (< 16) of the partial sums
          for (int64_t i = 0; i < 4; ++i)
            for (int c = 0; c < nc; ++c) _mm512_storeu_ps(part + (ig + i) * s.D + (c0 + c) * 16, acc[i * nc + c]);
          continue;
        }
        for (int64_t i = 0; i < 4 && ig + i < r; ++i) {
          uint16_t* orow = out + (i0 + ig + i) * s.so + h * s.D + c0 * 16;
          const __m512 w = _mm512_set1_ps(inv[ig + i]);
          for (int c = 0; c < nc; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i * nc + c], w)));
        }
      }
    }
  }
}

void run(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, const Shape& s) {
  const int64_t P = (s.ctx + 1) / 2;
  std::vector<uint16_t> vp(size_t(s.Hkv * P * s.D * 2));
  pack_v(v, s, vp.data());
  const int64_t blocks = (s.n + 15) / 16;
  const std::vector<uint16_t> zeros(size_t(s.D), 0);
  at::parallel_for(0, s.Hq * blocks, 1, [&](int64_t b, int64_t e) {
    const int64_t keys = std::min<int64_t>(s.ctx, s.window ? s.window + 16 : s.ctx) + 32;
    std::vector<float> st_buf(size_t(keys * 16 + 16));
    std::vector<uint32_t> pp_buf(size_t((keys / 2 + 2) * 16 + 16));
    std::vector<float> part(size_t(16 * s.D));
    float* st = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(st_buf.data()) + 63) & ~uintptr_t(63));
    uint32_t* pp = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(pp_buf.data()) + 63) & ~uintptr_t(63));
    for (int64_t t = b; t < e; ++t)
      attend_block(q, k, vp.data(), out, s, t % s.Hq, (t / s.Hq) * 16, st, pp, part.data(), zeros.data());
  });
}

}  // namespace isa_avx512bf16
}  // namespace

#pragma GCC pop_options

// The same attention on AMX tiles (Intel Xeon with AMX-BF16): each task (up to 4 query heads of
// one KV head, block of 16 rows) is two tile products per 32 keys, in the transposed forms that
// keep the AVX512-BF16 kernel's per-lane softmax (lanes = the block's 16 query rows):
//
//   S^T [16 keys][16 rows] (fp32)  += K [16 keys][32 dims] (bf16, rows of k read in place)
//                                      . Q^T as pairs [16 dim pairs][16 rows][2]
//   O^T [16 dims][16 rows] (fp32)  += V^T [16 dims][32 keys] (bf16, V transposed once per call)
//                                      . P^T as pairs [16 key pairs][16 rows][2] (the weights)
//
// Scores and softmax as above (exact per lane, weights rounded to bf16, their sum not), then one
// 16 x 16 transpose per 16 dimensions puts O^T's columns in out's rows. The heads of a task share
// each K and V^T tile load (GQA), so a long context is read once per block of rows, not once per
// head (2,048 rows over 8,192 keys, Gemma 3's 4 heads of 256: ~10x the AVX512-BF16 kernel).
// NOTE: chunking keeps every bit. A score walks the head's dimensions in chunks of 32 from
// zero; a row's output walks the keys in chunks of 32 from a multiple of 32 of the sequence's
// positions (`key_start`: the position of key 0 when the caller trimmed the context's head, a
// sliding window's): a row's keys outside its window or past its position weigh exactly 0, so
// the chunks a block adds for its other rows, or a trim adds or removes, add exact zeros.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace {
namespace isa_amx {
namespace v16 {
#define PS_VEC 512
#include "vec16.h"
#undef PS_VEC
}  // namespace v16
#include "transpose16.h"

constexpr int64_t kChunk = 32;  // keys per P^T tile (and the alignment of every key range)

#include "amx_tiles.h"

// v [ctx, Hkv, D] -> vt [Hkv][D][ctxp]: key j at column off + j (off = key_start % 32), zeros
// before it and past ctx (ctxp: off + ctx rounded up to 32). Each 16 x 16 tile of 32-bit pairs
// of keys is one transpose of the pairs (2p, 2p + 1) interleaved per dim.
void pack_vt(const uint16_t* v, const Shape& s, int64_t off, int64_t ctxp, uint16_t* vt) {
  const int64_t PB = ctxp / kChunk, DB = s.D / 16;  // 32-key chunks, 16-dim blocks
  at::parallel_for(0, s.Hkv * PB * DB, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t g = t / (PB * DB), pb = (t / DB) % PB, db = t % DB;
      __m512 r[16];
      for (int p = 0; p < 16; ++p) {  // pair p: keys 32 pb + 2p, + 1; dims 16 db .. + 15
        const int64_t k0 = pb * kChunk + 2 * p - off;
        const __m256i a = k0 >= 0 && k0 < s.ctx ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + k0 * s.sk + g * s.D + db * 16))
                                     : _mm256_setzero_si256();
        const __m256i c = k0 + 1 >= 0 && k0 + 1 < s.ctx ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (k0 + 1) * s.sk + g * s.D + db * 16))
                                         : _mm256_setzero_si256();
        r[p] = _mm512_castsi512_ps(_mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16)));
      }
      transpose16(r);  // r[d]: dim 16 db + d over the 16 pairs (32 keys)
      uint16_t* dst = vt + (g * s.D + db * 16) * ctxp + pb * kChunk;
      for (int d = 0; d < 16; ++d) _mm512_storeu_ps(reinterpret_cast<float*>(dst + d * ctxp), r[d]);
    }
  });
}

// C (fp32, NH heads x NA A tiles, at most 4 tiles) over nk steps of 32:
//   C[x * NH + h] += A_x (16 rows of lda at a0 + s * a_kstep + x * a_step) . B_h (b[h] + s * 256)
// Scores: A = 16 keys' rows of k (x: key blocks), B = a head's Q^T chunk of 32 dims. Weighted
// sums: A = 16 dims' rows of V^T (x: dim tiles), B = a head's P^T chunk of 32 keys. Heads of a
// KV head share every A load (GQA), A tiles of one head share its B load.
// NOTE: the tile macros take literal tile numbers, hence the branches per shape.
template <int NH, int NA>
inline void tile_mm(const uint16_t* a0, int64_t lda, int64_t a_kstep, int64_t a_step,
                    const uint32_t* const* b, int64_t nk, float* const* c) {
  static_assert(NH >= 1 && NA >= 1 && NH * NA <= 4 && (NH <= 2 || NA == 1), "tile shape");
  constexpr int NC = NH * NA;
  _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  const int64_t ldb = lda * 2;
  for (int64_t s = 0; s < nk; ++s) {
    const uint16_t* a = a0 + s * a_kstep;
    if constexpr (NH >= 3) {  // one A tile, three or four heads' B tiles
      _tile_loadd(4, a, ldb);
      _tile_loadd(5, b[0] + s * 256, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b[1] + s * 256, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b[2] + s * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (NH > 3) {
        _tile_loadd(5, b[3] + s * 256, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    } else if constexpr (NH == 2) {  // B tiles 6, 7; A tiles 4, 5
      _tile_loadd(6, b[0] + s * 256, 64);
      _tile_loadd(7, b[1] + s * 256, 64);
      _tile_loadd(4, a, ldb);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (NA > 1) {
        _tile_loadd(5, a + a_step, ldb);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    } else {  // one head: B tile 6; A tiles 4, 5 alternating
      _tile_loadd(6, b[0] + s * 256, 64);
      _tile_loadd(4, a, ldb);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NA > 1) {
        _tile_loadd(5, a + a_step, ldb);
        _tile_dpbf16ps(1, 5, 6);
      }
      if constexpr (NA > 2) {
        _tile_loadd(4, a + 2 * a_step, ldb);
        _tile_dpbf16ps(2, 4, 6);
      }
      if constexpr (NA > 3) {
        _tile_loadd(5, a + 3 * a_step, ldb);
        _tile_dpbf16ps(3, 5, 6);
      }
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (NC > 1) _tile_stored(1, c[1], 64);
  if constexpr (NC > 2) _tile_stored(2, c[2], 64);
  if constexpr (NC > 3) _tile_stored(3, c[3], 64);
}

// tile_mm for nh heads and na A tiles (nh * na <= 4; na == 1 from 3 heads on).
inline void tile_mm_n(int64_t nh, int64_t na, const uint16_t* a0, int64_t lda, int64_t a_kstep,
                      int64_t a_step, const uint32_t* const* b, int64_t nk, float* const* c) {
  switch (nh * 8 + na) {
    case 8 + 1: return tile_mm<1, 1>(a0, lda, a_kstep, a_step, b, nk, c);
    case 8 + 2: return tile_mm<1, 2>(a0, lda, a_kstep, a_step, b, nk, c);
    case 8 + 3: return tile_mm<1, 3>(a0, lda, a_kstep, a_step, b, nk, c);
    case 8 + 4: return tile_mm<1, 4>(a0, lda, a_kstep, a_step, b, nk, c);
    case 16 + 1: return tile_mm<2, 1>(a0, lda, a_kstep, a_step, b, nk, c);
    case 16 + 2: return tile_mm<2, 2>(a0, lda, a_kstep, a_step, b, nk, c);
    case 24 + 1: return tile_mm<3, 1>(a0, lda, a_kstep, a_step, b, nk, c);
    default: return tile_mm<4, 1>(a0, lda, a_kstep, a_step, b, nk, c);
  }
}

// A thread's scratch for one task: per head, Q^T pairs, scores and weights; a zero-padded copy
// of a key block reaching past ctx; C tiles for the output.
struct Scratch {
  explicit Scratch(const Shape& s, int64_t keys_) : keys(keys_) {
    // 64-byte aligned: the softmax's vector loads and stores are aligned
    mem.resize(size_t(4 * s.D / 2 * 16 + 4 * keys * 16 + 4 * (keys / 2) * 16 + 16 * s.D / 2 + 4 * 256) + 64);
    auto* base = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t(63));
    qp = base;
    st = reinterpret_cast<float*>(qp + 4 * s.D / 2 * 16);
    pp = reinterpret_cast<uint32_t*>(st + 4 * keys * 16);
    kz = reinterpret_cast<uint16_t*>(pp + 4 * (keys / 2) * 16);
    ob = reinterpret_cast<float*>(kz + 16 * s.D);
  }
  std::vector<uint32_t> mem;
  int64_t keys;   // keys a block reads at most (rounded as the loops round)
  uint32_t* qp;   // [4][D / 2][16]
  float* st;      // [4][keys][16]
  uint32_t* pp;   // [4][keys / 2][16]
  uint16_t* kz;   // [16][D]
  float* ob;      // [4][16][16]
};

// One task: heads h0 .. h0 + nh - 1 (nh <= 4, one KV head) x the block of 16 rows from i0.
// Keys are indexed in k / v (0 .. ctx - 1); vt's columns and pp's pairs are off later.
void attend_block(const uint16_t* q, const uint16_t* k, const uint16_t* vt, int64_t off,
                  int64_t ctxp, uint16_t* out, const Shape& s, int64_t h0, int64_t nh, int64_t i0,
                  Scratch& w) {
  const int64_t r = std::min<int64_t>(16, s.n - i0), g = h0 / (s.Hq / s.Hkv);
  const int64_t q0 = s.ctx - s.n;  // position of query row 0
  const int64_t hi = q0 + i0 + r;   // keys [lo, hi) seen by some row of the block
  const int64_t lo = s.window ? std::max<int64_t>(0, q0 + i0 - s.window + 1) : 0;
  const int64_t c0 = (lo + off) / kChunk * kChunk;  // vt column of the first 32-key chunk read
  const int64_t D = s.D, P2 = D / 2, DC = D / 32;
  const uint32_t* qps[4];
  float* sts[4];
  uint32_t* pps[4];
  for (int64_t u = 0; u < nh; ++u) {
    uint32_t* qp = w.qp + u * P2 * 16;  // Q^T pairs: qp[p][lane]
    for (int64_t p = 0; p < P2; ++p)
      for (int64_t i = 0; i < 16; ++i) {
        uint32_t val = 0;
        if (i < r) std::memcpy(&val, q + (i0 + i) * s.sq + (h0 + u) * D + 2 * p, 4);
        qp[p * 16 + i] = val;
      }
    qps[u] = qp;
    sts[u] = w.st + u * w.keys * 16;
    pps[u] = w.pp + u * (w.keys / 2) * 16;
  }
  // Scores of 16-key blocks [lo, hi rounded up to 16): the heads' tiles share each key tile; a
  // block reaching past ctx reads a zero-padded copy.
  const int64_t nkb = (hi - lo + 15) / 16, per = 4 / (nh >= 3 ? 4 : nh);  // key blocks per call
  const uint16_t* kbase = k + g * D;
  for (int64_t b0 = 0; b0 < nkb;) {
    const int64_t j0 = lo + b0 * 16;
    int64_t nb = std::min<int64_t>(per, nkb - b0);
    const uint16_t* a = kbase + j0 * s.sk;
    int64_t lda = s.sk;
    if (j0 + nb * 16 > s.ctx) {  // the last block reaches past ctx: the full blocks first
      if (nb > 1) {
        nb -= 1;
      } else {
        for (int64_t j = 0; j < 16; ++j) {
          if (j0 + j < s.ctx) std::memcpy(w.kz + j * D, kbase + (j0 + j) * s.sk, size_t(D) * 2);
          else std::memset(w.kz + j * D, 0, size_t(D) * 2);
        }
        a = w.kz;
        lda = D;
      }
    }
    float* c[4];
    for (int64_t x = 0; x < nb; ++x)
      for (int64_t u = 0; u < nh; ++u) c[x * nh + u] = sts[u] + (b0 + x) * 256;
    tile_mm_n(nh, nb, a, lda, 32, 16 * lda, qps, DC, c);
    b0 += nb;
  }
  // Softmax per head and lane over the keys its row sees (as the AVX512-BF16 kernel); the
  // chunks' keys before lo and from hi on weigh 0 in every lane.
  const int64_t nkeys = hi - lo, nch = (hi + off - c0 + kChunk - 1) / kChunk;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 pad = (__mmask16)~((1u << r) - 1);
  auto visible = [&](int64_t j) -> __mmask16 {
    const int64_t d = j - q0 - i0;  // row i sees j iff i >= d (and i < d + window)
    __mmask16 m = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(int(std::max<int64_t>(-1, std::min<int64_t>(16, d)))));
    if (s.window) m &= _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(int(std::max<int64_t>(-1, std::min<int64_t>(17, d + s.window)))));
    return m | pad;
  };
  // keys every row sees (most of a long context): no mask to build
  const int64_t fa = s.window ? std::max<int64_t>(lo, q0 + i0 + r - s.window) : lo, fb = q0 + i0 + 1;
  auto mask = [&](int64_t j) -> __mmask16 { return j >= fa && j < fb ? __mmask16(0xFFFF) : visible(j); };
  const __m512 sc = _mm512_set1_ps(s.scale);
  __m512 inv[4];
  for (int64_t u = 0; u < nh; ++u) {
    const float* st = sts[u];
    uint32_t* pp = pps[u];
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nkeys; ++j)
      mx = _mm512_mask_max_ps(mx, mask(lo + j), mx, _mm512_mul_ps(_mm512_load_ps(st + j * 16), sc));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nch * 16; ++t) {
      __m512 e[2];
      for (int u2 = 0; u2 < 2; ++u2) {
        const int64_t j = c0 - off + 2 * t + u2 - lo;  // index into st (keys from lo)
        if (j >= 0 && j < nkeys) {
          const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(st + j * 16), sc), mx);
          e[u2] = _mm512_maskz_mov_ps(mask(lo + j), v16::v_exp_neg(v16::V16{x}).v);
        } else {
          e[u2] = _mm512_setzero_ps();
        }
        sum = _mm512_add_ps(sum, e[u2]);
      }
      const __m512i a32 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[0]));
      const __m512i b32 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[1]));
      _mm512_store_si512(pp + t * 16, _mm512_or_si512(a32, _mm512_slli_epi32(b32, 16)));
    }
    inv[u] = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
  }
  // O^T: the heads' tiles share each V^T tile (16 dims); each tile transposed into out's rows.
  const uint16_t* vg = vt + g * D * ctxp + c0;
  const int64_t DT = D / 16, per_t = 4 / (nh >= 3 ? 4 : nh);  // dim tiles per call
  for (int64_t t0 = 0; t0 < DT; t0 += per_t) {
    const int64_t nt = std::min<int64_t>(per_t, DT - t0);
    float* c[4];
    for (int64_t x = 0; x < nt * nh; ++x) c[x] = w.ob + x * 256;
    tile_mm_n(nh, nt, vg + t0 * 16 * ctxp, ctxp, kChunk, 16 * ctxp, pps, nch, c);
    for (int64_t x = 0; x < nt; ++x)
      for (int64_t u = 0; u < nh; ++u) {
        __m512 rr[16];
        const float* o = c[x * nh + u];
        for (int d = 0; d < 16; ++d) rr[d] = _mm512_mul_ps(_mm512_load_ps(o + d * 16), inv[u]);
        transpose16(rr);  // rr[i]: row i's 16 dims
        for (int64_t i = 0; i < r; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i0 + i) * s.so + (h0 + u) * D + (t0 + x) * 16),
                              (__m256i)_mm512_cvtneps_pbh(rr[i]));
      }
  }
}

void run(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, const Shape& s,
         int64_t key_start) {
  const int64_t off = key_start % kChunk, ctxp = (off + s.ctx + kChunk - 1) / kChunk * kChunk;
  std::vector<uint16_t> vt(size_t(s.Hkv * s.D * ctxp));
  pack_vt(v, s, off, ctxp, vt.data());
  // tasks: (KV head, block of 16 rows, group of up to 4 of its query heads)
  const int64_t G = s.Hq / s.Hkv, hg = (G + 3) / 4, blocks = (s.n + 15) / 16;
  at::parallel_for(0, s.Hkv * blocks * hg, 1, [&](int64_t b, int64_t e) {
    // keys a block reads: its window (or the context) plus its 16 rows, from a multiple of 32
    Scratch w(s, std::min<int64_t>(ctxp, s.window ? s.window + 16 + 2 * kChunk : ctxp) + 2 * kChunk);
    amx_config();
    for (int64_t t = b; t < e; ++t) {
      const int64_t gi = t / (blocks * hg), blk = (t / hg) % blocks, sub = t % hg;
      const int64_t h0 = gi * G + sub * 4;
      attend_block(q, k, vt.data(), off, ctxp, out, s, h0, std::min<int64_t>(4, G - sub * 4),
                   blk * 16, w);
    }
    _tile_release();
  });
}

}  // namespace isa_amx
}  // namespace
#pragma GCC pop_options

// The same attention on AVX2 + FMA CPUs (no BF16 dot products): every value widened to fp32.
// For each query head and block of 16 query rows (rows in the lanes of a V16): scores of 4 keys
// at a time (each key's dimensions broadcast against the rows' q, FMA in dimension order), an
// exact softmax per lane over the keys the row sees, then the weights, rounded to bf16 as the
// AVX512-BF16 kernel and torch's bf16 SDPA round them (their sum is not), times V (16
// dimensions of 4 rows at a time, keys in order). Every lane accumulates its row's sums key by
// key from the block's first key, and keys a row does not see add exact zeros: a row's result
// does not depend on the rows, chunk or tile beside it (chunked prefill is exact here as on
// AVX512-BF16; the two ISAs' bits differ).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace isa_avx2 {
#define PS_VEC 256
#include "vec16.h"
#undef PS_VEC

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Lanes i (rows i0 + i) that see key j: j <= p_i and (with a window) p_i - j < window, p_i the
// row's position; lanes past the block's r rows see every key (their results are dropped).
inline V16 visible(int64_t j, int64_t p0, int64_t r, int64_t window) {
  const float d = float(j - p0);  // row i sees j iff i >= d (and i < d + window)
  const __m256 l0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), l1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 vd = _mm256_set1_ps(d), rr = _mm256_set1_ps(float(r));
  __m256 m0 = _mm256_cmp_ps(l0, vd, _CMP_GE_OQ), m1 = _mm256_cmp_ps(l1, vd, _CMP_GE_OQ);
  if (window) {
    const __m256 w = _mm256_set1_ps(d + float(window));
    m0 = _mm256_and_ps(m0, _mm256_cmp_ps(l0, w, _CMP_LT_OQ));
    m1 = _mm256_and_ps(m1, _mm256_cmp_ps(l1, w, _CMP_LT_OQ));
  }
  m0 = _mm256_or_ps(m0, _mm256_cmp_ps(l0, rr, _CMP_GE_OQ));
  m1 = _mm256_or_ps(m1, _mm256_cmp_ps(l1, rr, _CMP_GE_OQ));
  return {m0, m1};
}
inline V16 select(V16 m, V16 a, V16 b) {  // m ? a : b
  return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}

// Keys per chunk of the weighted sum of values: a chunk's values (128 keys x D, 64 KiB at D = 256)
// stay in L2 while the block's (4 rows x 16 dimensions) tiles walk them. Up to kPvWhole keys (a
// 512-key window and its block) go in one pass: there the round trips of the partial sums cost
// more than the values' reads (2,048 rows, window 512: ~5%).
constexpr int64_t kPvKeys = 128, kPvWhole = 640;

// One (query head, block of 16 rows) task. qf: [D][16], kf: [4][D], st: [keys][16], ps: [16][D]
// scratch.
void attend_block(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                  const Shape& s, int64_t h, int64_t i0, float* qf, float* kf, float* st, float* ps) {
  const int64_t r = std::min<int64_t>(16, s.n - i0), g = h / (s.Hq / s.Hkv);
  const int64_t p0 = s.ctx - s.n + i0;  // position of the block's first row
  const int64_t hi = p0 + r;            // keys [lo, hi) seen by some row of the block
  const int64_t lo = s.window ? std::max<int64_t>(0, p0 - s.window + 1) : 0;
  const int64_t D = s.D;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < 16; ++i)
      qf[d * 16 + i] = i < r ? bf16_to_f32(q[(i0 + i) * s.sq + h * D + d]) : 0.0f;
  // Scores, 4 keys at a time (keys past hi: zeros, never stored).
  for (int64_t j0 = lo; j0 < hi; j0 += 4) {
    const int64_t nk = std::min<int64_t>(4, hi - j0);
    for (int64_t t = 0; t < 4; ++t) {
      if (t < nk) {
        const uint16_t* kr = k + (j0 + t) * s.sk + g * D;
        for (int64_t d = 0; d < D; d += 16) v_store(kf + t * D + d, v_load_bf16(kr + d));
      } else {
        std::memset(kf + t * D, 0, size_t(D) * sizeof(float));
      }
    }
    V16 a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
    for (int64_t d = 0; d < D; ++d) {
      const V16 qv = v_load(qf + d * 16);
      a0 = v_fmadd(qv, v_set1(kf[d]), a0);
      a1 = v_fmadd(qv, v_set1(kf[D + d]), a1);
      a2 = v_fmadd(qv, v_set1(kf[2 * D + d]), a2);
      a3 = v_fmadd(qv, v_set1(kf[3 * D + d]), a3);
    }
    const V16 acc[4] = {a0, a1, a2, a3};
    for (int64_t t = 0; t < nk; ++t) v_store(st + (j0 + t - lo) * 16, acc[t]);
  }
  // Softmax per lane over the keys its row sees.
  const int64_t nkeys = hi - lo;
  const V16 sc = v_set1(s.scale);
  V16 mx = v_set1(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nkeys; ++j)
    mx = select(visible(lo + j, p0, r, s.window), v_max(mx, v_mul(v_load(st + j * 16), sc)), mx);
  V16 sum = v_zero();
  for (int64_t j = 0; j < nkeys; ++j) {
    const V16 e = select(visible(lo + j, p0, r, s.window),
                         v_exp_neg(v_sub(v_mul(v_load(st + j * 16), sc), mx)), v_zero());
    v_store(st + j * 16, v_round_bf16(e));  // the weights times V rounded to bf16, as on AVX512-BF16
    sum = v_add(sum, e);                     // (and torch's bf16 SDPA); their sum unrounded
  }
  alignas(64) float inv[16];
  {
    alignas(64) float tot[16];
    v_store(tot, sum);
    for (int i = 0; i < 16; ++i) inv[i] = 1.0f / tot[i];
  }
  // Weighted sum of values: 4 rows x 16 dimensions at a time, keys in order, over chunks of
  // kPvKeys keys; between chunks the partial sums wait in ps (long contexts: the values are read
  // from memory once per block, not once per tile). NOTE: fp32 partial sums stored and reloaded
  // are exact: every lane still adds its keys in order from zero, one FMA each.
  const int64_t chunk = nkeys <= kPvWhole ? nkeys : kPvKeys;
  for (int64_t j0 = 0; j0 < nkeys; j0 += chunk) {
    const int64_t j1 = std::min<int64_t>(nkeys, j0 + chunk);
    const bool first = j0 == 0, last = j1 == nkeys;
    for (int64_t ig = 0; ig < r; ig += 4) {
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        float* pr = ps + ig * D + d0;  // rows ig .. ig + 3 (< 16) of the partial sums
        V16 a0 = first ? v_zero() : v_load(pr), a1 = first ? v_zero() : v_load(pr + D);
        V16 a2 = first ? v_zero() : v_load(pr + 2 * D), a3 = first ? v_zero() : v_load(pr + 3 * D);
        for (int64_t j = j0; j < j1; ++j) {
          const V16 vv = v_load_bf16(v + (lo + j) * s.sk + g * D + d0);
          const float* w = st + j * 16 + ig;
          a0 = v_fmadd(v_set1(w[0]), vv, a0);
          a1 = v_fmadd(v_set1(w[1]), vv, a1);
          a2 = v_fmadd(v_set1(w[2]), vv, a2);
          a3 = v_fmadd(v_set1(w[3]), vv, a3);
        }
        const V16 acc[4] = {a0, a1, a2, a3};
        if (last) {
          for (int64_t t = 0; t < 4 && ig + t < r; ++t)
            v_store_bf16(out + (i0 + ig + t) * s.so + h * D + d0, v_mul(acc[t], v_set1(inv[ig + t])));
        } else {
          for (int64_t t = 0; t < 4; ++t) v_store(pr + t * D, acc[t]);
        }
      }
    }
  }
}

void run(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, const Shape& s) {
  const int64_t blocks = (s.n + 15) / 16;
  at::parallel_for(0, s.Hq * blocks, 1, [&](int64_t b, int64_t e) {
    const int64_t keys = std::min<int64_t>(s.ctx, s.window ? s.window + 16 : s.ctx) + 16;
    std::vector<float> qf(size_t(s.D * 16)), kf(size_t(4 * s.D)), st(size_t(keys * 16)), ps(size_t(16 * s.D));
    for (int64_t t = b; t < e; ++t)
      attend_block(q, k, v, out, s, t % s.Hq, (t / s.Hq) * 16, qf.data(), kf.data(), st.data(), ps.data());
  });
}

}  // namespace isa_avx2
}  // namespace
#pragma GCC pop_options

namespace {

void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, double scale, int64_t window, int64_t isa,
                       int64_t key_start) {
  ps_isa::check_isa("prefill_attention", isa);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention: bfloat16 tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "prefill_attention: q, out [n, Hq, D]; k, v [ctx, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2), "prefill_attention: k / v shapes");
  for (const at::Tensor* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "prefill_attention: CPU tensors with contiguous heads");
  Shape s{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2),
          q.stride(0), k.stride(0), out.stride(0), float(scale), window};
  TORCH_CHECK(v.stride(0) == s.sk, "prefill_attention: k and v with the same row stride");
  TORCH_CHECK(s.D % 32 == 0 && s.D <= 1024, "prefill_attention: head_dim a multiple of 32, <= 1024");
  TORCH_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0, "prefill_attention: Hq a multiple of Hkv");
  TORCH_CHECK(s.n <= s.ctx && window >= 0 && key_start >= 0,
              "prefill_attention: n <= ctx, window >= 0, key_start >= 0");
  if (s.n == 0) return;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (isa >= ps_isa::kIsaAmx) isa_amx::run(qp, kp, vp, op, s, key_start);
  else if (ps_isa::use_avx512(isa)) isa_avx512bf16::run(qp, kp, vp, op, s);
  else isa_avx2::run(qp, kp, vp, op, s);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float scale, int window, "
        "int isa, int key_start=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
