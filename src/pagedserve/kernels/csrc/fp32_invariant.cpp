// Batch-invariant float32 kernels for x86-64 CPUs (AVX-512F, or AVX2 + FMA): a row's result
// depends only on that row's own inputs -- never on how many other rows share the call, how the
// work is tiled, or how many threads run it.
//
//   fp32_linear(x [M, K], w [N, K], bias [N] or None) -> y [M, N],  y[m, n] = x[m] . w[n] + bias[n]
//     The reduction over K is fixed (fp32_invariant_isa.h): 16 lanes, lane j accumulating the
//     products of k = j, j + 16, ... in order with fused multiply-adds, then a fixed tree over the
//     lanes, then the bias. Work is split over (row block, column block) tiles only, never over K.
//     torch's F.linear (MKL / oneDNN) picks its blocking and kernels by M, so a row's bits change
//     with the batch it is in.
//
//   fp32_paged_attention(query [T, Hq, D], k_cache, v_cache [N, B, Hkv, D], block_tables [S, MB],
//                        seq_lens [S], query_start_loc [S + 1], scale, window, softcap) -> [T, Hq, D]
//     Every query token -- a decode row, or a token of a prompt chunk with or without cached
//     context -- is attended alone, the same way: keys t in [start, ctx) of its own sequence, read
//     through the block table in increasing t, two passes (scores, then softmax weights times
//     values), where ctx = its own context length (the positions up to and including itself) and
//     start = max(0, ctx - window) for a sliding window (0: none); softcap > 0 caps each score as
//     softcap * tanh(score / softcap) before the softmax (Gemma 2). So its bits depend only on its
//     own query and context, not on how the prompt was chunked or what else is in the step. The
//     step's new K/V must already be in the cache. The caches are float32, or fp8 (float8_e4m3fn /
//     float8_e5m2, kv_cache_dtype): each row widened exactly to fp32 as it is read (attend_fp8),
//     the same bits as a float32 cache holding the same values. fp32_paged_attention_sinks(..., sinks [Hq], isa):
//     the same with a sink logit per query head in each softmax's denominator (gpt-oss).
//
//   fp32_activation(x, act) -> silu(x) (act 0), gelu_tanh(x) (act 1) or sigmoid(x) (act 2), every element by one
//     lane-wise vector formula (our exp), whatever the tensor's size and the thread count --
//     torch's loops do not guarantee that.
//
// Same machine => same ISA => same bits; the two ISAs also agree with each other (the AVX2 vector
// is two 8-lane halves of the same 16 lanes). Compiled without -m flags: the SIMD code sits in
// `#pragma GCC target` regions and runs only after `fp32_isa()` (cpu_isa.h's detection, one for
// every extension) says the CPU has it; and with
// -ffp-contract=off, so the compiler fuses nothing the source does not. Registered as
// torch.ops.pagedserve_fp32.*; the Python wrapper is pagedserve/kernels/cpu_fp32.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxGroup = 64;  // query heads per KV head
// The linear splits K into blocks of kBlockK (a multiple of 16) above kSplitK (see linear_block).
constexpr int64_t kBlockK = 512, kSplitK = 768;
using ps_isa::kIsaAvx2;
using ps_isa::kIsaAvx512;
using ps_isa::kIsaNone;

// The best of this file's two ISAs the CPU runs: cpu_isa.h's one detection (every extension's),
// capped at AVX-512 (the levels above add nothing used here).
int64_t best_isa() { return std::min<int64_t>(ps_isa::cpu_isa(), kIsaAvx512); }

