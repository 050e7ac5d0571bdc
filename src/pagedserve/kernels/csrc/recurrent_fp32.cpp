// Recurrences of the hybrid models' recurrent layers on x86-64 CPUs, float32, batch-invariant:
// each (sequence, head) advances its state over its own tokens, one token at a time in one
// fixed order of operations -- the same for a prompt chunk and a decode step, whatever else
// is in the batch or how many threads run (work is split over (sequence, head) pairs only).
//
//   fp32_gated_delta_rule_paged(q, k [T, H, K], v [T, H, V], beta, decay [T, H], caches, blocks,
//                               start, fresh, query_start_loc [S + 1], isa) -> out [T, H, V]
//     Gated DeltaNet (Qwen3-Next, Qwen3.5): per token S *= decay; S += k^T ((v - k S) beta);
//     out = q S, head h's S [K, V] at words start + h K V of each sequence's state. The Kimi
//     Delta Attention variant (Kimi Linear): decay [T, H, K], one per key channel (row i of S
//     times decay[t, h, i]), else the same arithmetic.
//   fp32_ssm_scan_paged(x [T, H, P], dt [T, H], A [H], B, C [T, G, N], D [H], caches, blocks,
//                       start, state_size, fresh, query_start_loc [S + 1], isa) -> y [T, H, P]
//     Mamba 2's selective scan (Granite 4.0-H, ...): per token S = S exp(dt A) + dt x B^T;
//     y = S C + D x, head h reading group h / (H / G), its S [P, N] at words start + h P N.
//   paged_state_gather / paged_state_scatter: a span of each sequence's state, copied out / in.
// The states live in the paged cache (`PagedWords`), updated in place; a lone `[S, words]`
// tensor as `caches` is a batch of states outside the cache (kernels/cpu_recurrent.py).
//
// Registered as torch.ops.pagedserve_fp32.*; the Python wrapper is kernels/cpu_recurrent.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace isa_avx2 {
#include "recurrent_impl.h"
}  // namespace isa_avx2
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
namespace {
namespace isa_avx512 {
#include "recurrent_impl.h"
}  // namespace isa_avx512
}  // namespace
#pragma GCC pop_options

namespace {

void check_f32(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim &&
                  t.is_contiguous(),
              what, " must be a contiguous float32 CPU tensor of ", dim, " dims");
}

std::vector<int64_t> starts_of(const at::Tensor& qsl, int64_t S, int64_t T) {
  TORCH_CHECK(qsl.scalar_type() == at::kLong && qsl.dim() == 1 && qsl.size(0) == S + 1,
              "query_start_loc must be int64 [S + 1]");
  auto q = qsl.contiguous();
  std::vector<int64_t> s(q.data_ptr<int64_t>(), q.data_ptr<int64_t>() + S + 1);
  TORCH_CHECK(s[0] == 0 && s[S] == T, "query_start_loc must run from 0 to the token count");
  for (int64_t i = 0; i < S; ++i) TORCH_CHECK(s[i] <= s[i + 1], "query_start_loc must not decrease");
  return s;
}

// A state's words in the cache: chunk c (entry c / P, its K (c % P == 0) or V tensor; P the
// tensors an entry has: 2, or 1 in an MLA model's cache) holds words [c * W, (c + 1) * W) of
// every sequence's state, W the words of one block of a tensor; a sequence's block in entry e
// is blocks[e, s].
struct PagedWords {
  std::vector<int32_t*> base;  // per chunk: its tensor's first word
  const int64_t* blocks;       // [E, S]
  int64_t S, W, P;

