// Random sampling of one token per row of fp32 logits on x86-64 CPUs with AVX-512, for
// vocabularies of any size, without sorting the vocabulary:
//
//   x = logits / temperature; keep the top_k largest (ties at the k-th kept), then the smallest
//   prefix (by x, descending; ties by index) whose probability mass reaches top_p, then the tokens
//   whose probability is at least min_p times the largest; draw from what is kept by inverse CDF
//   with the row's uniform u in [0, 1): walking the kept tokens in vocabulary order, the first
//   whose cumulative weight exceeds u * (their total).
//
// That is the rule of pagedserve/worker/sampler.py's torch path (`_sample_row`), which draws the
// same u. Per row: one pass for the maximum, one for the softmax denominator, and one that
// collects the candidates within `delta` of the maximum (widened until they hold the top_k /
// top_p / min_p set, a few hundred tokens typically); only the candidates are sorted. Without any
// filter a third pass walks the cumulative weights. NaN logits never win (weight 0).
//
// `logprob_rows` gives the raw logprob and rank of a target token per row and the row's top-k
// logprobs, the same way (no log-softmax of the whole row written, no vocabulary sort).
//
// Registered as torch.ops.pagedserve_cpu.{sample_rows, logprob_rows} (a fragment of the library
// the GEMV file defines); the Python wrapper is pagedserve/kernels/cpu_sampling.py. As there: no
// -m flags, the SIMD code sits in one `#pragma GCC target` region (namespace isa_avx512); callers
// check kernels.cpu_gemm.kernel_available() first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct RowParams {
  float temperature;
  int64_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  float u;        // uniform in [0, 1)
};

}  // namespace

// The row kernels: AVX-512 (F/BW/VL/DQ) only (cpu_isa.h's NOTE on ISA namespaces).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace {
namespace isa_avx512 {

// e^x for x <= 0 (x - max), to ~2 ulp; 0 below -87 (and for -inf).
inline __m512 exp_nonpos(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);  // (a NaN lane becomes -87: callers mask NaN lanes themselves)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  // e^r on |r| <= ln2 / 2: Taylor to r^7 (relative error < 1e-8 there)
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

inline float exp_scalar(float x) {
  return _mm512_cvtss_f32(exp_nonpos(_mm512_set1_ps(x)));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
}

// Loads 16 logits (masked) divided by the temperature.
inline __m512 load_scaled(const float* p, __mmask16 m, __m512 temp) {
  return _mm512_div_ps(_mm512_maskz_loadu_ps(m, p), temp);
}

// Appends the lanes of x (the 16 values from index i) selected by `keep` as (value, index).
inline void append_candidates(std::vector<std::pair<float, int32_t>>& cand, __m512 x,
                                        __mmask16 keep, int64_t i) {
  alignas(64) float xs[16];
  alignas(64) int32_t is[16];
  _mm512_mask_compressstoreu_ps(xs, keep, x);
  _mm512_mask_compressstoreu_epi32(
      is, keep,
      _mm512_add_epi32(_mm512_set1_epi32(int32_t(i)),
                       _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)));
  const int n = __builtin_popcount(keep);
  for (int j = 0; j < n; ++j) cand.emplace_back(xs[j], is[j]);
}