// The end of both ISAs' horizontal sums, from 8 lanes: (lo4 + hi4) -> 4, then (0+2, 1+3), then
// (0 + 1). NOTE: one order for both, so that AVX2 and AVX-512 give the same bits.
__attribute__((target("avx"), always_inline)) inline float hsum8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace {
namespace isa_avx512 {
constexpr int MR = 4, NR = 6;  // 24 accumulators + 4 x rows + 1 w row of the 32 zmm registers
constexpr int ATT_GH = 4, ATT_DV = 4;
struct V {
  __m512 r;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V set1(float a) { return {_mm512_set1_ps(a)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V load_tail(const float* p, int n) {
    return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
  }
  static V fmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }
  static V fnmadd(V a, V b, V c) { return {_mm512_fnmadd_ps(a.r, b.r, c.r)}; }
  static V add(V a, V b) { return {_mm512_add_ps(a.r, b.r)}; }
  static V mul(V a, V b) { return {_mm512_mul_ps(a.r, b.r)}; }
  static V div(V a, V b) { return {_mm512_div_ps(a.r, b.r)}; }
  static V clamp(V a, float lo, float hi) {
    return {_mm512_min_ps(_mm512_max_ps(a.r, _mm512_set1_ps(lo)), _mm512_set1_ps(hi))};
  }
  static V round(V a) { return {_mm512_roundscale_ps(a.r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  // 2^n for integral n in [-126, 127]
  static V pow2(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.r), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, r); }
  void store_tail(float* p, int n) const {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), r);
  }
  // 16 bf16 values widened exactly; and rounded to nearest even (a NaN stays a quiet NaN)
  static V load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  __m512i bf16_bits() const {  // each lane's bf16, in its low 16 bits
    const __m512i u = _mm512_castps_si512(r);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  }
  void store_bf16(uint16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits()));
  }
  // the value store_bf16 then load_bf16 give, without the memory round trip
  V round_bf16() const { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(), 16))}; }
  // 16 fp8 values (E5M2, else E4M3FN) widened exactly to fp32 by integer operations: the sign,
  // a normal value's exponent and mantissa rebiased in place, a subnormal as mantissa x
  // 2^(1 - bias - M), the formats' NaN / infinity codes (the same bits as torch's conversion and
  // as csrc/vec16.h's v_load_fp8).
  template <bool E5M2>
  static V load_fp8(const uint8_t* p) {
    constexpr int M = E5M2 ? 2 : 3, BIAS = E5M2 ? 15 : 7;
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i em = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 23 - M), _mm512_set1_epi32((127 - BIAS) << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / float(1 << (BIAS + M - 1))));
    __m512i mag = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(1 << M)), normal,
                                          _mm512_castps_si512(sub));
    if (E5M2) {
      mag = _mm512_mask_mov_epi32(mag, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7C)), _mm512_set1_epi32(0x7F800000));
      mag = _mm512_mask_mov_epi32(mag, _mm512_cmpgt_epi32_mask(em, _mm512_set1_epi32(0x7C)), _mm512_set1_epi32(0x7FC00000));
    } else {
      mag = _mm512_mask_mov_epi32(mag, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7FC00000));
    }
    return {_mm512_castsi512_ps(_mm512_or_si512(mag, sign))};
  }
  // ((((l0..7 + l8..15) -> 8) lo4 + hi4) -> 4) then (0+2, 1+3) then (0 + 1)
  float hsum() const {
    const __m256 lo = _mm512_castps512_ps256(r);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1));
    return hsum8(_mm256_add_ps(lo, hi));
  }
};
#include "fp32_invariant_isa.h"
}  // namespace isa_avx512
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace isa_avx2 {
constexpr int MR = 2, NR = 3;  // 6 accumulators of 2 ymm + 2 x rows of 2 + 1 w row of 2 = 18 of 16
constexpr int ATT_GH = 2, ATT_DV = 2;
struct V {
  __m256 a, b;  // lanes 0..7, 8..15
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V load_tail(const float* p, int n) {
    alignas(32) float buf[16] = {};
    std::memcpy(buf, p, sizeof(float) * n);
    return {_mm256_load_ps(buf), _mm256_load_ps(buf + 8)};
  }
  static V fmadd(V x, V y, V c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
  static V fnmadd(V x, V y, V c) { return {_mm256_fnmadd_ps(x.a, y.a, c.a), _mm256_fnmadd_ps(x.b, y.b, c.b)}; }
  static V add(V x, V y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  static V mul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static V div(V x, V y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
  static V clamp(V x, float lo, float hi) {
    const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    return {_mm256_min_ps(_mm256_max_ps(x.a, l), h), _mm256_min_ps(_mm256_max_ps(x.b, l), h)};
  }
  static V round(V x) {
    constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(x.a, kMode), _mm256_round_ps(x.b, kMode)};
  }
  static __m256 pow2_half(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static V pow2(V n) { return {pow2_half(n.a), pow2_half(n.b)}; }
  void store(float* p) const {
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + 8, b);
  }
  void store_tail(float* p, int n) const {
    alignas(32) float buf[16];
    store(buf);
    std::memcpy(p, buf, sizeof(float) * n);
  }
  // 16 bf16 values widened exactly; and rounded to nearest even (a NaN stays a quiet NaN)
  static __m256 widen_half(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V load_bf16(const uint16_t* p) { return {widen_half(p), widen_half(p + 8)}; }
  static __m256i round_half(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(h, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  }
  // the value store_bf16 then load_bf16 give, without the memory round trip
  V round_bf16() const {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(round_half(a), 16)), _mm256_castsi256_ps(_mm256_slli_epi32(round_half(b), 16))};
  }
  void store_bf16(uint16_t* p) const {
    // packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, then the quads back in order
    const __m256i packed = _mm256_packus_epi32(round_half(a), round_half(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  // 16 fp8 values widened exactly to fp32 (as the AVX-512 struct's load_fp8, 8 lanes at a time)
  template <bool E5M2>
  static __m256 fp8_half(__m128i raw) {
    constexpr int M = E5M2 ? 2 : 3, BIAS = E5M2 ? 15 : 7;
    const __m256i x = _mm256_cvtepu8_epi32(raw);
    const __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 23 - M), _mm256_set1_epi32((127 - BIAS) << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / float(1 << (BIAS + M - 1))));
    __m256i mag = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub),
                                     _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << M), em));
    if (E5M2) {
      mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7F800000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7C)));
      mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7FC00000), _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7C)));
    } else {
      mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
    }
    return _mm256_castsi256_ps(_mm256_or_si256(mag, sign));
  }
  template <bool E5M2>
  static V load_fp8(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {fp8_half<E5M2>(raw), fp8_half<E5M2>(_mm_srli_si128(raw, 8))};
  }
  float hsum() const {
    return hsum8(_mm256_add_ps(a, b));
  }
};
#include "fp32_invariant_isa.h"
}  // namespace isa_avx2
}  // namespace
#pragma GCC pop_options