  PagedWords(const std::vector<at::Tensor>& caches, const at::Tensor& blocks_) {
    // (one tensor alone is a state outside the cache: `[S, words]`, sequence s in row blocks[0, s])
    TORCH_CHECK(blocks_.scalar_type() == at::kLong && blocks_.dim() == 2 && blocks_.is_contiguous() &&
                    blocks_.size(0) > 0,
                "blocks must be a contiguous int64 [entries, sequences] tensor");
    const int64_t E = blocks_.size(0), n_caches = static_cast<int64_t>(caches.size());
    TORCH_CHECK(n_caches > 0 && n_caches % E == 0 && n_caches / E <= 2,
                "caches: the K (and V) tensors of each entry");
    P = n_caches / E;
    const int64_t rows = caches[0].size(0);
    const int64_t bytes = caches[0].numel() * caches[0].element_size() / rows;
    TORCH_CHECK(bytes % 4 == 0, "a cache block must hold whole 32-bit words");
    W = bytes / 4;
    S = blocks_.size(1);
    blocks = blocks_.data_ptr<int64_t>();
    for (const auto& t : caches) {
      TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.size(0) == rows &&
                      t.numel() * t.element_size() == rows * bytes,
                  "caches must be contiguous CPU tensors of one block size");
      base.push_back(reinterpret_cast<int32_t*>(t.data_ptr()));
    }
    const int64_t n = blocks_.numel();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(blocks[i] >= 0 && blocks[i] < rows, "blocks: a block id out of range");
  }

  // Copy words [start, start + count) of sequence s's state to (to_cache false) or from `buf`.
  void copy(int64_t s, int64_t start, int64_t count, int32_t* buf, bool to_cache) const {
    while (count > 0) {
      const int64_t c = start / W, off = start % W, n = std::min(count, W - off);
      TORCH_CHECK(c < static_cast<int64_t>(base.size()), "a state past its cache entries");
      int32_t* p = base[c] + blocks[(c / P) * S + s] * W + off;
      if (to_cache)
        std::memcpy(p, buf, n * 4);
      else
        std::memcpy(buf, p, n * 4);
      buf += n;
      start += n;
      count -= n;
    }
  }
};

// Words [start, start + count) of each sequence's state as float32 [S, count]; zeros for the
// sequences `fresh` marks (no token before this step).
at::Tensor paged_state_gather(const std::vector<at::Tensor>& caches, const at::Tensor& blocks,
                              int64_t start, int64_t count, const at::Tensor& fresh) {
  PagedWords pw(caches, blocks);
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.numel() == pw.S, "fresh must be bool [S]");
  auto fr = fresh.contiguous();
  const bool* f = fr.data_ptr<bool>();
  at::Tensor out = at::empty({pw.S, count}, at::TensorOptions().dtype(at::kFloat));
  auto* o = reinterpret_cast<int32_t*>(out.data_ptr());
  at::parallel_for(0, pw.S, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      if (f[s])
        std::memset(o + s * count, 0, count * 4);
      else
        pw.copy(s, start, count, o + s * count, false);
    }
  });
  return out;
}

// Store float32 values [S, count] as words [start, start + count) of each sequence's state.
void paged_state_scatter(const std::vector<at::Tensor>& caches, const at::Tensor& blocks,
                         int64_t start, const at::Tensor& values) {
  PagedWords pw(caches, blocks);
  check_f32(values, 2, "values");
  TORCH_CHECK(values.size(0) == pw.S, "values: one row per sequence");
  const int64_t count = values.size(1);
  auto* v = reinterpret_cast<int32_t*>(values.data_ptr());
  at::parallel_for(0, pw.S, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) pw.copy(s, start, count, v + s * count, true);
  });
}

// The recurrences on a state kept in the cache (`PagedWords`), words [start, ...) of each
// sequence's state: each (sequence, head) task copies its head's state into a local buffer
// (zeros for a fresh sequence), advances it over its tokens and stores it back -- the state
// read and written once, no gathered copy of the whole batch's states.
at::Tensor fp32_gated_delta_rule_paged(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& beta,
                                       const at::Tensor& decay, const std::vector<at::Tensor>& caches,
                                       const at::Tensor& blocks, int64_t start,
                                       const at::Tensor& fresh, const at::Tensor& qsl, int64_t isa) {
  isa = ps_isa::check_isa("fp32_gated_delta_rule_paged", isa);
  check_f32(q, 3, "q");
  check_f32(k, 3, "k");
  check_f32(v, 3, "v");
  check_f32(beta, 2, "beta");
  const bool per_key = decay.dim() == 3;  // KDA: one decay per key channel
  check_f32(decay, per_key ? 3 : 2, "decay");
  PagedWords pw(caches, blocks);
  const int64_t T = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2), S = pw.S;
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == T && v.size(1) == H && beta.size(0) == T &&
                  beta.size(1) == H &&
                  (per_key ? decay.sizes() == q.sizes() : decay.sizes() == beta.sizes()),
              "fp32_gated_delta_rule_paged: shapes disagree");
  const int64_t sd = per_key ? H * K : H, sdk = per_key ? 1 : 0;
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.numel() == S, "fresh must be bool [S]");
  auto fr = fresh.contiguous();
  const bool* f = fr.data_ptr<bool>();
  const auto starts = starts_of(qsl, S, T);
  at::Tensor out = at::empty({T, H, V}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *bp = beta.data_ptr<float>(), *dp = decay.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = isa >= ps_isa::kIsaAvx512;
  at::parallel_for(0, S * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> local(K * V + 2 * V);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t s = w / H, h = w % H, t0 = starts[s], n = starts[s + 1] - t0;
      if (n == 0) continue;
      float* st = local.data();
      const int64_t at = start + h * K * V;
      if (f[s])
        std::fill(st, st + K * V, 0.0f);
      else
        pw.copy(s, at, K * V, reinterpret_cast<int32_t*>(st), false);
      const int64_t qo = (t0 * H + h) * K, vo = (t0 * H + h) * V, go = t0 * H + h;
      auto run = wide ? isa_avx512::gdr_head : isa_avx2::gdr_head;
      run(st, qp + qo, kp + qo, vp + vo, bp + go, dp + (per_key ? qo : go), op + vo, n, K, V,
          H * K, H * V, H, H * V, st + K * V, st + K * V + V, sd, sdk);
      pw.copy(s, at, K * V, reinterpret_cast<int32_t*>(st), true);
    }
  });
  return out;
}

