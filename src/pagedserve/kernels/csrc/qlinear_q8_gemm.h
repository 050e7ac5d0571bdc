// The 8-bit GEMM over DOT8 blocks on AVX2 (the formats whose gemm is Q8 or VNNI in qformats.h), from gemm_rows
// rows of x on: included once by qlinear.cpp, inside `namespace isa_avx2` after qlinear_q8.h
// (whose x quantization and format unpacking it uses).
//
//   y[m, n] = sum_b  fl(dw[n, b] * dx[m, b]) * P[m, n, b]  (- mw[n, b] * sx[m, b], the K-quants)
//
// over the blocks b of 32 values, P the exact integer dot product of the block (Q6_K: with its
// two int8 sub-scales inside). x is the small-batch kernel's 8-bit quantization (`quantize_x`).
// A tile of 16 weight rows is unpacked once per call into bytes, four k of one column per 32-bit
// lane: [K / 32][8 quads][16 columns][4], with per column and block its scale, its min (the
// K-quants) and, for Q6_K, its sub-scales as int16 pairs. Every row of x then runs over the tile:
// four bytes of x broadcast, `maddubs` against eight columns at once, the int16 pair sums of up
// to kGroup quads added before one `madd` (their bound keeps them exact), then one fp32 FMA per
// block for eight columns. How the signs meet `maddubs` (u8 x s8) depends on the format:
//   Q4_0 / Q4_1 / Q5_0 / Q4_K / Q5_K  the stored unsigned q (<= 31) against signed x; Q4_0 /
//                              Q5_0 then subtract offset * sum(qx) of the row's block (`gemm_x`),
//                              exactly (Q4_1 adds its min term as the K-quants do);
//   Q6_K                       x + 128 (unsigned) against q - 32, minus 128 * the column's
//                              sub-scaled sums of w (computed when the tile is unpacked);
//   Q8_0                       |w| against sign(x, w) (|w| up to 128: no headroom), quad by quad.
// So per 32 products it issues ~1.1-2 multiply instructions where the small-batch kernel issues 2
// plus its fp32 work, and no weight block is unpacked twice.
//
// NOTE: batch invariance among GEMM-sized batches: y[m, n] is one lane that walks the blocks in
// order with the same instructions, whatever M is and wherever row m sits (tiles of 2 or 1 rows
// run the same per-row steps). The small-batch kernel sums the same exact block products in
// another order (8 lanes along K, then a horizontal sum): the two differ in the last bits, which is
// why this path serves only outside the batch-invariant mode (`gemm_rows`).

#if PS_ISA != 1
#error "qlinear_q8_gemm.h is the AVX2 build only"
#endif

constexpr int64_t kGCols = 16;  // weight rows (output columns) per tile

// The tile of kGCols weight rows, unpacked (see the file comment); sized for K once per call.
struct GTile {
  std::vector<int8_t> q, aq;      // [nb][8][16][4]; aq = |q| (Q8_0 only)
  std::vector<float> dw, mw;      // [nb][16]
  std::vector<int32_t> corr, sc;  // Q6_K: [nb][16] its correction; [nb][2][16] sub-scales as int16 pairs
  explicit GTile(int64_t nb, bool sign, bool mins, bool sub)
      : q(size_t(nb * 512)), aq(sign ? size_t(nb * 512) : 0), dw(size_t(nb * 16)),
        mw(mins ? size_t(nb * 16) : 0), corr(sub ? size_t(nb * 16) : 0), sc(sub ? size_t(nb * 32) : 0) {}
};

// How the GEMM reads a format: quads of int16 pair sums added before a `madd` (kGroup), the sign
// trick (Q8_0), the K-quants' mins, Q6_K's sub-scales. kGroup * 2 * 255 * max|w| <= 32767.
// kStored: the weights stay unsigned as stored (q <= 31), against signed x: maddubs(q, x), pairs
// <= 2 * 127 * 31, and no per-column correction (Q4_0 / Q5_0 subtract offset * sum(qx) per row
// and block instead; the K-quants' q have no offset). Q6_K: x + 128 against q - 32 (its
// sub-scales multiply whole halves, so the offset is corrected per column, with them).
// Derived from the block struct (qlinear_blocks.h): signed values without sub-scales take the
// sign trick (Q8_0, Q4_Z, Q8_F), sub-scaled ones x + 128 (Q6_K), unsigned ones stay as stored;
// kGroup is the most quads (8, 4, 2 or 1) whose int16 pair sums stay exact.
template <class F>
struct GemmTraits {
  static constexpr bool kSign = !F::kUnsigned && !F::kMul16, kSub = F::kMul16, kStored = F::kUnsigned;
  static constexpr int kPairMax = 2 * (kSub ? 255 : 127) * F::kMaxQ;  // |int16 pair sum| of one quad
  static constexpr int kGroup = 8 * kPairMax <= 32767 ? 8 : 4 * kPairMax <= 32767 ? 4 : 2 * kPairMax <= 32767 ? 2 : 1;
  static_assert(kPairMax <= 32767, "a format's values must fit maddubs' int16 pairs");
};