namespace {

int64_t pick_isa(int64_t requested, const char* op) {
  const int64_t best = best_isa();
  TORCH_CHECK(best != kIsaNone, op, ": this CPU has neither AVX-512F nor AVX2 + FMA");
  if (requested == 0) return best;
  TORCH_CHECK(requested == kIsaAvx2 || requested == kIsaAvx512, op, ": isa must be 0, 1 or 2");
  TORCH_CHECK(requested <= best, op, ": this CPU lacks the requested ISA");
  return requested;
}

// Block sizes for the parallel split (they change only which thread computes a tile, never a bit).
constexpr int64_t kBlockM = 64, kBlockN = 48;  // kBlockN: a multiple of both NRs

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "fp32_linear: float32 x and weight only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 2 && w.is_contiguous(),
              "fp32_linear: contiguous x [M, K] and weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "fp32_linear: x and weight disagree on K");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(),
                "fp32_linear: bias must be a contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  const int64_t use = pick_isa(isa, "fp32_linear");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t mb = (M + kBlockM - 1) / kBlockM, nb = (N + kBlockN - 1) / kBlockN;
  at::parallel_for(0, mb * nb, 1, [&](int64_t b, int64_t e) {
    // accumulators of every tile of a block between K blocks
    std::vector<float> spill(K > kSplitK ? size_t(16 * (kBlockM + 4) * (kBlockN + 8)) : 0);
    for (int64_t task = b; task < e; ++task) {
      // column blocks outer: consecutive tasks of a thread share a block of W
      const int64_t bn = task / mb, bm = task % mb;
      const int64_t m0 = bm * kBlockM, m1 = std::min(M, m0 + kBlockM);
      const int64_t n0 = bn * kBlockN, n1 = std::min(N, n0 + kBlockN);
      if (K == 0) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t n = n0; n < n1; ++n) yp[m * N + n] = bp ? 0.f + bp[n] : 0.f;
      } else if (use == kIsaAvx512) {
        isa_avx512::linear_block(xp, wp, bp, yp, K, N, m0, m1, n0, n1, spill.data());
      } else {
        isa_avx2::linear_block(xp, wp, bp, yp, K, N, m0, m1, n0, n1, spill.data());
      }
    }
  });
  return y;
}

