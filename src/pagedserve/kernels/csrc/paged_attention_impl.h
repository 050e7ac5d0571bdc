// The SIMD body of paged_attention.cpp on V16 (csrc/vec16.h), compiled once per ISA by
// vec16_build.h. No include guard on purpose; nothing here may include headers.

// The G query heads of one KV head of one sequence over keys [start, seq_len): out [G, D].
inline void attend_one(const uint16_t* q,        // [G, D] the query heads of this KV head
                       const uint16_t* k_cache,  // [N, B, Hkv, D]
                       const uint16_t* v_cache,
                       const int64_t* table,     // [max_blocks]
                       int64_t seq_len, int64_t start, int64_t block_size, int64_t num_kv_heads,
                       int64_t kv_head, int64_t G, int64_t D, float scale, uint16_t* out,
                       int64_t out_stride, float* scores /* [G * (seq_len - start)] */) {
  const int64_t L = seq_len - start;
  const int64_t nv = D / 16;
  // q in fp32, pre-scaled: [G][D]
  alignas(64) float qf[kMaxGroup * kMaxDim];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nv; ++i)
      v_store(qf + g * D + i * 16, v_mul(v_load_bf16(q + g * D + i * 16), v_set1(scale)));
  const int64_t row = num_kv_heads * D;  // elements between consecutive slots
  float maxs[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) maxs[g] = -std::numeric_limits<float>::infinity();
  // Pass 1: scores.
  for (int64_t t = start; t < seq_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint16_t* k = k_cache + slot * row + kv_head * D;
    V16 acc[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) acc[g] = v_zero();
    for (int64_t i = 0; i < nv; ++i) {
      const V16 kv = v_load_bf16(k + i * 16);
      for (int64_t g = 0; g < G; ++g) acc[g] = v_fmadd(v_load(qf + g * D + i * 16), kv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float sc = v_sum(acc[g]);
      scores[g * L + (t - start)] = sc;
      maxs[g] = std::max(maxs[g], sc);
    }
  }
  // Softmax weights.
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
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
      const V16 vv = v_load_bf16(v + i * 16);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + i * 16;
        v_store(a, v_fmadd(v_set1(scores[g * L + (t - start)]), vv, v_load(a)));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nv; ++i)
      v_store_bf16(out + g * out_stride + i * 16, v_mul(v_load(acc + g * D + i * 16), v_set1(inv_sum[g])));
}
