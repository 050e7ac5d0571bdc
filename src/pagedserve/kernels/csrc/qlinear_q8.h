// Integer dot products of ggml weight blocks with 8-bit activations (AVX2), as llama.cpp computes
// its quantized products: included once by qlinear.cpp, inside `namespace isa_avx2` after
// qlinear_impl.h (whose helpers it uses), and run for the ggml formats at every ISA level.
//
//   y[m, n] = sum_b  dx[m, b] * dw[n, b] * (qx[m, b] . qw[n, b])   (- the K-quants' mins term)
//
// Each row of x is quantized first (`quantize_x`) to blocks of 32: qx int8 in [-127, 127] and an
// fp32 scale dx = amax / 127 (Q8_0-style, with an fp32 scale; also for the K-quants, whose
// sub-blocks are 32 wide, or 16 wide for Q6_K with an int16 multiplier per half). Each weight block
// of 32 is unpacked to 8 bits (`Q8_0`, `Q4_0`, ... below) and multiplied with _mm256_maddubs_epi16
// -- on |qw| and sign(qx, qw) for signed values (Q8_0, Q6_K), on the stored unsigned values as
// they are for the others (Q4_0 / Q5_0 then subtract offset * sum(qx), precomputed per block of x)
// -- then _mm256_madd_epi16: exact int32 sums (the same either way), one fp32 FMA per block.
//
// NOTE: batch invariance. y[m, n] is one 8-lane fp32 accumulator that walks the blocks of K in
// order with the same instructions (mins term of a super-block, then its blocks' FMAs with the
// scale dw * dx computed the same way), then the fixed horizontal sum of qlinear_impl.h
// (`acc_sum`), + bias and one rounding, whatever the tile (MB rows x NB columns) it sits in; the
// int32 block sums are exact. So a row's result does not depend on M or its neighbours. Keep it
// so: every tile shape instantiates the one `q8_tile` template, and nothing depends on M.

#if PS_ISA != 1
#error "qlinear_q8.h is the AVX2 build only"
#endif

// x quantized: q [M][K] int8; d [M][K / 32] the blocks' scales; s [M][K / 32] = d * sum(q) (the
// K-quants' mins term).
// Software prefetch distance, in weight rows ahead of the tile (the hardware prefetchers alone
// left the M = 1 LM head product (178 MB of Q8_0) at ~1/3 of one core's read bandwidth). Past the
// last rows the addresses leave the weight tensor: prefetches never fault.
constexpr int64_t kPrefetchRows = 8;

struct XQ {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* o;  // [M][K / 32][8]: offset * (sums of qx[4 l .. 4 l + 3]), for offset formats
  int64_t K;
};

// Row x (fp32, K values) to blocks of 32: q = round-to-nearest-even(x * 127 / amax). With an
// offset (formats storing q + offset unsigned), o gets offset times the block's sums of 4 q.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* o,
                         int offset) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    // int32 -> int8 (packs interleave the 128-bit lanes; the permute restores the order)
    const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), p8);
    const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p8), _mm256_set1_epi16(1));
    if (offset)  // the lanes of s32 group q as madd(maddubs(w, q)) groups products: 4 l .. 4 l + 3
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + b * 8), _mm256_mullo_epi32(s32, _mm256_set1_epi32(offset)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    d[b] = amax / 127.0f;
    s[b] = d[b] * float(_mm_cvtsi128_si32(t));
  }
}

// fp16 block scale -> fp32 (F16C; exact, as half_to_float).
inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// ---------------------------------------------------------------------------------------------
// Weight formats. A unit is what a row is made of (one block of 32, or a K-quant super-block of
// 8 x 32); `head` reads a unit's scales once per tile, `block(h, u, t, ...)` unpacks its 32-value
// block t: int8 values, their fp32 scale, and (kMul16) int16 multipliers per 16-value half.
// ---------------------------------------------------------------------------------------------

struct Q8_0 {
  static constexpr int kUnit = 32, kBytes = 34, kBlocks = 1, kOffset = 0;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = false;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 2));
  }
};

struct Q4_0 {  // value = d * (q - 8): block() returns q, the kernel subtracts 8 * sum(qx)
  static constexpr int kUnit = 32, kBytes = 18, kBlocks = 1, kOffset = 8;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = true;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    return nibbles(u + 2);
  }
};

