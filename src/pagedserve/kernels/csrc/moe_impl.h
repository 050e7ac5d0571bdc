// The MoE experts' elementwise row kernels (csrc/moe.cpp) on csrc/vec16.h's V16, compiled once
// per width by vec16_build.h: the gated activation `act(gate) * up` of a tile of an expert's
// rows, and a token's weighted sum of its experts' outputs.
//
// NOTE: each must give the bits the layer's torch ops give (layers/moe.py, MoEExperts): the
// activation is fp32_activation's formula (csrc/act_formula.h, the one the layers' Activation
// calls), rounded to bf16 to nearest even in integer arithmetic (as that op and torch's bf16 mul
// round: denormals kept, so not VCVTNEPS2BF16, which flushes them); the product and the
// weighted add are single IEEE operations per element (-ffp-contract=off keeps the scalar tails
// so). No include guard and no system headers (vec16_build.h includes this once per namespace).

namespace moe_act {

// act_formula.h's vector type, on V16
struct V {
  V16 r;
  static V set1(float a) { return {v_set1(a)}; }
  static V add(V a, V b) { return {v_add(a.r, b.r)}; }
  static V mul(V a, V b) { return {v_mul(a.r, b.r)}; }
  static V fmadd(V a, V b, V c) { return {v_fmadd(a.r, b.r, c.r)}; }
  static V round(V a) { return {v_round(a.r)}; }
  static V pow2(V n) { return {v_pow2i(n.r)}; }
#if PS_VEC == 512
  static V div(V a, V b) { return {{_mm512_div_ps(a.r.v, b.r.v)}}; }
  static V fnmadd(V a, V b, V c) { return {{_mm512_fnmadd_ps(a.r.v, b.r.v, c.r.v)}}; }
  static V clamp(V a, float lo, float hi) {  // fp32_invariant.cpp's operand order (NaN -> lo)
    return {{_mm512_min_ps(_mm512_max_ps(a.r.v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi))}};
  }
#else
  static V div(V a, V b) { return {{_mm256_div_ps(a.r.lo, b.r.lo), _mm256_div_ps(a.r.hi, b.r.hi)}}; }
  static V fnmadd(V a, V b, V c) {
    return {{_mm256_fnmadd_ps(a.r.lo, b.r.lo, c.r.lo), _mm256_fnmadd_ps(a.r.hi, b.r.hi, c.r.hi)}};
  }
  static V clamp(V a, float lo, float hi) {
    const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    return {{_mm256_min_ps(_mm256_max_ps(a.r.lo, l), h), _mm256_min_ps(_mm256_max_ps(a.r.hi, l), h)}};
  }
#endif
};

#include "act_formula.h"

}  // namespace moe_act

// fp32 -> the nearest-even bf16 value (a NaN: its quiet NaN), as fp32 (low 16 bits zero).
inline V16 moe_round_bf16(V16 a) {
#if PS_VEC == 512
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))};
#else
  return v_round_bf16(a);  // vec16.h's integer rounding
#endif
}

// Values already rounded by moe_round_bf16, stored as n (<= 16) bf16 (their top halves).
inline void moe_store_bf16(uint16_t* p, V16 rounded, int64_t n) {
#if PS_VEC == 512
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded.v), 16));
#else
  const __m256i h = v_to_bf16(rounded);  // vec16.h's integer rounding: exact on these values
#endif
  if (n == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return;
  }
  alignas(32) uint16_t out[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), h);
  std::memcpy(p, out, size_t(n) * sizeof(uint16_t));
}

inline V16 v_min(V16 a, V16 b) {
#if PS_VEC == 512
  return {_mm512_min_ps(a.v, b.v)};
#else
  return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
#endif
}

inline V16 moe_load(const float* p, int64_t n) { return n == 16 ? v_load(p) : v_load_n(p, n); }
inline V16 moe_load(const uint16_t* p, int64_t n) { return n == 16 ? v_load_bf16(p) : v_load_bf16_n(p, n); }
inline void moe_store(float* p, V16 a, int64_t n) {
  if (n == 16) v_store(p, a);
  else v_store_n(p, a, n);
}

// h = act(g) * u over `rows` rows (row stride ld) and columns [c0, c1): bf16 (act rounded to
// bf16, then the product rounded) or fp32. act: 0 silu, 1 tanh-GELU (fp32_activation's codes).
// act 2: gpt-oss's clamped SwiGLU (models/gpt_oss.py, ClampedSwiGLU) with alpha / limit:
//   g = min(gate, limit), u = clamp(up, -limit, limit), h = (u + 1) * (g * sigmoid(g * alpha))
// op for op as torch runs it there, each result rounded to bf16 as torch's bf16 ops round them
// (bf16), the sigmoid by fp32_activation's formula (act_formula.h's act 2).
inline void moe_act_mul(const void* g, const void* u, void* h, int64_t rows, int64_t ld, int64_t c0,
                        int64_t c1, bool bf16, int64_t act, float alpha, float limit) {
  const V16 lim = v_set1(limit), neg_lim = v_set1(-limit), one = v_set1(1.0f), al = v_set1(alpha);
  auto rnd = [bf16](V16 a) { return bf16 ? moe_round_bf16(a) : a; };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < c1; c += 16) {
      const int64_t n = std::min<int64_t>(16, c1 - c), off = r * ld + c;
      V16 gv, uv;
      if (bf16) {
        gv = moe_load(static_cast<const uint16_t*>(g) + off, n);
        uv = moe_load(static_cast<const uint16_t*>(u) + off, n);
      } else {
        gv = moe_load(static_cast<const float*>(g) + off, n);
        uv = moe_load(static_cast<const float*>(u) + off, n);
      }
      V16 y;
      if (act == 2) {
        const V16 gc = rnd(v_min(gv, lim));
        const V16 uc = rnd(v_min(v_max(uv, neg_lim), lim));
        const V16 s = rnd(moe_act::act_v(moe_act::V{rnd(v_mul(gc, al))}, 2).r);
        y = rnd(v_mul(rnd(v_add(uc, one)), rnd(v_mul(gc, s))));
      } else {
        const V16 a = rnd(moe_act::act_v(moe_act::V{gv}, act).r);
        y = rnd(v_mul(a, uv));
      }
      if (bf16) moe_store_bf16(static_cast<uint16_t*>(h) + off, y, n);
      else moe_store(static_cast<float*>(h) + off, y, n);
    }
  }
}

// out[i] = out[i] + float(y[i]) * w for i < n (y bf16 or fp32): a token's experts are added one
// at a time, in ascending expert order, as the layer's loop adds them.
inline void moe_weighted_add(float* out, const void* y, bool bf16, float w, int64_t n) {
  const V16 wv = v_set1(w);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t m = std::min<int64_t>(16, n - i);
    const V16 yv = bf16 ? moe_load(static_cast<const uint16_t*>(y) + i, m)
                        : moe_load(static_cast<const float*>(y) + i, m);
    moe_store(out + i, v_add(moe_load(out + i, m), v_mul(yv, wv)), m);
  }
}
