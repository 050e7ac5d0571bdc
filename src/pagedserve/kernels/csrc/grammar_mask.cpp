// Structured outputs on CPU: a grammar's token bitmask applied to fp32 logits, without xgrammar's
// per-element loop (tens of milliseconds for 16 rows of a 262,144-token vocabulary).
//
// The bitmask is xgrammar's layout: int32 words, ceil(V / 32) per row; bit j % 32 of word j / 32
// set means token j is allowed. Tokens past the mask's width (32 * words; vocabulary padding) are
// never allowed.
//
//   apply_token_bitmask(logits, bitmask, rows): logits[rows[g], j] = -inf for every token j that
//     bitmask[g] disallows (in place); all-ones words are skipped, all-zero words are plain stores.
//   masked_argmax(logits, bitmask, rows): per mask row g, the greedy token of logits[rows[g]]
//     among the tokens bitmask[g] allows, without writing the logits: what `argmax` of the masked row returns (the first
//     maximum; a NaN counts as the maximum), except that a row whose allowed logits are all -inf
//     gives its first allowed token (argmax would give token 0, which the grammar may forbid).
//     A row that allows nothing gives 0. All-zero words are skipped without reading the logits.
//
// Registered as torch.ops.pagedserve_grammar.*; the Python wrapper is
// pagedserve/kernels/cpu_grammar.py. No -m flags: the AVX2 code carries a target attribute and
// runs only where the CPU has AVX2 (`grammar_isa()`); elsewhere the scalar code does the same.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// cpu_isa.h's detection (one for every extension): AVX2 + FMA, with the OS saving the AVX state.
bool has_avx2() { return ps_isa::cpu_isa() >= ps_isa::kIsaAvx2; }

inline bool allowed(const int32_t* mask, int64_t j) {
  return (uint32_t(mask[j >> 5]) >> (j & 31)) & 1u;
}

// ---- masked argmax ----------------------------------------------------------------------------

// The running best of a row: `idx` < 0 while no allowed token was seen.
struct Best {
  float val = kNegInf;
  int64_t idx = -1;
};

// Tokens [base, base + n) of a word, one by one. Returns true when a NaN decided the row.
inline bool scan_scalar(const float* x, uint32_t bits, int64_t base, int n, Best& b) {
  for (int j = 0; j < n; ++j) {
    if (!((bits >> j) & 1u)) continue;
    const float v = x[base + j];
    if (std::isnan(v)) {
      b.idx = base + j;
      return true;
    }
    if (b.idx < 0 || v > b.val) b = Best{v, base + j};
  }
  return false;
}

int64_t masked_argmax_row_scalar(const float* x, int64_t V, const int32_t* mask, int64_t W) {
  Best b;
  for (int64_t w = 0; w < W && 32 * w < V; ++w) {
    const uint32_t bits = uint32_t(mask[w]);
    if (!bits) continue;
    const int n = int(std::min<int64_t>(32, V - 32 * w));
    if (scan_scalar(x, bits, 32 * w, n, b)) return b.idx;
  }
  return b.idx < 0 ? 0 : b.idx;
}

// ---- in-place mask, scalar (the AVX2 build is below) ----------------------------------------

void apply_row_scalar(float* x, int64_t V, const int32_t* mask, int64_t W) {
  for (int64_t j = 0; j < V; ++j)
    if (j >= 32 * W || !allowed(mask, j)) x[j] = kNegInf;
}

}  // namespace

// The AVX2 + FMA builds of both (cpu_isa.h's NOTE on ISA namespaces).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace isa_avx2 {

// 8 lanes of `bits` (from bit `shift`) as an all-ones / all-zeros lane mask.
inline __m256 lane_mask(uint32_t bits, int shift) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32(int32_t((bits >> shift) & 0xFFu));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), lane_bit));
}