struct Q5_0 {  // value = d * (q - 16): block() returns q, the kernel subtracts 16 * sum(qx)
  static constexpr int kUnit = 32, kBytes = 22, kBlocks = 1, kOffset = 16;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = true;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    uint32_t qh;
    std::memcpy(&qh, u + 2, 4);
    const __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles(u + 6), hb);
  }
};

// Q4_1: value = d * q + m, q the unsigned nibble: Q4_0's layout with a per-block min m (an fp16
// after d). The min is carried as the K-quants' mins are (kMins: value = d * q - mins[t]), with
// mins = -m in lane 0 (one block per unit; the other lanes zero).
struct Q4_1 {
  static constexpr int kUnit = 32, kBytes = 20, kBlocks = 1, kOffset = 0;
  static constexpr bool kMins = true, kMul16 = false, kUnsigned = true;
  struct Head {
    __m256 mins;
  };
  static Head head(const uint8_t* u) { return {_mm256_setr_ps(-h2f(u + 2), 0, 0, 0, 0, 0, 0, 0)}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    return nibbles(u + 4);
  }
};

// Q4_K / Q5_K: value = d * sc[t] * q - dmin * mn[t] for the 8 blocks t of a super-block.
struct KHead {
  float dsc[8];  // d * sc[t]
  __m256 mins;   // dmin * mn[t]
};

inline KHead k4_head(const uint8_t* u) {
  uint8_t sc[8], mn[8];
  k4_scales(u + 4, sc, mn);
  KHead h;
  const float d = h2f(u), dmin = h2f(u + 2);
  for (int t = 0; t < 8; ++t) h.dsc[t] = d * float(sc[t]);
  uint64_t m8;
  std::memcpy(&m8, mn, 8);
  h.mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m8)))),
                         _mm256_set1_ps(dmin));
  return h;
}

// Block t of 32 nibbles: qs[32 (t / 2) + l], low nibbles for even t, high for odd.
inline __m256i k4_nibbles(const uint8_t* qs, int t) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (t / 2)));
  return _mm256_and_si256(t & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
}

struct Q4_K {
  static constexpr int kUnit = 256, kBytes = 144, kBlocks = 8, kOffset = 0;
  static constexpr bool kMins = true, kMul16 = false, kUnsigned = true;
  using Head = KHead;
  static Head head(const uint8_t* u) { return k4_head(u); }
  static __m256i block(const Head& h, const uint8_t* u, int t, float* dw, __m256i*) {
    *dw = h.dsc[t];
    return k4_nibbles(u + 16, t);
  }
};

struct Q5_K {
  static constexpr int kUnit = 256, kBytes = 176, kBlocks = 8, kOffset = 0;
  static constexpr bool kMins = true, kMul16 = false, kUnsigned = true;
  using Head = KHead;
  static Head head(const uint8_t* u) { return k4_head(u); }
  static __m256i block(const Head& h, const uint8_t* u, int t, float* dw, __m256i*) {
    *dw = h.dsc[t];
    // the fifth bit of value l is bit t of qh[l]
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, t), _mm256_set1_epi8(1));
    return _mm256_or_si256(k4_nibbles(u + 48, t), _mm256_slli_epi16(bit, 4));
  }
};

// Q6_K: value = d * sc[i] * (q - 32), one int8 scale sc per 16 values. Block t = 4 h + j of the
// super-block: ql[64 h + 32 (j & 1) + l] (low nibble for j < 2, high otherwise) and bits
// 2 j, 2 j + 1 of qh[32 h + l]; its scales are sc[2 t] (l < 16) and sc[2 t + 1].
struct Q6_K {
  static constexpr int kUnit = 256, kBytes = 210, kBlocks = 8, kOffset = 0;
  static constexpr bool kMins = false, kMul16 = true, kUnsigned = false;
  struct Head {
    float d;
  };
  static Head head(const uint8_t* u) { return {h2f(u + 208)}; }
  static __m256i block(const Head& h, const uint8_t* u, int t, float* dw, __m256i* mul) {
    *dw = h.d;
    const int hh = t / 4, j = t % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * hh + 32 * (j & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 128 + 32 * hh));
    const __m256i lo = _mm256_and_si256(j < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), _mm256_set1_epi8(3));
    const int8_t* sc = reinterpret_cast<const int8_t*>(u + 192);
    *mul = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(sc[2 * t])),
                                   _mm_set1_epi16(sc[2 * t + 1]), 1);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
};