at::Tensor fp32_ssm_scan_paged(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                               const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                               const std::vector<at::Tensor>& caches, const at::Tensor& blocks,
                               int64_t start, int64_t state_size, const at::Tensor& fresh,
                               const at::Tensor& qsl, int64_t isa) {
  isa = ps_isa::check_isa("fp32_ssm_scan_paged", isa);
  check_f32(x, 3, "x");
  check_f32(dt, 2, "dt");
  check_f32(A, 1, "A");
  check_f32(B, 3, "B");
  check_f32(C, 3, "C");
  check_f32(D, 1, "D");
  PagedWords pw(caches, blocks);
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  const int64_t S = pw.S;
  TORCH_CHECK(N == state_size && dt.size(0) == T && dt.size(1) == H && A.size(0) == H &&
                  D.size(0) == H && B.size(0) == T && C.sizes() == B.sizes() && G > 0 && H % G == 0,
              "fp32_ssm_scan_paged: shapes disagree");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.numel() == S, "fresh must be bool [S]");
  auto fr = fresh.contiguous();
  const bool* f = fr.data_ptr<bool>();
  const auto starts = starts_of(qsl, S, T);
  at::Tensor y = at::empty({T, H, P}, x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *dp = D.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = isa >= ps_isa::kIsaAvx512;
  const int64_t per_group = H / G;
  at::parallel_for(0, S * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> local(P * N);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t s = w / H, h = w % H, t0 = starts[s], n = starts[s + 1] - t0;
      if (n == 0) continue;
      float* st = local.data();
      const int64_t at = start + h * P * N;
      if (f[s])
        std::fill(st, st + P * N, 0.0f);
      else
        pw.copy(s, at, P * N, reinterpret_cast<int32_t*>(st), false);
      const int64_t g = h / per_group;
      auto run = wide ? isa_avx512::ssm_head : isa_avx2::ssm_head;
      run(st, xp + (t0 * H + h) * P, dtp + t0 * H + h, ap[h], bp + (t0 * G + g) * N,
          cp + (t0 * G + g) * N, dp[h], yp + (t0 * H + h) * P, n, P, N, H * P, H, G * N, H * P);
      pw.copy(s, at, P * N, reinterpret_cast<int32_t*>(st), true);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_fp32, m) {
  m.def(
      "fp32_gated_delta_rule_paged(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor decay, "
      "Tensor(a!)[] caches, Tensor blocks, int start, Tensor fresh, Tensor query_start_loc, "
      "int isa) -> Tensor");
  m.def(
      "fp32_ssm_scan_paged(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, "
      "Tensor(a!)[] caches, Tensor blocks, int start, int state_size, Tensor fresh, "
      "Tensor query_start_loc, int isa) -> Tensor");
  m.def("paged_state_gather(Tensor[] caches, Tensor blocks, int start, int count, Tensor fresh) -> Tensor");
  m.def("paged_state_scatter(Tensor(a!)[] caches, Tensor blocks, int start, Tensor values) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_fp32, CPU, m) {
  m.impl("paged_state_gather", &paged_state_gather);
  m.impl("fp32_gated_delta_rule_paged", &fp32_gated_delta_rule_paged);
  m.impl("fp32_ssm_scan_paged", &fp32_ssm_scan_paged);
  m.impl("paged_state_scatter", &paged_state_scatter);
}