at::Tensor paged_attention_impl(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                double scale, int64_t window, double softcap, int64_t isa,
                                const float* sinks) {
  const auto cache_type = k_cache.scalar_type();
  const bool fp8 = cache_type == at::ScalarType::Float8_e4m3fn || cache_type == at::ScalarType::Float8_e5m2;
  TORCH_CHECK(query.scalar_type() == at::kFloat && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || fp8),
              "fp32_paged_attention: a float32 query; float32 or fp8 (e4m3fn / e5m2) caches");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "fp32_paged_attention: query [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "fp32_paged_attention: caches [N, B, Hkv, D], contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous(),
              "fp32_paged_attention: int64 block_tables [S, MB], seq_lens [S], query_start_loc [S+1]");
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t NB = k_cache.size(0), B = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t S = seq_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D > 0, "fp32_paged_attention: head_dim");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "fp32_paged_attention: heads");
  TORCH_CHECK(block_tables.size(0) == S && query_start_loc.size(0) == S + 1,
              "fp32_paged_attention: one block table row and query span per sequence");
  const int64_t use = pick_isa(isa, "fp32_paged_attention");
  const auto* lens = seq_lens.data_ptr<int64_t>();
  const auto* qsl = query_start_loc.data_ptr<int64_t>();
  const auto* bt = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[S] == T, "fp32_paged_attention: query_start_loc must span [0, T]");
  // Per token: its sequence and its own context length.
  std::vector<int64_t> tok_seq(T), tok_ctx(T);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s];
    TORCH_CHECK(n >= 0 && n <= lens[s] && lens[s] <= MB * B,
                "fp32_paged_attention: seq_lens / query_start_loc out of range");
    for (int64_t i = 0; i * B < lens[s]; ++i)  // the blocks the context occupies
      TORCH_CHECK(bt[s * MB + i] >= 0 && bt[s * MB + i] < NB,
                  "fp32_paged_attention: block table entry out of range");
    for (int64_t i = 0; i < n; ++i) {
      tok_seq[qsl[s] + i] = s;
      tok_ctx[qsl[s] + i] = lens[s] - n + i + 1;
    }
  }
  const int64_t G = Hq / Hkv;
  at::Tensor out = at::empty({T, Hq, D}, query.options());
  if (T == 0) return out;
  const float* qp = query.data_ptr<float>();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  const bool e5m2 = cache_type == at::ScalarType::Float8_e5m2;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, T * Hkv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qs(G * D), acc(G * D), scores, rows;  // rows: fp8 rows widened
    std::vector<const float*> ptrs;
    for (int64_t pair = b; pair < e; ++pair) {
      const int64_t t = pair / Hkv, h = pair % Hkv;
      const int64_t ctx = tok_ctx[t], s = tok_seq[t];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      scores.resize(size_t(G * (ctx - start)));
      ptrs.resize(size_t(ctx - start));
      const float* q = qp + (t * Hq + h * G) * D;
      float* o = op + (t * Hq + h * G) * D;
      const float* sink = sinks ? sinks + h * G : nullptr;
      if (fp8) {  // the convert-on-load path (attend_fp8 in fp32_invariant_isa.h)
        rows.resize(size_t((ctx - start) * D));
        const auto* k8 = static_cast<const uint8_t*>(kp) + h * D;
        const auto* v8 = static_cast<const uint8_t*>(vp) + h * D;
        if (use == kIsaAvx512)
          isa_avx512::attend_fp8(e5m2, q, k8, v8, bt + s * MB, ctx, start, B, Hkv * D, G, D, sc,
                                 cap, o, qs.data(), scores.data(), acc.data(), ptrs.data(),
                                 rows.data(), sink);
        else
          isa_avx2::attend_fp8(e5m2, q, k8, v8, bt + s * MB, ctx, start, B, Hkv * D, G, D, sc,
                               cap, o, qs.data(), scores.data(), acc.data(), ptrs.data(),
                               rows.data(), sink);
        continue;
      }
      const float* kf = static_cast<const float*>(kp) + h * D;
      const float* vf = static_cast<const float*>(vp) + h * D;
      if (use == kIsaAvx512)
        isa_avx512::attend(q, kf, vf, bt + s * MB, ctx, start, B, Hkv * D, G, D,
                           sc, cap, o, qs.data(), scores.data(), acc.data(), ptrs.data(), sink);
      else
        isa_avx2::attend(q, kf, vf, bt + s * MB, ctx, start, B, Hkv * D, G, D, sc,
                         cap, o, qs.data(), scores.data(), acc.data(), ptrs.data(), sink);
    }
  });
  return out;
}

at::Tensor fp32_paged_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                double scale, int64_t window, double softcap, int64_t isa) {
  return paged_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              scale, window, softcap, isa, nullptr);
}

// The same with attention sinks (gpt-oss): sinks [Hq] float32, one logit per query head in each
// softmax's denominator (its weight dropped). NOTE: its own op, so the plain op's schema stays.
at::Tensor fp32_paged_attention_sinks(const at::Tensor& query, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                      double scale, int64_t window, const at::Tensor& sinks,
                                      int64_t isa) {
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.is_contiguous() &&
                  sinks.size(0) == query.size(1),
              "fp32_paged_attention_sinks: sinks must be a contiguous float32 [Hq]");
  return paged_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              scale, window, 0.0, isa, sinks.data_ptr<float>());
}