// ---------------------------------------------------------------------------------------------
// Tiles: MB rows of x (from row m0) times NB weight rows (w, stride rb), over all of K.
// ---------------------------------------------------------------------------------------------

template <class F, int MB, int NB>
__attribute__((always_inline)) inline void q8_tile(const XQ& x, int64_t m0, const uint8_t* w, int64_t rb,
                                                   float* res) {
  const int64_t nbx = x.K / 32;  // blocks of 32 per row
  __m256 acc[MB * NB];
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t u = 0; u < x.K / F::kUnit; ++u) {
    typename F::Head h[NB];
    const uint8_t* wu[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      wu[j] = w + j * rb + u * F::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb), _MM_HINT_T0);
      if (F::kBytes > 64) _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb + 64), _MM_HINT_T0);
      if (F::kBytes > 128) _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb + 128), _MM_HINT_T0);
      h[j] = F::head(wu[j]);
    }
    if constexpr (F::kMins) {  // - mins[t] * dx[t] * sum(qx[t]) for the unit's blocks t (8, or Q4_1's 1)
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const float* sp = x.s + (m0 + i) * nbx + u * F::kBlocks;
        const __m256 xs = F::kBlocks == 8 ? _mm256_loadu_ps(sp) : _mm256_setr_ps(sp[0], 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm256_fnmadd_ps(h[j].mins, xs, acc[i * NB + j]);
      }
    }
    for (int t = 0; t < F::kBlocks; ++t) {
      const int64_t b = u * F::kBlocks + t;
      __m256i qw[NB], aw[NB], mul[NB];
      __m256 dw[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        float d;
        qw[j] = F::block(h[j], wu[j], t, &d, &mul[j]);
        dw[j] = _mm256_set1_ps(d);
        if constexpr (!F::kUnsigned) aw[j] = _mm256_sign_epi8(qw[j], qw[j]);  // |qw| (-128: 128 unsigned)
      }
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + i) * x.K + b * 32));
        const __m256 dx = _mm256_broadcast_ss(x.d + (m0 + i) * nbx + b);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) {
          // u8 * s8 pairs fit int16: |qw| * sign(qx, qw) (|qx| <= 127, |qw| <= 128), or unsigned
          // qw <= 63 times qx as they are
          const __m256i p16 = F::kUnsigned ? _mm256_maddubs_epi16(qw[j], xv)
                                           : _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, qw[j]));
          __m256i p32 = _mm256_madd_epi16(p16, F::kMul16 ? mul[j] : ones16);
          if constexpr (F::kOffset != 0)  // sum((q - offset) qx) = sum(q qx) - offset sum(qx), exactly
            p32 = _mm256_sub_epi32(p32, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.o + ((m0 + i) * nbx + b) * 8)));
          acc[i * NB + j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_mul_ps(dw[j], dx), acc[i * NB + j]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) res[t] = acc_sum(acc[t]);
}

template <class F, int MB, int NB = (MB <= 2 ? 4 : 2)>
inline void q8_rows(const XQ& x, int64_t m0, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1,
                    const Out& out) {
  float res[MB * NB];
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    q8_tile<F, MB, NB>(x, m0, w + n * rb, rb, res);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) put_out(out, m0 + i, n + j, res[i * NB + j]);
  }
  for (; n < n1; ++n) {
    q8_tile<F, MB, 1>(x, m0, w + n * rb, rb, res);
    for (int i = 0; i < MB; ++i) put_out(out, m0 + i, n, res[i]);
  }
}

// Rows [m0, m1) of x times weight rows [n0, n1).
template <class F>
inline void q8_range(const XQ& x, int64_t m0, int64_t m1, const uint8_t* w, int64_t rb, int64_t n0,
                     int64_t n1, const Out& out) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) q8_rows<F, 4>(x, m, w, rb, n0, n1, out);
  switch (m1 - m) {
    case 3: q8_rows<F, 3>(x, m, w, rb, n0, n1, out); break;
    case 2: q8_rows<F, 2>(x, m, w, rb, n0, n1, out); break;
    case 1: q8_rows<F, 1>(x, m, w, rb, n0, n1, out); break;
  }
}

