// The SIMD body of paged_attention.cpp on V16 (csrc/vec16.h), compiled once per ISA by
// vec16_build.h. No include guard on purpose; nothing here may include headers.

// Chunks of 16 dimensions accumulated in registers at once by pass 2 (4 x 4 V16: 16 AVX-512
// registers; two 8-lane registers each on AVX2, so fewer there).
constexpr int64_t kChunks = PS_VEC == 512 ? 4 : 2;
constexpr int64_t kPrefetch = 8;  // keys ahead
// Keys per chunk of pass 2: a chunk's values (256 keys x D, 128 KiB at D = 256 in bf16) stay in
// L2 while every tile of heads x dimensions walks them; up to kKeyWhole keys go in one pass (as
// the prompt kernels' kPvWhole: csrc/prefill_attention.cpp).
constexpr int64_t kKeyChunk = 256, kKeyWhole = 640;

// The caches' element type by format FMT: 0 bf16, 1 fp8 E4M3FN, 2 fp8 E5M2 (one byte each,
// attention/kv_dtype.py), and its load of 16 values widened to fp32 (exact for all three): the
// fp8 caches' convert-on-load path; every other operation is the bf16 cache's.
template <int FMT> struct KvElem { using type = uint8_t; };
template <> struct KvElem<0> { using type = uint16_t; };
template <int FMT>
inline V16 v_load_kv(const typename KvElem<FMT>::type* p) {
  if constexpr (FMT == 0) return v_load_bf16(p);
  else if constexpr (FMT == 1) return v_load_e4m3(p);
  else return v_load_e5m2(p);
}

// Where pass 2 reads values: one sequence's blocks, one KV head.
template <int FMT>
struct Pv {
  const typename KvElem<FMT>::type* v_cache;
  const int64_t* table;
  int64_t start, seq_len, block_size, row, head_off, L;
};