// log2 of a stored format's offset (Q4_0: 8, Q5_0: 16), -1 for none.
template <class F> constexpr int offset_shift() { return F::kOffset == 8 ? 3 : F::kOffset == 16 ? 4 : -1; }

// 8 vectors of 8 dwords (v[c] = column c's 32 bytes of a block) -> o[s] = quad s of the 8 columns.
inline void transpose8(const __m256i* v, __m256i* o) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // columns 0-3, then 4-7
    const __m256i* tt = t + 4 * h;
    u[4 * h + 0] = _mm256_unpacklo_epi64(tt[0], tt[2]);  // quads 0 | 4
    u[4 * h + 1] = _mm256_unpackhi_epi64(tt[0], tt[2]);  // 1 | 5
    u[4 * h + 2] = _mm256_unpacklo_epi64(tt[1], tt[3]);  // 2 | 6
    u[4 * h + 3] = _mm256_unpackhi_epi64(tt[1], tt[3]);  // 3 | 7
  }
  for (int s = 0; s < 4; ++s) {
    o[s] = _mm256_permute2x128_si256(u[s], u[4 + s], 0x20);
    o[s + 4] = _mm256_permute2x128_si256(u[s], u[4 + s], 0x31);
  }
}

// Weight rows [n0, n0 + cols) (cols <= 16; the rest of the tile is zeros) -> the tile.
template <class F>
void g_unpack(const uint8_t* w, int64_t rb, int64_t n0, int64_t cols, int64_t K, GTile& t) {
  using T = GemmTraits<F>;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t u = 0; u < K / F::kUnit; ++u) {
    for (int half = 0; half < 2; ++half) {  // columns 0-7, then 8-15
      typename F::Head h[8];
      const uint8_t* wu[8];
      for (int c = 0; c < 8; ++c) {
        const int64_t n = half * 8 + c;
        wu[c] = n < cols ? w + (n0 + n) * rb + u * F::kBytes : nullptr;
        if (wu[c]) h[c] = F::head(wu[c]);
      }
      for (int bt = 0; bt < F::kBlocks; ++bt) {
        const int64_t b = u * F::kBlocks + bt;
        __m256i v[8], o[8];
        alignas(32) float dw[8], mw[8];
        alignas(32) int32_t sc[2][8];
        for (int c = 0; c < 8; ++c) {
          if (!wu[c]) {
            v[c] = _mm256_setzero_si256();
            dw[c] = mw[c] = 0.0f;
            sc[0][c] = sc[1][c] = 0;
            continue;
          }
          __m256i mul;
          v[c] = F::block(h[c], wu[c], bt, &dw[c], &mul);
          if constexpr (F::kMins) {
            alignas(32) float m8[8];
            _mm256_store_ps(m8, h[c].mins);
            mw[c] = m8[bt];
          }
          if constexpr (T::kSub) {
            const int8_t* s8 = reinterpret_cast<const int8_t*>(wu[c] + 192);
            sc[0][c] = s8[2 * bt];
            sc[1][c] = s8[2 * bt + 1];
          }
        }
        transpose8(v, o);
        int8_t* q = t.q.data() + b * 512 + half * 32;
        __m256i cs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // column sums by half
        for (int s = 0; s < 8; ++s) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + s * 64), o[s]);
          if constexpr (T::kSign)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.aq.data() + b * 512 + half * 32 + s * 64),
                                _mm256_sign_epi8(o[s], o[s]));
          else if constexpr (T::kSub)
            cs[s / 4] = _mm256_add_epi32(cs[s / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, o[s]), ones16));
        }
        const int64_t at = b * 16 + half * 8;
        _mm256_storeu_ps(t.dw.data() + at, _mm256_load_ps(dw));
        if constexpr (F::kMins) _mm256_storeu_ps(t.mw.data() + at, _mm256_load_ps(mw));
        if constexpr (T::kSub) {  // 128 * sum_h sc_h * sum_h(w), and the madd multipliers
          const __m256i s0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc[0]));
          const __m256i s1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc[1]));
          const __m256i corr = _mm256_add_epi32(_mm256_mullo_epi32(cs[0], s0), _mm256_mullo_epi32(cs[1], s1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.corr.data() + at), _mm256_slli_epi32(corr, 7));
          // the madd multipliers: each sub-scale in both int16 halves of its column's lane
          const __m256i m16 = _mm256_set1_epi32(0xFFFF);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.sc.data() + b * 32 + half * 8),
                              _mm256_or_si256(_mm256_and_si256(s0, m16), _mm256_slli_epi32(s0, 16)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.sc.data() + b * 32 + 16 + half * 8),
                              _mm256_or_si256(_mm256_and_si256(s1, m16), _mm256_slli_epi32(s1, 16)));
        }
      }
    }
  }
}