int64_t sample_row(const float* logits, int64_t V, const RowParams& prm,
                             std::vector<std::pair<float, int32_t>>& cand) {
  const __m512 temp = _mm512_set1_ps(prm.temperature);
  // Pass 1: the maximum (NaN lanes ignored: max returns the second operand on NaN).
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    vmax = _mm512_mask_max_ps(vmax, m, load_scaled(logits + i, m, temp), vmax);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  if (!(mx > kNegInf)) return 0;  // every logit -inf or NaN: nothing has weight
  if (mx == -kNegInf) {  // +inf outweighs everything: the first +inf
    for (int64_t i = 0;; ++i)
      if (logits[i] / prm.temperature == mx) return i;
  }
  const __m512 vmx = _mm512_set1_ps(mx);

  // Pass 2: the softmax denominator over the whole row (in units of e^max).
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    const __m512 x = load_scaled(logits + i, m, temp);
    const __mmask16 ok = _mm512_mask_cmp_ps_mask(m, x, x, _CMP_ORD_Q);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(ok, exp_nonpos(_mm512_sub_ps(x, vmx))));
  }
  const float z_all = _mm512_reduce_add_ps(vsum);

  const bool filtered = prm.top_k > 0 || prm.top_p < 1.0f || prm.min_p > 0.0f;
  if (!filtered) {
    // Pass 3: inverse CDF over the whole row, 16 weights at a time.
    const float target = prm.u * z_all;
    float run = 0.0f;
    int64_t last = 0;  // the last token with weight so far
    alignas(64) float ws[16];
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = tail_mask(V - i);
      const __m512 x = load_scaled(logits + i, m, temp);
      const __mmask16 ok = _mm512_mask_cmp_ps_mask(m, x, x, _CMP_ORD_Q);
      const __m512 w = _mm512_maskz_mov_ps(ok, exp_nonpos(_mm512_sub_ps(x, vmx)));
      const __mmask16 pos = _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
      if (!pos) continue;
      const float block = _mm512_reduce_add_ps(w);
      if (run + block > target) {
        _mm512_store_ps(ws, w);
        for (int j = 0; j < 16; ++j) {
          run += ws[j];
          if (ws[j] > 0.0f && run > target) return i + j;
        }
      } else {
        run += block;
      }
      last = i + (31 - __builtin_clz(uint32_t(pos)));
    }
    return last;  // rounding kept the running sum below the target
  }

  // Candidates: every x >= max - delta, widened until they hold the kept set. NOTE: they are
  // always a prefix of the whole row's order (everything above a threshold), so a cut that falls
  // inside them is the cut over the whole row.
  const float minp_delta = prm.min_p > 0.0f ? -std::log(prm.min_p) + 1e-3f : 0.0f;
  float delta = 4.0f;
  for (;;) {
    cand.clear();
    const bool all = !(delta < 1e30f);
    const __m512 thr = _mm512_set1_ps(all ? kNegInf : mx - delta);
    float z_cand = 0.0f;
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = tail_mask(V - i);
      const __m512 x = load_scaled(logits + i, m, temp);
      // (-inf logits have no weight and never join, even when taking all)
      const __mmask16 keep = all ? _mm512_mask_cmp_ps_mask(m, x, thr, _CMP_GT_OQ)
                                 : _mm512_mask_cmp_ps_mask(m, x, thr, _CMP_GE_OQ);
      if (!keep) continue;
      append_candidates(cand, x, keep, i);
      z_cand += _mm512_reduce_add_ps(_mm512_maskz_mov_ps(keep, exp_nonpos(_mm512_sub_ps(x, vmx))));
    }
    if (all) break;
    // Enough when the prefix of some filter lies inside (the kept set is the shortest prefix);
    // top-p also needs its denominator: with top-k, the whole top-k set.
    const bool minp_inside = prm.min_p > 0.0f && delta >= minp_delta;
    bool enough;
    if (prm.top_k > 0 && int64_t(cand.size()) >= prm.top_k) {
      enough = true;
    } else if (prm.top_k > 0) {  // fewer than k: all are in the top-k set, its mass unknown
      enough = prm.top_p >= 1.0f && minp_inside;
    } else {
      enough = (prm.top_p < 1.0f && z_cand >= prm.top_p * z_all) || minp_inside;
    }
    if (enough) break;
    delta = delta < 512.0f ? delta * 2.0f : std::numeric_limits<float>::infinity();
  }
  // Largest first; equal values by index (deterministic). With top-k only the first k (and the
  // ties with the k-th) are ordered.
  const auto before = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int64_t keep = int64_t(cand.size());
  if (prm.top_k > 0 && prm.top_k < keep) {
    std::nth_element(cand.begin(), cand.begin() + (prm.top_k - 1), cand.end(), before);
    const float kth = cand[size_t(prm.top_k - 1)].first;
    // ties with the k-th stay (as `logits < kth -> -inf`): move them up behind the first k
    auto tail = std::partition(cand.begin() + prm.top_k, cand.end(),
                               [kth](const std::pair<float, int32_t>& c) { return c.first >= kth; });
    keep = int64_t(tail - cand.begin());
  }
  std::sort(cand.begin(), cand.begin() + keep, before);
  float z = z_all;
  if (prm.top_k > 0) {  // the softmax is over the top-k set only
    z = 0.0f;
    for (int64_t i = 0; i < keep; ++i) z += exp_scalar(cand[size_t(i)].first - mx);
  }
  float cum = 0.0f;
  int64_t n = 0;
  for (; n < keep; ++n) {
    const float wi = exp_scalar(cand[size_t(n)].first - mx);
    if (prm.top_p < 1.0f && n > 0 && cum / z >= prm.top_p) break;  // mass before it reached top_p
    if (prm.min_p > 0.0f && wi < prm.min_p) break;  // p / p_max < min_p (p_max has weight 1)
    cum += wi;
  }
  // The draw walks the kept tokens in vocabulary order, as the torch path's cumsum does.
  std::sort(cand.begin(), cand.begin() + n,
            [](const auto& a, const auto& b) { return a.second < b.second; });
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += exp_scalar(cand[size_t(i)].first - mx);
  const float target = prm.u * total;
  float run = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    run += exp_scalar(cand[size_t(i)].first - mx);
    if (run > target) return cand[size_t(i)].second;
  }
  return cand[size_t(n - 1)].second;
}