// For GN query heads (weights w at sc + g * L) and dimension chunks i0 .. i0 + NC: the sums
// sum_t w[g, t] v[t] over keys [t0, t1), continued from the partial sums in `part` ([g][D] fp32,
// at i0 * 16) unless `first`; then out[g, chunks] = inv_sum[g] * sums if `last`, else the sums
// back into `part`. NOTE: fp32 partial sums stored and reloaded are exact: each lane adds its
// keys in order from zero, one FMA each, however the keys are chunked.
template <int FMT, int GN, int NC>
inline void pv_tile(const Pv<FMT>& p, const float* sc, int64_t i0, int64_t t0, int64_t t1, float* part,
                    int64_t D, bool first, bool last, const float* inv_sum, uint16_t* out,
                    int64_t out_stride) {
  V16 acc[GN][NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = first ? v_zero() : v_load(part + g * D + (i0 + c) * 16);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = p.table[t / p.block_size] * p.block_size + t % p.block_size;
    const auto* v = p.v_cache + slot * p.row + p.head_off + i0 * 16;
    V16 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = v_load_kv<FMT>(v + c * 16);
    for (int g = 0; g < GN; ++g) {
      const V16 w = v_set1(sc[g * p.L + (t - p.start)]);
      for (int c = 0; c < NC; ++c) acc[g][c] = v_fmadd(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) {
      if (last) v_store_bf16(out + g * out_stride + c * 16, v_mul(acc[g][c], v_set1(inv_sum[g])));
      else v_store(part + g * D + (i0 + c) * 16, acc[g][c]);
    }
}

// The G query heads of one KV head of one sequence over keys [start, seq_len): out [G, D].
// FMT: the caches' format (KvElem); the query and out are bf16 whatever it is.
template <int FMT>
inline void attend_one(const uint16_t* q,        // [G, D] the query heads of this KV head
                       const typename KvElem<FMT>::type* k_cache,  // [N, B, Hkv, D]
                       const typename KvElem<FMT>::type* v_cache,
                       const int64_t* table,     // [max_blocks]
                       int64_t seq_len, int64_t start, int64_t block_size, int64_t num_kv_heads,
                       int64_t kv_head, int64_t G, int64_t D, float scale, uint16_t* out,
                       int64_t out_stride, float* scores /* [G * (seq_len - start)] */,
                       const float* sink /* [G] sink logits (gpt-oss), or null */) {
  const int64_t L = seq_len - start;
  const int64_t nv = D / 16;
  const int64_t row_bytes = D * int64_t(sizeof(typename KvElem<FMT>::type));
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
    const auto* k = k_cache + slot * row + kv_head * D;
    // NOTE: prefetch: the keys of a sequence sit in blocks scattered over the cache, and read
    // from memory as they came this loop ran at ~5 GB/s (2.6 ms for 64 sequences of 210 tokens on
    // a Zen 4 core, against 1.0 ms from cache). The key kPrefetch ahead and this key's values
    // (pass 2 reads them from L2 then) are requested now.
    if (t + kPrefetch < seq_len) {
      const int64_t ahead = t + kPrefetch;
      const auto* kn = k_cache + (table[ahead / block_size] * block_size + ahead % block_size) * row + kv_head * D;
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(kn) + b, _MM_HINT_T0);
    }
    {
      const char* vt = reinterpret_cast<const char*>(v_cache + slot * row + kv_head * D);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(vt + b, _MM_HINT_T1);
    }
    V16 acc[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) acc[g] = v_zero();
    for (int64_t i = 0; i < nv; ++i) {
      const V16 kv = v_load_kv<FMT>(k + i * 16);
      for (int64_t g = 0; g < G; ++g) acc[g] = v_fmadd(v_load(qf + g * D + i * 16), kv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float sc = v_sum(acc[g]);
      scores[g * L + (t - start)] = sc;
      maxs[g] = std::max(maxs[g], sc);
    }
  }
  // Softmax weights, 16 at a time. A sink logit (gpt-oss) joins the max and the denominator,
  // its weight dropped: softmax([scores, sink])[:-1].
  if (sink)
    for (int64_t g = 0; g < G; ++g) maxs[g] = std::max(maxs[g], sink[g]);
  float inv_sum[kMaxGroup];
  alignas(64) static const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    const V16 mx = v_set1(maxs[g]);
    V16 sum = v_zero();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
      const V16 e = v_exp_neg(v_sub(v_load(sg + j), mx));
      v_store(sg + j, e);
      sum = v_add(sum, e);
    }
    if (j < L) {  // the tail: lanes past L are zeros
      const V16 e = v_mul(v_exp_neg(v_sub(v_load_n(sg + j, L - j), mx)), v_load_n(ones, L - j));
      v_store_n(sg + j, e, L - j);
      sum = v_add(sum, e);
    }
    float total = v_sum(sum);
    if (sink) total += std::exp(sink[g] - maxs[g]);
    inv_sum[g] = 1.0f / total;
  }
  // Pass 2: weighted sum of values, accumulated in fp32 in registers: up to 4 query heads x
  // kChunks chunks of 16 dimensions over a chunk of kKeyChunk keys, then the next tile; the
  // partial sums wait in `part` for the next chunk of keys (long contexts: the values are read
  // from memory once, not once per tile). NOTE: each lane still adds its keys in order from
  // zero, one FMA each: the tiling and the key chunks change no bit.
  alignas(64) float part[kMaxGroup * kMaxDim];
  const Pv<FMT> pv{v_cache, table, start, seq_len, block_size, row, kv_head * D, L};
  const int64_t chunk = L <= kKeyWhole ? L : kKeyChunk;
  for (int64_t t0 = start; t0 < seq_len; t0 += chunk) {
    const int64_t t1 = std::min<int64_t>(seq_len, t0 + chunk);
    const bool first = t0 == start, last = t1 == seq_len;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, G - g0);
      for (int64_t i0 = 0; i0 < nv; i0 += kChunks) {
        const int64_t nc = std::min<int64_t>(kChunks, nv - i0);
        const float* sc = scores + g0 * L;
        float* pt = part + g0 * D;
        uint16_t* o = out + g0 * out_stride + i0 * 16;
        if (nc == kChunks) {
          switch (gn) {
            case 4: pv_tile<FMT, 4, kChunks>(pv, sc, i0, t0, t1, pt, D, first, last, inv_sum + g0, o, out_stride); break;
            case 3: pv_tile<FMT, 3, kChunks>(pv, sc, i0, t0, t1, pt, D, first, last, inv_sum + g0, o, out_stride); break;
            case 2: pv_tile<FMT, 2, kChunks>(pv, sc, i0, t0, t1, pt, D, first, last, inv_sum + g0, o, out_stride); break;
            default: pv_tile<FMT, 1, kChunks>(pv, sc, i0, t0, t1, pt, D, first, last, inv_sum + g0, o, out_stride); break;
          }
        } else {
          for (int64_t g = 0; g < gn; ++g)
            for (int64_t c = 0; c < nc; ++c)
              pv_tile<FMT, 1, 1>(pv, sc + g * L, i0 + c, t0, t1, pt + g * D, D, first, last, inv_sum + g0 + g,
                                 o + g * out_stride + c * 16, out_stride);
        }
      }
    }
  }
}

// The host code's entry points, one per cache format, on type-erased cache pointers (instantiated
// here, inside the ISA's target region).
#define PS_ATTEND_FMT(NAME, FMT)                                                                \
  inline void NAME(const uint16_t* q, const void* k_cache, const void* v_cache,                \
                   const int64_t* table, int64_t seq_len, int64_t start, int64_t block_size,    \
                   int64_t num_kv_heads, int64_t kv_head, int64_t G, int64_t D, float scale,     \
                   uint16_t* out, int64_t out_stride, float* scores, const float* sink) {       \
    using T = typename KvElem<FMT>::type;                                                       \
    attend_one<FMT>(q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), table,   \
                    seq_len, start, block_size, num_kv_heads, kv_head, G, D, scale, out,        \
                    out_stride, scores, sink);                                                  \
  }
PS_ATTEND_FMT(attend_bf16, 0)
PS_ATTEND_FMT(attend_e4m3, 1)
PS_ATTEND_FMT(attend_e5m2, 2)
#undef PS_ATTEND_FMT