inline __m256i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [m0, m0 + MB) of x over the tile: res[i][c], c < 16 (before bias and rounding).
template <class F, int MB>
__attribute__((always_inline)) inline void g_rows(const XQ& x, const uint8_t* xu, const int32_t* xsum, int64_t m0,
                                                  const GTile& t, float (*res)[kGCols]) {
  using T = GemmTraits<F>;
  const int64_t K = x.K, nb = K / 32;
  const __m256i ones16 = _mm256_set1_epi16(1);
  const uint8_t* xr = T::kSign || T::kStored ? reinterpret_cast<const uint8_t*>(x.q) : xu;
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qb = t.q.data() + b * 512;
    __m256i P[MB][2];
#pragma GCC unroll 8
    for (int g = 0; g < 8 / T::kGroup; ++g) {
      __m256i S[MB][2];
#pragma GCC unroll 8
      for (int e = 0; e < T::kGroup; ++e) {
        const int s = g * T::kGroup + e;
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + s * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + s * 64 + 32));
        __m256i a0, a1;
        if constexpr (T::kSign) {
          a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.aq.data() + b * 512 + s * 64));
          a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.aq.data() + b * 512 + s * 64 + 32));
        }
#pragma GCC unroll 2
        for (int i = 0; i < MB; ++i) {
          const __m256i xb = bcast4(xr + (m0 + i) * K + b * 32 + 4 * s);
          __m256i p0, p1;
          if constexpr (T::kSign) {  // |w| * sign(x, w): |x| <= 127, |w| <= 128 fit int16 pairs
            p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
            p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
          } else if constexpr (T::kStored) {  // stored unsigned q times signed x
            p0 = _mm256_maddubs_epi16(w0, xb);
            p1 = _mm256_maddubs_epi16(w1, xb);
          } else {  // (x + 128) unsigned times w signed
            p0 = _mm256_maddubs_epi16(xb, w0);
            p1 = _mm256_maddubs_epi16(xb, w1);
          }
          S[i][0] = e ? _mm256_add_epi16(S[i][0], p0) : p0;
          S[i][1] = e ? _mm256_add_epi16(S[i][1], p1) : p1;
        }
      }
      __m256i m0v = ones16, m1v = ones16;
      if constexpr (T::kSub) {  // the sub-scale of this group's half (quads 0-3 / 4-7)
        const int32_t* sc = t.sc.data() + b * 32 + (g * T::kGroup / 4) * 16;
        m0v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc));
        m1v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 8));
      }
#pragma GCC unroll 2
      for (int i = 0; i < MB; ++i) {
        const __m256i q0 = _mm256_madd_epi16(S[i][0], m0v), q1 = _mm256_madd_epi16(S[i][1], m1v);
        P[i][0] = g ? _mm256_add_epi32(P[i][0], q0) : q0;
        P[i][1] = g ? _mm256_add_epi32(P[i][1], q1) : q1;
      }
    }
    const __m256 dw0 = _mm256_loadu_ps(t.dw.data() + b * 16), dw1 = _mm256_loadu_ps(t.dw.data() + b * 16 + 8);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0;
    if constexpr (T::kSub) {
      c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.corr.data() + b * 16));
      c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.corr.data() + b * 16 + 8));
    }
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const __m256 dx = _mm256_broadcast_ss(x.d + (m0 + i) * nb + b);
      if constexpr (F::kMins) {
        const __m256 sx = _mm256_broadcast_ss(x.s + (m0 + i) * nb + b);
        acc[i][0] = _mm256_fnmadd_ps(_mm256_loadu_ps(t.mw.data() + b * 16), sx, acc[i][0]);
        acc[i][1] = _mm256_fnmadd_ps(_mm256_loadu_ps(t.mw.data() + b * 16 + 8), sx, acc[i][1]);
      }
      if constexpr (T::kStored && offset_shift<F>() >= 0) {  // - offset * sum(qx), exactly
        const __m256i o = _mm256_slli_epi32(_mm256_set1_epi32(xsum[(m0 + i) * nb + b]), offset_shift<F>());
        P[i][0] = _mm256_sub_epi32(P[i][0], o);
        P[i][1] = _mm256_sub_epi32(P[i][1], o);
      } else if constexpr (T::kSub) {  // x + 128 against q - 32: - the column's correction
        P[i][0] = _mm256_sub_epi32(P[i][0], c0);
        P[i][1] = _mm256_sub_epi32(P[i][1], c1);
      }
      acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[i][0]), _mm256_mul_ps(dw0, dx), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[i][1]), _mm256_mul_ps(dw1, dx), acc[i][1]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_ps(res[i], acc[i][0]);
    _mm256_storeu_ps(res[i] + 8, acc[i][1]);
  }
}

