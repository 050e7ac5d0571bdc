// V16: 16 fp32 lanes, as one AVX-512 register or two AVX2 registers (lanes 0-7 and 8-15), for the
// row kernels (csrc/*_impl.h) compiled once per ISA level by vec16_build.h, with PS_VEC 512
// (AVX512F/BW/VL + BF16) or 256 (AVX2 + FMA + F16C).
//
// NOTE: every operation gives the same bits at both widths -- lane-wise IEEE arithmetic, FMA with
// one rounding, the horizontal sum in _mm512_reduce_add_ps's order (halves, quarters, then pairs),
// fp32 -> bf16 rounding to nearest even -- so a kernel written on V16 returns the same results on
// AVX2 and AVX-512 CPUs (one exception: VCVTNEPS2BF16 flushes fp32 denormals to zero, the AVX2
// rounding keeps them, as c10::BFloat16 does). Keep new operations so.

// NOTE: no include guard and no system headers here: vec16_build.h includes this file once per
// ISA namespace, after <immintrin.h>, <cstdint> and <cstring>.

#if PS_VEC == 512

struct V16 {
  __m512 v;
};

inline V16 v_zero() { return {_mm512_setzero_ps()}; }
inline V16 v_set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 v_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 v_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 v_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 v_fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline V16 v_neg(V16 a) {  // flips the sign bit (as torch's neg)
  return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}
inline float v_sum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float v_hmax(V16 a) { return _mm512_reduce_max_ps(a.v); }

inline V16 v_load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline __m256i v_to_bf16(V16 a) { return (__m256i)_mm512_cvtneps_pbh(a.v); }
inline void v_store_bf16(uint16_t* p, V16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v_to_bf16(a));
}
inline V16 v_round_bf16(V16 a) {  // fp32 -> bf16 (nearest even) -> fp32
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v_to_bf16(a)), 16))};
}
// Bit i set where lane i is NaN / equal to b (ordered compare: -0 == +0).
inline unsigned v_nan_mask(V16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline unsigned v_eq_mask(V16 a, V16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline V16 v_round(V16 a) {  // to the nearest integer, ties to even
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline V16 v_pow2i(V16 n) {  // 2^n for integer-valued n in [-126, 127]
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}

// 16 fp8 values widened exactly to fp32 (see v_load_e4m3 below): M mantissa bits, exponent BIAS.
template <int M, int BIAS>
inline V16 v_load_fp8(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i em = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 23 - M), _mm512_set1_epi32((127 - BIAS) << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / float(1 << (BIAS + M - 1))));
  __m512i mag = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(1 << M)), normal,
                                        _mm512_castps_si512(sub));
  if (M == 3) {  // E4M3FN: S.1111.111 is NaN, no infinities
    mag = _mm512_mask_mov_epi32(mag, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7FC00000));
  } else {  // E5M2: exponent 11111 is inf (mantissa 0) or NaN
    mag = _mm512_mask_mov_epi32(mag, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7C)), _mm512_set1_epi32(0x7F800000));
    mag = _mm512_mask_mov_epi32(mag, _mm512_cmpgt_epi32_mask(em, _mm512_set1_epi32(0x7C)), _mm512_set1_epi32(0x7FC00000));
  }
  return {_mm512_castsi512_ps(_mm512_or_si512(mag, sign))};
}

#elif PS_VEC == 256

struct V16 {
  __m256 lo, hi;
};

inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v_store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 v_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 v_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v_neg(V16 a) {
  const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}
// _mm512_reduce_add_ps's order: lanes i + (i + 8), then the 128-bit halves, then (0 + 2), (1 + 3).
inline float v_sum(V16 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
inline float v_hmax(V16 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const float a0 = _mm_cvtss_f32(t8), a1 = _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
  return a0 > a1 ? a0 : a1;
}

inline __m256 bf16x8_to_f32(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V16 v_load_bf16(const uint16_t* p) {
  return {bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// fp32 -> bf16 bits (round to nearest even; NaN -> quiet NaN), in the low 16 bits of each lane.
inline __m256i f32_to_bf16_bits(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
inline __m256i v_to_bf16(V16 a) {  // 16 bf16 values in order
  const __m256i packed = _mm256_packus_epi32(f32_to_bf16_bits(a.lo), f32_to_bf16_bits(a.hi));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));  // packus interleaves halves
}
inline void v_store_bf16(uint16_t* p, V16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v_to_bf16(a));
}
inline V16 v_round_bf16(V16 a) {
  const __m256i lo = _mm256_slli_epi32(f32_to_bf16_bits(a.lo), 16);
  const __m256i hi = _mm256_slli_epi32(f32_to_bf16_bits(a.hi), 16);
  return {_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)};
}
inline unsigned v_nan_mask(V16 a) {
  return unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q))) |
         unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q))) << 8;
}
inline unsigned v_eq_mask(V16 a, V16 b) {
  return unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ))) |
         unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ))) << 8;
}