void logprob_row(const float* x, int64_t V, int64_t target, int64_t k, float* lp,
                           int64_t* rank, float* top_val, int64_t* top_idx,
                           std::vector<std::pair<float, int32_t>>& cand) {
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    vmax = _mm512_mask_max_ps(vmax, m, _mm512_maskz_loadu_ps(m, x + i), vmax);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const float xt = x[target];
  const __m512 vmx = _mm512_set1_ps(mx), vxt = _mm512_set1_ps(xt);
  __m512 vsum = _mm512_setzero_ps();
  int64_t greater = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __mmask16 ok = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_ORD_Q);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(ok, exp_nonpos(_mm512_sub_ps(v, vmx))));
    greater += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, v, vxt, _CMP_GT_OQ));
  }
  const float lse = mx + std::log(_mm512_reduce_add_ps(vsum));
  *lp = xt - lse;
  *rank = greater + 1;
  if (k <= 0) return;
  for (float delta = 4.0f;; delta *= 2.0f) {
    cand.clear();
    const bool all = !(delta < 1024.0f);
    const __m512 thr = _mm512_set1_ps(all ? kNegInf : mx - delta);
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = tail_mask(V - i);
      const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
      // (taking all: every non-NaN value, -inf included, as torch.topk would)
      const __mmask16 keep = _mm512_mask_cmp_ps_mask(m, v, thr, _CMP_GE_OQ);
      if (keep) append_candidates(cand, v, keep, i);
    }
    if (all || int64_t(cand.size()) >= k) break;
  }
  const auto before = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t n = std::min<int64_t>(k, int64_t(cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + n, cand.end(), before);
  for (int64_t i = 0; i < k; ++i) {  // (fewer than k non-NaN values: the rest is -inf / index -1)
    top_val[i] = i < n ? cand[size_t(i)].first - lse : kNegInf;
    top_idx[i] = i < n ? cand[size_t(i)].second : -1;
  }
}

}  // namespace isa_avx512
}  // namespace
#pragma GCC pop_options

namespace {

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "sample_rows: logits must be a contiguous [R, V] float32 CPU tensor");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "sample_rows: vocabulary size out of range");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == R &&
                    t->is_contiguous(),
                "sample_rows: per-row parameters must be contiguous float32 [R] tensors");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.dim() == 1 && top_k.size(0) == R &&
                  top_k.is_contiguous(),
              "sample_rows: top_k must be a contiguous int64 [R] tensor");
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int32_t>> cand;
    for (int64_t r = r0; r < r1; ++r) {
      const RowParams prm{tp[r], kp[r], pp[r], mp[r], up[r]};
      op[r] = isa_avx512::sample_row(lp + r * V, V, prm, cand);
    }
  });
  return out;
}

// Raw logprob and rank of row r's target token, and the row's k largest logprobs (largest first,
// equal values by index): one pass for the maximum, one for the log-sum-exp and the rank, and for
// k > 0 one collecting the candidates near the maximum (widened until there are k).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_rows(
    const at::Tensor& logits, const at::Tensor& targets, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "logprob_rows: logits must be a contiguous [R, V] float32 CPU tensor");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "logprob_rows: vocabulary size out of range");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == R &&
                  targets.is_contiguous(),
              "logprob_rows: targets must be a contiguous int64 [R] tensor");
  TORCH_CHECK(k >= 0 && k <= V, "logprob_rows: k must be in [0, V]");
  const int64_t* tp = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "logprob_rows: target ", tp[r], " out of range");
  at::Tensor lp = at::empty({R}, logits.options());
  at::Tensor rank = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor top_val = at::empty({R, k}, logits.options());
  at::Tensor top_idx = at::empty({R, k}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  float* lpp = lp.data_ptr<float>();
  int64_t* rp = rank.data_ptr<int64_t>();
  float* tvp = top_val.data_ptr<float>();
  int64_t* tip = top_idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int32_t>> cand;
    for (int64_t r = r0; r < r1; ++r)
      isa_avx512::logprob_row(xp + r * V, V, tp[r], k, lpp + r, rp + r, tvp + r * k, tip + r * k, cand);
  });
  return {lp, rank, top_val, top_idx};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
        "Tensor u) -> Tensor");
  m.def("logprob_rows(Tensor logits, Tensor targets, int k) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("logprob_rows", &logprob_rows);
}