// Output columns [nb, ne) of the GEMM (whole 16-row blocks of W but for the last).
template <class F>
void g_product_range(const XQ& x, const uint8_t* xu, const int32_t* xsum, int64_t M, const uint8_t* w, int64_t rb, const Out& out,
                     int64_t nb, int64_t ne) {
  using T = GemmTraits<F>;
  GTile tile(x.K / 32, T::kSign, F::kMins, T::kSub);
  float res[2][kGCols];
  Stage st(out, M, nb);  // see Stage in qlinear_impl.h
  for (int64_t s0 = nb; s0 < ne; s0 += Stage::kCols) {
    const int64_t s1 = std::min(ne, s0 + Stage::kCols);
    for (int64_t n0 = s0; n0 < s1; n0 += kGCols) {
      const int64_t cols = std::min<int64_t>(kGCols, s1 - n0);
      g_unpack<F>(w, rb, n0, cols, x.K, tile);
      // The next tile's weight rows (one contiguous run of bytes) prefetched while the rows of x
      // run over this one, spread over the row pairs. NOTE: why: the 262,144-row LM head streams
      // its 178 MB from memory; unpacking on demand stalled on every line (M = 16: 0.5x the
      // small-batch kernel's speed). Past the last row the addresses leave W: prefetches never fault.
      const char* next = reinterpret_cast<const char*>(w + (n0 + kGCols) * rb);
      const int64_t lines = (kGCols * rb + 63) / 64, per = (lines + (M + 1) / 2 - 1) / ((M + 1) / 2);
      int64_t line = 0;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) {
        for (int64_t e = std::min(lines, line + per); line < e; ++line) _mm_prefetch(next + line * 64, _MM_HINT_T0);
        g_rows<F, 2>(x, xu, xsum, m, tile, res);
        for (int i = 0; i < 2; ++i)
          for (int64_t c = 0; c < cols; ++c) put_out(st.out, m + i, n0 + c, res[i][c]);
      }
      if (m < M) {
        g_rows<F, 1>(x, xu, xsum, m, tile, res);
        for (int64_t c = 0; c < cols; ++c) put_out(st.out, m, n0 + c, res[0][c]);
      }
    }
    st.flush_and_move(s1);
  }
}

// Output columns [nb, ne) of the GEMM with DOT8 format fmt; xu = x.q as unsigned x + 128.
inline void g_range_fmt(int64_t fmt, const XQ& x, const uint8_t* xu, const int32_t* xsum, int64_t M, const uint8_t* w, int64_t rb,
                        const Out& out, int64_t nb, int64_t ne) {
  visit_dot8(fmt, [&](auto f) { g_product_range<typename decltype(f)::type>(x, xu, xsum, M, w, rb, out, nb, ne); });
}

// x.q [M][K] as unsigned bytes x + 128 (the GEMM's x for Q6_K), and each block's sum(qx)
// (xsum [M][K / 32], for the stored-offset formats).
inline void gemm_x(const XQ& x, int64_t M, std::vector<uint8_t>& u, std::vector<int32_t>& xsum) {
  const int64_t nb = x.K / 32;
  u.resize(size_t(M * x.K));
  xsum.resize(size_t(M * nb));
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    const __m256i flip = _mm256_set1_epi8(char(0x80)), ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t i = b * nb; i < e * nb; ++i) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u.data() + i * 32), _mm256_xor_si256(q, flip));
      const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      xsum[size_t(i)] = _mm_cvtsi128_si32(t);
    }
  });
}