inline V16 v_round(V16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline __m256 pow2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 v_pow2i(V16 n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }

// 8 fp8 values (the low 8 bytes of raw) widened exactly to fp32: see v_load_e4m3 below.
template <int M, int BIAS>
inline __m256 fp8x8_to_f32(__m128i raw) {
  const __m256i x = _mm256_cvtepu8_epi32(raw);
  const __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 23 - M), _mm256_set1_epi32((127 - BIAS) << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / float(1 << (BIAS + M - 1))));
  __m256i mag = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub),
                                   _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << M), em));
  if (M == 3) {
    mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
  } else {
    mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7F800000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7C)));
    mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7FC00000), _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7C)));
  }
  return _mm256_castsi256_ps(_mm256_or_si256(mag, sign));
}
template <int M, int BIAS>
inline V16 v_load_fp8(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {fp8x8_to_f32<M, BIAS>(raw), fp8x8_to_f32<M, BIAS>(_mm_srli_si128(raw, 8))};
}

#else
#error "define PS_VEC as 512 or 256 before including vec16.h"
#endif

// 16 fp8 KV cache values (attention/kv_dtype.py) widened exactly to fp32, by integer operations
// (the same bits at both widths; no F16C / AVX10 conversions needed): sign, then a normal value's
// exponent and mantissa moved into place and rebiased, a subnormal as mantissa x 2^(1 - bias - M)
// (exact), the formats' NaN / infinity codes as torch reads them. E4M3FN: 3 mantissa bits, bias
// 7, S.1111.111 NaN; E5M2: 2 mantissa bits, bias 15, IEEE-style infinities and NaNs.
inline V16 v_load_e4m3(const uint8_t* p) { return v_load_fp8<3, 7>(p); }
inline V16 v_load_e5m2(const uint8_t* p) { return v_load_fp8<2, 15>(p); }

// The first n (0..16) lanes from p, the others `fill`; and the first n lanes stored.
inline V16 v_load_n(const float* p, int64_t n, float fill = 0.0f) {
  alignas(64) float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = fill;
  std::memcpy(buf, p, size_t(n) * sizeof(float));
  return v_load(buf);
}
inline V16 v_load_bf16_n(const uint16_t* p, int64_t n, uint16_t fill = 0) {
  alignas(64) uint16_t buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = fill;
  std::memcpy(buf, p, size_t(n) * sizeof(uint16_t));
  return v_load_bf16(buf);
}
inline void v_store_bf16_n(uint16_t* p, V16 a, int64_t n) {
  alignas(64) uint16_t buf[16];
  v_store_bf16(buf, a);
  std::memcpy(p, buf, size_t(n) * sizeof(uint16_t));
}

// exp(x) for x <= 0 (softmax: scores minus their maximum), on the operations above (the same bits
// at both widths): Cephes' expf polynomial on x - n ln 2, n = round(x / ln 2), times 2^n; x below
// -87 is taken as -87 (exp ~ 1.6e-38, far below any weight that matters). Relative error ~1e-7.
inline V16 v_exp_neg(V16 x) {
  x = v_max(x, v_set1(-87.0f));
  const V16 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
  V16 f = v_fmadd(n, v_set1(-0.693359375f), x);
  f = v_fmadd(n, v_set1(2.12194440e-4f), f);
  V16 p = v_set1(1.9875691500e-4f);
  p = v_fmadd(p, f, v_set1(1.3981999507e-3f));
  p = v_fmadd(p, f, v_set1(8.3334519073e-3f));
  p = v_fmadd(p, f, v_set1(4.1665795894e-2f));
  p = v_fmadd(p, f, v_set1(1.6666665459e-1f));
  p = v_fmadd(p, f, v_set1(5.0000001201e-1f));
  p = v_fmadd(p, v_mul(f, f), v_add(f, v_set1(1.0f)));
  return v_mul(p, v_pow2i(n));
}
inline void v_store_n(float* p, V16 a, int64_t n) {
  alignas(64) float buf[16];
  v_store(buf, a);
  std::memcpy(p, buf, size_t(n) * sizeof(float));
}
