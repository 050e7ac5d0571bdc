// Paged attention for decode tokens (one query per sequence) on x86-64 CPUs (AVX2 or AVX-512,
// paged_attention_impl.h), bf16
// K/V caches: reads each sequence's keys and values straight from its blocks through the block
// table (no gather into a padded copy, no mask tensor), for all query heads of a KV head at once.
//
//   out[s, h] = sum_t softmax_t(scale * q[s, h] . k[s, t]) v[s, t],   t in [start, seq_len[s])
//
// (`sinks`, gpt-oss: a logit per query head in each softmax's denominator, with no value.)
//
// with start = max(0, seq_len - window) for a sliding window of `window` keys (0: none). All
// arithmetic in fp32 (q and the cache read as fp32), one rounding of the output to bf16. The new
// token's K/V must already be in the cache (the caller writes them first). The caches are bf16,
// or fp8 (float8_e4m3fn / float8_e5m2: kv_cache_dtype, one byte a value), each 16 values widened
// to fp32 as they are loaded (v_load_kv in paged_attention_impl.h); the query is bf16 either way.
//
// Parallel over (sequence, KV head) pairs on torch's OpenMP pool. Registered as
// torch.ops.pagedserve_cpu.decode_attention; the Python wrapper is kernels/cpu_attention.py.
// `isa` (kernels.cpu_isa) picks the build; AVX2 and AVX-512 give the same bits (csrc/vec16.h),
// and AMX CPUs run the AVX-512 build. NOTE: not on AMX tiles: scores as tile products of a
// block's 16 keys and the query heads (24b5aeb) won with one layer's cache kept in cache; with
// each layer's cache streaming from memory, as in a decode step, the vector pass with its
// prefetches was 1.1-1.55x faster at serving batches (16-64 sequences of 256-1k keys), 0.83-0.89x
// at 1-7 sequences of 2k-8k keys (docs/benchmarks.md, issue 40's AMX section, seventh session).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;   // query heads per KV head handled in one pass (more: in runs)
constexpr int kMaxDim = 1024;   // head_dim limit (multiple of 16; MLA's latent + rope key: 576)

}  // namespace

#define PS_VEC_KERNEL "paged_attention_impl.h"
#include "vec16_build.h"

namespace {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            int64_t isa, const c10::optional<at::Tensor>& sinks) {
  ps_isa::check_isa("decode_attention", isa);
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kBFloat16 || cache_type == at::ScalarType::Float8_e4m3fn ||
                   cache_type == at::ScalarType::Float8_e5m2),
              "decode_attention: a bfloat16 query; bfloat16 or fp8 (e4m3fn / e5m2) caches");
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
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "decode_attention: heads");
  TORCH_CHECK(block_tables.size(0) == S && seq_lens.size(0) == S, "decode_attention: rows");
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  const float* sp = nullptr;  // the sink logits [Hq] (gpt-oss), or none
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->is_contiguous() &&
                    sinks->size(0) == Hq,
                "decode_attention: sinks must be a contiguous float32 [Hq]");
    sp = sinks->data_ptr<float>();
  }
  const auto* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * B, "decode_attention: seq_lens out of range");
  at::Tensor out = at::empty({S, Hq, D}, query.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* bt = block_tables.data_ptr<int64_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const bool avx512 = ps_isa::use_avx512(isa);
  // The kernel for the caches' format (0 bf16, 1 e4m3, 2 e5m2: KvElem in paged_attention_impl.h),
  // called with the caches' data as bytes (each instance reads its own element type).
  using Attend = void (*)(const uint16_t*, const void*, const void*, const int64_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, uint16_t*,
                          int64_t, float*, const float*);
  const int fmt = cache_type == at::kBFloat16 ? 0 : cache_type == at::ScalarType::Float8_e4m3fn ? 1 : 2;
  const Attend kernels[2][3] = {
      {isa_avx2::attend_bf16, isa_avx2::attend_e4m3, isa_avx2::attend_e5m2},
      {isa_avx512bf16::attend_bf16, isa_avx512bf16::attend_e4m3, isa_avx512bf16::attend_e5m2}};
  const Attend attend = kernels[avx512][fmt];
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  // Work units: (sequence, KV head) pairs, each split into `parts` runs of its query heads: runs
  // of at most kMaxGroup heads (MLA's one latent "head" serves 16-128 query heads), and more
  // when there are fewer pairs than threads (one sequence of a model with one KV head: Gemma 3
  // 270M at batch 1). NOTE: every query head's arithmetic is its own (the heads of a run share
  // only the K/V reads), so the split changes no bit.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t parts = std::max<int64_t>((G + kMaxGroup - 1) / kMaxGroup,
                                          std::min<int64_t>(G, (threads + S * Hkv - 1) / (S * Hkv)));
  at::parallel_for(0, S * Hkv * parts, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    for (int64_t unit = b; unit < e; ++unit) {
      const int64_t pair = unit / parts, part = unit % parts;
      const int64_t s = pair / Hkv, h = pair % Hkv;
      const int64_t g0 = part * G / parts, g1 = (part + 1) * G / parts;
      const int64_t len = lens[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(size_t((g1 - g0) * (len - start)));
      const int64_t first = s * Hq + h * G + g0;  // the run's first query head
      attend(qp + first * D, kp, vp, bt + s * max_blocks, len, start, B, Hkv, h, g1 - g0, D,
             static_cast<float>(scale), op + first * D, D, scores.data(), sp ? sp + first - s * Hq : nullptr);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, int isa, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