int64_t masked_argmax_row(const float* x, int64_t V, const int32_t* mask, int64_t W) {
  Best b;
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const int64_t full = std::min<int64_t>(W, V / 32);  // words whose 32 tokens all exist
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = uint32_t(mask[w]);
    if (!bits) continue;
    const float* p = x + 32 * w;
    __m256 v[4];
    int nan_mask = 0;
    for (int k = 0; k < 4; ++k) {
      const __m256 raw = _mm256_loadu_ps(p + 8 * k);
      const __m256 keep = bits == 0xFFFFFFFFu ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                                               : lane_mask(bits, 8 * k);
      v[k] = _mm256_blendv_ps(ninf, raw, keep);  // disallowed lanes: -inf (never NaN)
      nan_mask |= _mm256_movemask_ps(_mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q)) << (8 * k);
    }
    if (nan_mask) {  // the first allowed NaN is the answer (earlier words had none)
      b.idx = 32 * w + __builtin_ctz(uint32_t(nan_mask));
      return b.idx;
    }
    __m256 m = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
    const float top = _mm256_cvtss_f32(m);
    if (b.idx >= 0 && !(top > b.val)) continue;
    if (top == kNegInf) {  // only when nothing allowed was seen yet: the first allowed token
      b = Best{kNegInf, 32 * w + __builtin_ctz(bits)};
      continue;
    }
    // the first lane equal to the word's maximum (an allowed one: it is > -inf)
    const __m256 vt = _mm256_set1_ps(top);
    int eq = 0;
    for (int k = 0; k < 4; ++k)
      eq |= _mm256_movemask_ps(_mm256_cmp_ps(v[k], vt, _CMP_EQ_OQ)) << (8 * k);
    b = Best{top, 32 * w + __builtin_ctz(uint32_t(eq))};
  }
  for (int64_t w = full; w < W && 32 * w < V; ++w) {  // the last, partial word
    const uint32_t bits = uint32_t(mask[w]);
    if (bits && scan_scalar(x, bits, 32 * w, int(std::min<int64_t>(32, V - 32 * w)), b))
      return b.idx;
  }
  return b.idx < 0 ? 0 : b.idx;
}

// ---- in-place mask, AVX2 ----------------------------------------------------------------------

void apply_row(float* x, int64_t V, const int32_t* mask, int64_t W) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const int64_t full = std::min<int64_t>(W, V / 32);
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = uint32_t(mask[w]);
    if (bits == 0xFFFFFFFFu) continue;
    float* p = x + 32 * w;
    for (int k = 0; k < 4; ++k) {
      if (!bits) {
        _mm256_storeu_ps(p + 8 * k, ninf);
      } else {
        const __m256 raw = _mm256_loadu_ps(p + 8 * k);
        _mm256_storeu_ps(p + 8 * k, _mm256_blendv_ps(ninf, raw, lane_mask(bits, 8 * k)));
      }
    }
  }
  for (int64_t j = 32 * full; j < V; ++j)  // the partial word and the padding past the mask
    if (j >= 32 * W || !allowed(mask, j)) x[j] = kNegInf;
}

}  // namespace isa_avx2
}  // namespace
#pragma GCC pop_options

namespace {

void check_args(const char* op, const at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              op, ": logits must be a [R, V] float32 CPU tensor with contiguous rows");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt &&
                  bitmask.dim() == 2 && bitmask.is_contiguous(),
              op, ": bitmask must be a contiguous [G, W] int32 CPU tensor");
}

// Checks `rows` ([G] int64, one per bitmask row, each a row of logits) and returns its data.
const int64_t* check_rows(const char* op, const at::Tensor& logits, const at::Tensor& bitmask,
                          const at::Tensor& rows) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              op, ": rows must be a contiguous int64 [G] tensor (G = bitmask rows)");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t g = 0; g < rows.size(0); ++g)
    TORCH_CHECK(rp[g] >= 0 && rp[g] < logits.size(0), op, ": row ", rp[g], " out of range");
  return rp;
}

// [G] int64: the greedy token of logits[rows[g]] under bitmask[g]; `scalar` forces the scalar
// code (tests compare the two).
at::Tensor masked_argmax(const at::Tensor& logits, const at::Tensor& bitmask,
                         const at::Tensor& rows, bool scalar) {
  check_args("masked_argmax", logits, bitmask);
  const int64_t* rp = check_rows("masked_argmax", logits, bitmask, rows);
  const int64_t G = bitmask.size(0), V = logits.size(1), W = bitmask.size(1);
  at::Tensor out = at::empty({G}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool avx2 = has_avx2() && !scalar;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      op[g] = avx2 ? isa_avx2::masked_argmax_row(xp + rp[g] * ld, V, mp + g * W, W)
                   : masked_argmax_row_scalar(xp + rp[g] * ld, V, mp + g * W, W);
  });
  return out;
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_args("apply_token_bitmask", logits, bitmask);
  const int64_t* rp = check_rows("apply_token_bitmask", logits, bitmask, rows);
  const int64_t V = logits.size(1), W = bitmask.size(1);
  float* xp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  const bool avx2 = has_avx2();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (avx2)
        isa_avx2::apply_row(xp + rp[g] * ld, V, mp + g * W, W);
      else
        apply_row_scalar(xp + rp[g] * ld, V, mp + g * W, W);
    }
  });
}

// 0: scalar (no AVX2), 1: AVX2
int64_t grammar_isa() { return has_avx2() ? 1 : 0; }

}  // namespace

TORCH_LIBRARY(pagedserve_grammar, m) {
  m.def("grammar_isa() -> int", &grammar_isa);  // catch-all: no tensor arguments
  m.def("masked_argmax(Tensor logits, Tensor bitmask, Tensor rows, bool scalar=False) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_grammar, CPU, m) {
  m.impl("masked_argmax", &masked_argmax);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
