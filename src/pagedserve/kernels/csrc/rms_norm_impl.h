// The SIMD body of rms_norm.cpp on V16 (csrc/vec16.h), compiled once per ISA by vec16_build.h.
// No include guard on purpose; nothing here may include headers.

// Rows [r0, r1) of x [*, H] normalised into y (see rms_norm.cpp for the numerics).
inline void norm_rows(const uint16_t* x, const float* w, uint16_t* y, int64_t H, int64_t r0,
                      int64_t r1, float eps, bool llama) {
  const int64_t full = H / 16 * 16, tail = H - full;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* xr = x + r * H;
    uint16_t* yr = y + r * H;
    V16 acc = v_zero();
    for (int64_t i = 0; i < full; i += 16) {
      const V16 v = v_load_bf16(xr + i);
      acc = v_add(acc, v_mul(v, v));  // x^2 rounded, then summed (as pow + sum)
    }
    if (tail) {
      const V16 v = v_load_bf16_n(xr + full, tail);
      acc = v_add(acc, v_mul(v, v));
    }
    const float mean = v_sum(acc) / static_cast<float>(H);
    const V16 inv = v_set1(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < H; i += 16) {
      const bool whole = i < full;
      const V16 v = whole ? v_load_bf16(xr + i) : v_load_bf16_n(xr + i, tail);
      const V16 wv = whole ? v_load(w + i) : v_load_n(w + i, tail);
      V16 n = v_mul(v, inv);
      if (llama) n = v_round_bf16(n);
      if (whole) v_store_bf16(yr + i, v_mul(n, wv));
      else v_store_bf16_n(yr + i, v_mul(n, wv), tail);
    }
  }
}
