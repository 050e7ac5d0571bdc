// Paged attention for decode tokens (one query per sequence) on x86-64 CPUs with AVX-512, bf16
// K/V caches: reads each sequence's keys and values straight from its blocks through the block
// table (no gather into a padded copy, no mask tensor), for all query heads of a KV head at once.
//
//   out[s, h] = sum_t softmax_t(scale * q[s, h] . k[s, t]) v[s, t],   t in [start, seq_len[s])
//
// with start = max(0, seq_len - window) for a sliding window of `window` keys (0: none). All
// arithmetic in fp32 (q and the cache read as fp32), one rounding of the output to bf16. The new
// token's K/V must already be in the cache (the caller writes them first).
//
// Parallel over (sequence, KV head) pairs on torch's OpenMP pool. Registered as
// torch.ops.pagedserve_cpu.decode_attention; the Python wrapper is kernels/cpu_attention.py. No -m
// flags (target attributes); callers check kernels.cpu_gemm.kernel_available() first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;   // query heads per KV head handled in one pass
constexpr int kMaxDim = 512;    // head_dim limit (multiple of 16)

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_bf16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void attend_one(
    const uint16_t* q,        // [G, D] the query heads of this KV head
    const uint16_t* k_cache,  // [N, B, Hkv, D]
    const uint16_t* v_cache,
    const int64_t* table,     // [max_blocks]
    int64_t seq_len, int64_t start, int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
    int64_t G, int64_t D, float scale, uint16_t* out,  // [G, D] with row stride out_stride
    int64_t out_stride, std::vector<float>& scores) {
  const int64_t L = seq_len - start;
  scores.resize(size_t(G * L));
  const int64_t nv = D / 16;
  // q in fp32, pre-scaled: [G][D]
  alignas(64) float qf[kMaxGroup * kMaxDim];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nv; ++i)
      _mm512_store_ps(qf + g * D + i * 16,
                      _mm512_mul_ps(load_bf16(q + g * D + i * 16), _mm512_set1_ps(scale)));
  const int64_t row = num_kv_heads * D;  // elements between consecutive slots
  float maxs[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) maxs[g] = -std::numeric_limits<float>::infinity();
  // Pass 1: scores.
  for (int64_t t = start; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint16_t* k = k_cache + slot * row + kv_head * D;
    __m512 acc[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nv; ++i) {
      __m512 kv = load_bf16(k + i * 16);
      for (int64_t g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_load_ps(qf + g * D + i * 16), kv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) {
      float sc = _mm512_reduce_add_ps(acc[g]);
      scores[size_t(g * L + (t - start))] = sc;
      maxs[g] = std::max(maxs[g], sc);
    }
  }
  // Softmax weights.
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * L;
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      sg[j] = std::exp(sg[j] - maxs[g]);
      sum += sg[j];
    }
    inv_sum[g] = 1.0f / sum;
  }
  // Pass 2: weighted sum of values, accumulated in fp32.
  alignas(64) float acc[kMaxGroup * kMaxDim];
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = start; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint16_t* v = v_cache + slot * row + kv_head * D;
    for (int64_t i = 0; i < nv; ++i) {
      __m512 vv = load_bf16(v + i * 16);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + i * 16;
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[size_t(g * L + (t - start))]), vv,
                                           _mm512_load_ps(a)));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nv; ++i) {
      __m512 o = _mm512_mul_ps(_mm512_load_ps(acc + g * D + i * 16), _mm512_set1_ps(inv_sum[g]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * out_stride + i * 16),
                          (__m256i)_mm512_cvtneps_pbh(o));
    }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "decode_attention: bfloat16 query and caches only");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "decode_attention: query [S, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "decode_attention: caches [N, B, Hkv, D], contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "decode_attention: int64 block_tables [S, max_blocks] and seq_lens [S]");
  const int64_t S = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t B = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= kMaxDim, "decode_attention: head_dim");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "decode_attention: heads");
  TORCH_CHECK(block_tables.size(0) == S && seq_lens.size(0) == S, "decode_attention: rows");
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  const auto* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * B, "decode_attention: seq_lens out of range");
  at::Tensor out = at::empty({S, Hq, D}, query.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const auto* bt = block_tables.data_ptr<int64_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, S * Hkv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    for (int64_t pair = b; pair < e; ++pair) {
      const int64_t s = pair / Hkv, h = pair % Hkv;
      const int64_t len = lens[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      attend_one(qp + (s * Hq + h * G) * D, kp, vp, bt + s * max_blocks, len, start, B, Hkv, h, G,
                 D, static_cast<float>(scale), op + (s * Hq + h * G) * D, D, scores);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