// Output columns [nb, ne) (whole 16-row blocks of W) of the product with quantized x.
template <class F>
void q8_product_range(const XQ& x, int64_t M, const uint8_t* w, int64_t rb, const Out& out, int64_t nb,
                      int64_t ne) {
  // NOTE: one weight row at a time for a single row of x (decode at batch 1): there the product
  // is bound by reading W from memory, and one sequential stream per thread read faster than four
  // interleaved ones (Gemma 3 270M Q4_K_M on a 2-core Zen 3, single stream: 24 vs 34 ms a token;
  // its 178 MB LM head alone 11 vs 17 ms). The tile shape changes no result (see the
  // batch-invariance NOTE above).
  if (M == 1) {
    q8_rows<F, 1, 1>(x, 0, w, rb, nb, ne, out);
    return;
  }
  // Rows of x in slabs of 64 (weights of a 16-column block are reread from L1 for each group of
  // 4 rows); results staged per Stage::kCols columns (see Stage in qlinear_impl.h).
  Stage st(out, M, nb);
  for (int64_t s0 = nb; s0 < ne; s0 += Stage::kCols) {
    const int64_t s1 = std::min(ne, s0 + Stage::kCols);
    for (int64_t m0 = 0; m0 < M; m0 += 64)
      for (int64_t n0 = s0; n0 < s1; n0 += 16)
        q8_range<F>(x, m0, std::min<int64_t>(M, m0 + 64), w, rb, n0, std::min<int64_t>(s1, n0 + 16), st.out);
    st.flush_and_move(s1);
  }
}

// Whether fmt is a ggml block format (the ones this file multiplies).
inline bool q8_format(int64_t fmt) {
  return fmt == kFmtQ8_0 || fmt == kFmtQ4_0 || fmt == kFmtQ4_1 || fmt == kFmtQ5_0 || fmt == kFmtQ4_K ||
         fmt == kFmtQ5_K || fmt == kFmtQ6_K || fmt == kFmtMxfp4;
}

// The offset a format stores its values with (Q4_0: q + 8, Q5_0: q + 16), which the quantized x
// carries sums for; 0 for the others.
inline int q8_offset(int64_t fmt) {
  return fmt == kFmtQ4_0 ? Q4_0::kOffset : fmt == kFmtQ5_0 ? Q5_0::kOffset : 0;
}

// x [M, K] quantized to 8-bit blocks of 32 for formats of `offset` (the buffers it points into).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> ds;
  std::vector<int32_t> os;  // 8 int32 per block of 32, for offset formats
  XQ xq;
};

template <typename X>
void quantize_x(const X* x, int64_t M, int64_t K, int offset, QuantizedX& out) {
  const int64_t nbx = K / 32;
  out.q.resize(size_t(M * K));
  out.ds.resize(size_t(2 * M * nbx));
  out.os.resize(offset ? size_t(M * nbx * 8) : 0);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t m = b; m < e; ++m) {
      const X* xr = x + m * K;
      for (int64_t k = 0; k < K; ++k) {
        if constexpr (sizeof(X) == 2) row[k] = bf16_to_float(xr[k]);
        else row[k] = xr[k];
      }
      quantize_row(row.data(), K, out.q.data() + m * K, out.ds.data() + m * nbx,
                   out.ds.data() + (M + m) * nbx, offset ? out.os.data() + m * nbx * 8 : nullptr, offset);
    }
  });
  out.xq = XQ{out.q.data(), out.ds.data(), out.ds.data() + M * nbx, out.os.data(), K};
}

// Output columns [nb, ne) of the product of x quantized for fmt's offset with ggml format fmt.
inline void q8_range_fmt(int64_t fmt, const XQ& xq, int64_t M, const uint8_t* w, int64_t rb,
                         const Out& out, int64_t nb, int64_t ne) {
  switch (fmt) {
    case kFmtQ8_0: return q8_product_range<Q8_0>(xq, M, w, rb, out, nb, ne);
    case kFmtQ4_0: return q8_product_range<Q4_0>(xq, M, w, rb, out, nb, ne);
    case kFmtQ4_1: return q8_product_range<Q4_1>(xq, M, w, rb, out, nb, ne);
    case kFmtQ5_0: return q8_product_range<Q5_0>(xq, M, w, rb, out, nb, ne);
    case kFmtQ4_K: return q8_product_range<Q4_K>(xq, M, w, rb, out, nb, ne);
    case kFmtQ5_K: return q8_product_range<Q5_K>(xq, M, w, rb, out, nb, ne);
    case kFmtQ6_K: return q8_product_range<Q6_K>(xq, M, w, rb, out, nb, ne);
    case kFmtMxfp4: return q8_product_range<MXFP4>(xq, M, w, rb, out, nb, ne);
  }
}
