// The SIMD body of lora_bgmv.cpp on V16 (csrc/vec16.h), compiled once per ISA by vec16_build.h.
// No include guard on purpose; nothing here may include headers.
//
// NOTE: every token is computed alone, in a fixed order (fp32 FMAs; the shrink's sum over the
// input split into 4 interleaved chains, combined as (c0 + c1) + (c2 + c3)): a token's result does
// not depend on the other tokens of the call, their slots, nor which thread ran it.

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// h[t, :W] = x[t] At[slot]^T for tokens [t0, t1) (0 for tokens of slot < 0); At: [slots, K, W].
inline void shrink_rows(const uint16_t* x, int64_t K, const uint16_t* at, int64_t W,
                        const int64_t* slots, float* h, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    float* ht = h + t * W;
    const int64_t s = slots[t];
    if (s < 0) {
      std::memset(ht, 0, sizeof(float) * W);
      continue;
    }
    const uint16_t* xt = x + t * K;
    const uint16_t* as = at + s * K * W;
    for (int64_t c = 0; c < W; c += 16) {
      const int64_t n = std::min<int64_t>(16, W - c);
      V16 acc[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
      int64_t k = 0;
      for (; k + 4 <= K; k += 4)
        for (int i = 0; i < 4; ++i) {
          const uint16_t* row = as + (k + i) * W + c;
          const V16 a = n == 16 ? v_load_bf16(row) : v_load_bf16_n(row, n);
          acc[i] = v_fmadd(v_set1(bf16_to_f32(xt[k + i])), a, acc[i]);
        }
      for (int i = 0; k < K; ++k, ++i) {
        const uint16_t* row = as + k * W + c;
        const V16 a = n == 16 ? v_load_bf16(row) : v_load_bf16_n(row, n);
        acc[i] = v_fmadd(v_set1(bf16_to_f32(xt[k])), a, acc[i]);
      }
      const V16 sum = v_add(v_add(acc[0], acc[1]), v_add(acc[2], acc[3]));
      if (n == 16) v_store(ht + c, sum);
      else v_store_n(ht + c, sum, n);
    }
  }
}

// y[t, :N] = bf16(y[t] + h[t, col:col + R] Bt[slot]) for tokens [t0, t1) of slot >= 0 (the others
// untouched); Bt: [slots, R, N].
inline void expand_rows(const float* h, int64_t W, int64_t col, int64_t R, const uint16_t* bt,
                        int64_t N, const int64_t* slots, uint16_t* y, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    const float* ht = h + t * W + col;
    const uint16_t* bs = bt + s * R * N;
    uint16_t* yt = y + t * N;
    int64_t o = 0;
    for (; o + 64 <= N; o += 64) {  // 4 independent chains
      V16 acc[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
      for (int64_t j = 0; j < R; ++j) {
        const V16 hj = v_set1(ht[j]);
        for (int i = 0; i < 4; ++i) acc[i] = v_fmadd(hj, v_load_bf16(bs + j * N + o + 16 * i), acc[i]);
      }
      for (int i = 0; i < 4; ++i)
        v_store_bf16(yt + o + 16 * i, v_add(v_load_bf16(yt + o + 16 * i), acc[i]));
    }
    for (; o < N; o += 16) {
      const int64_t n = std::min<int64_t>(16, N - o);
      V16 acc = v_zero();
      for (int64_t j = 0; j < R; ++j) {
        const V16 b = n == 16 ? v_load_bf16(bs + j * N + o) : v_load_bf16_n(bs + j * N + o, n);
        acc = v_fmadd(v_set1(ht[j]), b, acc);
      }
      const V16 yv = n == 16 ? v_load_bf16(yt + o) : v_load_bf16_n(yt + o, n);
      if (n == 16) v_store_bf16(yt + o, v_add(yv, acc));
      else v_store_bf16_n(yt + o, v_add(yv, acc), n);
    }
  }
}