// Activations: every element by the same lane-wise vector formula (isa header), the tail too
// (zero-filled lanes), never a scalar path: torch's vectorized loops send each parallel chunk's
// last elements through a scalar path whose exp/tanh round differently from the vector ones, and
// where chunks end depends on the tensor's size and the thread count.
// bf16 x: the same fp32 formula on each widened value, rounded to bf16 once (y bf16).
at::Tensor fp32_activation(const at::Tensor& x, int64_t act, int64_t isa) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && x.is_contiguous(),
              "fp32_activation: contiguous float32 or bfloat16 input only");
  TORCH_CHECK(act >= 0 && act <= 2, "fp32_activation: act must be 0 (silu), 1 (gelu tanh) or 2 (sigmoid)");
  const int64_t use = pick_isa(isa, "fp32_activation");
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.numel(), groups = (n + 15) / 16;
  at::parallel_for(0, groups, 1024, [&](int64_t b, int64_t e) {
    const int64_t i0 = b * 16, i1 = std::min(n, e * 16);
    if (bf16) {
      const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr()) + i0;
      auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr()) + i0;
      if (use == kIsaAvx512)
        isa_avx512::activation_bf16(xp, yp, i1 - i0, act);
      else
        isa_avx2::activation_bf16(xp, yp, i1 - i0, act);
      return;
    }
    const float* xp = x.data_ptr<float>() + i0;
    float* yp = y.data_ptr<float>() + i0;
    if (use == kIsaAvx512)
      isa_avx512::activation(xp, yp, i1 - i0, act);
    else
      isa_avx2::activation(xp, yp, i1 - i0, act);
  });
  return y;
}

// act(gate) * up in one pass (a gated MLP's middle): the bits of fp32_activation(gate) then
// torch's product (`gated` in the isa header), each element by the same vector formula. gate and
// up: [T, N], rows contiguous (column views of one fused projection's output allowed).
at::Tensor fp32_gated_activation(const at::Tensor& gate, const at::Tensor& up, int64_t act, int64_t isa) {
  const bool bf16 = gate.scalar_type() == at::kBFloat16;
  TORCH_CHECK((gate.scalar_type() == at::kFloat || bf16) && up.scalar_type() == gate.scalar_type(),
              "fp32_gated_activation: gate and up must both be float32 or both bfloat16");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "fp32_gated_activation: gate and up must be [T, N] with contiguous rows");
  TORCH_CHECK(act >= 0 && act <= 2, "fp32_gated_activation: act must be 0 (silu), 1 (gelu tanh) or 2 (sigmoid)");
  const int64_t use = pick_isa(isa, "fp32_gated_activation");
  const int64_t T = gate.size(0), N = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  at::Tensor y = at::empty({T, N}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || N == 0) return y;
  const int64_t grain = std::max<int64_t>(1, 16384 / N);  // rows per task: ~16k elements
  at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bf16) {
        const auto* gp = reinterpret_cast<const uint16_t*>(gate.data_ptr()) + r * gs;
        const auto* upp = reinterpret_cast<const uint16_t*>(up.data_ptr()) + r * us;
        auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr()) + r * N;
        if (use == kIsaAvx512)
          isa_avx512::gated_bf16(gp, upp, yp, N, act);
        else
          isa_avx2::gated_bf16(gp, upp, yp, N, act);
      } else {
        const float* gp = gate.data_ptr<float>() + r * gs;
        const float* upp = up.data_ptr<float>() + r * us;
        float* yp = y.data_ptr<float>() + r * N;
        if (use == kIsaAvx512)
          isa_avx512::gated(gp, upp, yp, N, act);
        else
          isa_avx2::gated(gp, upp, yp, N, act);
      }
    }
  });
  return y;
}

int64_t fp32_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY(pagedserve_fp32, m) {
  m.def("fp32_isa() -> int", &fp32_isa);  // catch-all: no tensor arguments to dispatch on
  m.def("fp32_activation(Tensor x, int act, int isa) -> Tensor");
  m.def("fp32_gated_activation(Tensor gate, Tensor up, int act, int isa) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor");
  m.def(
      "fp32_paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int window, float softcap, int isa) "
      "-> Tensor");
  m.def(
      "fp32_paged_attention_sinks(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int window, Tensor sinks, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_fp32, CPU, m) {
  m.impl("fp32_activation", &fp32_activation);
  m.impl("fp32_gated_activation", &fp32_gated_activation);
  m.impl("fp32_linear", &fp32_linear);
  m.impl("fp32_paged_attention", &fp32_paged_attention);
  m.impl("fp32_paged_attention_sinks", &fp32_paged_attention_sinks);
}
