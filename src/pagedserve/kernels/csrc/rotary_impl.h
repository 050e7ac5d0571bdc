// The SIMD body of rotary.cpp on V16 (csrc/vec16.h), compiled once per ISA by vec16_build.h.
// No include guard on purpose; nothing here may include headers.

// One head of D values (D a multiple of 32, at most kMaxDim) at `h`, in place. norm: 0 none, 1 Gemma
// (w = 1 + weight, one rounding), 2 Llama (round x * r, then times the bf16 weight, round).
// cos/sin: this token's [D] tables.
inline void head_norm_rope(uint16_t* h, int64_t D, const float* w, float eps, int norm,
                           const uint16_t* cos, const uint16_t* sin) {
  const int64_t nv = D / 16, half = D / 2;
  alignas(64) float v[kMaxDim];
  for (int64_t i = 0; i < nv; ++i) v_store(v + i * 16, v_load_bf16(h + i * 16));
  if (norm) {
    V16 acc = v_zero();
    for (int64_t i = 0; i < nv; ++i) {
      const V16 x = v_load(v + i * 16);
      acc = v_add(acc, v_mul(x, x));
    }
    const float mean = v_sum(acc) / static_cast<float>(D);
    const V16 inv = v_set1(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < nv; ++i) {
      V16 n = v_mul(v_load(v + i * 16), inv);
      if (norm == 2) n = v_round_bf16(n);
      v_store(v + i * 16, v_round_bf16(v_mul(n, v_load(w + i * 16))));
    }
  }
  for (int64_t i = 0; i < nv; ++i) {
    const int64_t j = i * 16;
    const V16 x = v_load(v + j);
    // rotate_half: -x[j + D/2] in the first half, x[j - D/2] in the second
    const V16 r = j < half ? v_neg(v_load(v + j + half)) : v_load(v + j - half);
    const V16 a = v_round_bf16(v_mul(x, v_load_bf16(cos + j)));
    const V16 b = v_round_bf16(v_mul(r, v_load_bf16(sin + j)));
    v_store_bf16(h + j, v_add(a, b));
  }
}
