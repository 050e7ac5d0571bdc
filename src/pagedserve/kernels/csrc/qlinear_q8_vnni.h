// The small-batch 8-bit kernel of qlinear_q8.h on AVX512-VNNI, bit for bit: the same integer block
// products and the same fp32 operations in the same order, with fewer instructions. Included by
// qlinear.cpp inside `namespace isa_avx512bf16` after qlinear_impl.h (every CPU of that level has
// AVX512-VNNI: detect_isa requires it); it reads the formats through qlinear_blocks.h's block
// routines and x through qlinear_q8.h's quantization (both `::isa_avx2::`).
//
//   y[m, n] = sum_b  dx[m, b] * dw[n, b] * (qx[m, b] . qw[n, b])   (- the mins term)
//
// What changes against the AVX2 body: two blocks of 32 (b, b + 1) go through one 512-bit
// vpdpbusd (64 u8 x s8 products summed four at a time: lanes 0-7 block b, 8-15 block b + 1) in
// place of two maddubs + madd pairs, one int32 -> fp32 conversion of 16 lanes, and the scales
// dw * dx of a K-quant super-block's 8 blocks in one multiply. vpdpbusd multiplies unsigned
// weights by signed x, so signed formats are taken as q + 128 (and Q6_K's q - 32 likewise) and
// the block starts at -128 * (sums of 4 qx); Q4_0 / Q5_0 start at -offset * (sums of 4 qx), as the
// AVX2 body subtracts them. Each lane is then the exact int32 the AVX2 body's madd lane holds
// (Q6_K: times its int16 multiplier, exact too).
//
// NOTE: bit-identical to qlinear_q8.h, which is what keeps batch invariance and the ISA levels'
// agreement: per (row, column) two 8-lane fp32 chains, the even blocks' (with the K-quants' mins
// FNMADD per unit) and the odd blocks' (Q4_1: each block's min just before it), one FMA per block
// in the order of K with fl(dw * dx) as its scale; then acc_sum(even + odd) (`::isa_avx2::acc_sum`)
// and `::isa_avx2::put_out`. Here the two chains are the halves of one 16-lane accumulator: a
// pair of blocks is one 512-bit FMA. Any change here must keep tests/kernels/test_qlinear_vnni1.py
// (this kernel against the AVX2 body, every DOT8 format) green.

#if PS_ISA != 3
#error "qlinear_q8_vnni.h is the AVX512-BF16 (+ VNNI) build only"
#endif

// log2 of the offset a format's bytes are multiplied with (value = byte - offset), or -1 for none:
// signed formats (Q8_0, MXFP4, Q4_Z, Q8_F; Q6_K outside its own unpacking below) are taken as
// q + 128, Q4_0 / Q5_0 store q + 8 / q + 16, the unsigned K-quants and Q4_1 none.
template <class F>
constexpr int q8v_shift() {
  return !F::kUnsigned ? 7 : F::kOffset == 8 ? 3 : F::kOffset == 16 ? 4 : -1;
}

// Block t of unit u as the unsigned bytes vpdpbusd takes, and its scale dw. (Q6_K, the one
// format with int16 multipliers, has its own unpacking: Unit<Q6_K> below.)
template <class F>
__attribute__((always_inline)) inline __m256i q8v_block(const typename F::Head& h, const uint8_t* u, int t,
                                                        float* dw) {
  static_assert(!F::kMul16, "Q6_K is unpacked by Unit<Q6_K>");
  __m256i v = F::block(h, u, t, dw, nullptr);
  if constexpr (!F::kUnsigned) v = _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));  // q + 128
  return v;
}

inline __m512i q8v_join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// A K-quant super-block read two blocks (t, t + 1; t even) at a time. `Unit<F>` in general: the
// blocks of qlinear_blocks.h joined; Q4_K and Q6_K (the formats of Q4_K_M files) unpack a pair at
// once. Each gives:
//   kShift           q8v_shift's meaning for the bytes pair() returns;
//   dsc(h, u)        the 8 blocks' scales dw (Q6_K: d; its int8 scales go in `mul`);
//   Prep prep(h, u)  what a unit's pairs share;
//   pair(h, p, u, t, &mul)  the 64 bytes of blocks t and t + 1 (and Q6_K's 16 int32 multipliers).
template <class F>
struct Unit {
  static constexpr int kShift = q8v_shift<F>();
  struct Prep {};
  static __m256 dsc(const typename F::Head& h, const uint8_t*) { return _mm256_loadu_ps(h.dsc); }
  static Prep prep(const typename F::Head&, const uint8_t*) { return {}; }
  static __m512i pair(const typename F::Head& h, const Prep&, const uint8_t* u, int t, __m512i*) {
    float dw;
    return q8v_join(q8v_block<F>(h, u, t, &dw), q8v_block<F>(h, u, t + 1, &dw));
  }
};

// Q4_K: blocks t and t + 1 are the low and high nibbles of the same 32 bytes.
template <>
struct Unit<::isa_avx2::Q4_K> {
  static constexpr int kShift = -1;
  struct Prep {};
  static __m256 dsc(const ::isa_avx2::KHead& h, const uint8_t*) { return _mm256_loadu_ps(h.dsc); }
  static Prep prep(const ::isa_avx2::KHead&, const uint8_t*) { return {}; }
  static __m512i pair(const ::isa_avx2::KHead&, const Prep&, const uint8_t* u, int t, __m512i*) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 16 + 16 * t)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(v, __mmask32(0xFFFF0000u), v, 4), _mm512_set1_epi8(0xF));
  }
};

// Q6_K: q (0..63, before its - 32: the start term's offset 32) of blocks t = 4 h + j and t + 1
// (j = 0 or 2): the low (j = 0) or high nibbles of the 64 bytes ql[64 h ..], and bits 2 j, 2 j + 1
// (2 j + 2, 2 j + 3) of qh[32 h ..]; the int8 scales sc[2 t .. 2 t + 3], each over 4 lanes.
template <>
struct Unit<::isa_avx2::Q6_K> {
  static constexpr int kShift = 5;
  struct Prep {
    __m512i sc;  // the 16 int8 scales as int32
  };
  static __m256 dsc(const ::isa_avx2::Q6_K::Head& h, const uint8_t*) { return _mm256_set1_ps(h.d); }
  static Prep prep(const ::isa_avx2::Q6_K::Head&, const uint8_t* u) {
    return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192)))};
  }
  static __m512i pair(const ::isa_avx2::Q6_K::Head&, const Prep& p, const uint8_t* u, int t, __m512i* mul) {
    const int hh = t / 4, j = t % 4;
    const __m512i ql = _mm512_loadu_si512(u + 64 * hh);
    const __m512i lo = _mm512_and_si512(j == 0 ? ql : _mm512_srli_epi16(ql, 4), _mm512_set1_epi8(0xF));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 128 + 32 * hh)));
    // bits 2 j, 2 j + 1 to 4, 5 in the low half; 2 j + 2, 2 j + 3 in the high half
    const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16(short(2 * j)), _mm256_set1_epi16(short(2 * j + 2)), 1);
    const __m512i hi = _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, sh), 4), _mm512_set1_epi8(0x30));
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(2 * t),
                                         _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    *mul = _mm512_permutexvar_epi32(idx, p.sc);
    return _mm512_or_si512(lo, hi);
  }
};

// Row m's bytes of blocks b, b + 1 (xv, 64 u8 x s8 products against a weight pair's bytes) and
// the int32 that pair's vpdpbusd starts from (start): 0, or for formats with an offset (kShift
// >= 0, q8v_shift) minus x.o's sums of 4 qx times 2^kShift, the AVX2 body's subtracted term.
// Starting there gives the int32 of product-then-subtract (wrapping arithmetic either way); a
// tile computes it once per row of x for all its weight rows. Lanes 0-7 block b, 8-15 b + 1;
// then (Q6_K) times its int16 multipliers, converted, and one FMA with the pair's scales.
template <int kShift>
__attribute__((always_inline)) inline void q8v_x_pair(const ::isa_avx2::XQ& x, int64_t m, int64_t b, __m512i* xv,
                                                      __m512i* start) {
  const int64_t nbx = x.K / 32;
  *xv = _mm512_loadu_si512(x.q + m * x.K + b * 32);
  *start = _mm512_setzero_si512();
  if constexpr (kShift >= 0)
    *start = _mm512_sub_epi32(*start, _mm512_slli_epi32(_mm512_loadu_si512(x.o + (m * nbx + b) * 8), kShift));
}

// One block b alone (the last of an odd count, so an even one): as the AVX2 body, on 256-bit
// vpdpbusd, into the even chain.
template <class F>
__attribute__((always_inline)) inline __m256 q8v_single(const ::isa_avx2::XQ& x, int64_t m, int64_t b,
                                                        __m256i v, __m256 s, __m256 acc) {
  const int64_t nbx = x.K / 32;
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * x.K + b * 32));
  __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v, xv);
  constexpr int sh = q8v_shift<F>();
  if constexpr (sh >= 0)
    p = _mm256_sub_epi32(p, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.o + (m * nbx + b) * 8)), sh));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc);
}

// fl(dw * dx[m, b]) broadcast: the AVX2 body's _mm256_mul_ps(set1(dw), broadcast(dx)).
inline __m256 q8v_scale(const ::isa_avx2::XQ& x, int64_t m, int64_t b, float dw) {
  return _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_broadcast_ss(x.d + m * (x.K / 32) + b));
}

inline __m512 q8v_join_ps(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

// Tiles: MB rows of x (from row m0) times NB weight rows (w, stride rb), over all of K. Each
// output is one 16-lane accumulator: lanes 0-7 the AVX2 body's acc0 (even blocks, the K-quants'
// mins), lanes 8-15 its acc1 (odd blocks), lane for lane the same operations (qlinear_q8.h's
// q8_tile NOTE).
template <class F, int MB, int NB>
__attribute__((always_inline)) inline void q8v_tile(const ::isa_avx2::XQ& x, int64_t m0, const uint8_t* w,
                                                    int64_t rb, float* res) {
  using ::isa_avx2::kPrefetchRows;
  const int64_t nbx = x.K / 32;
  __m512 acc[MB * NB];
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) acc[t] = _mm512_setzero_ps();
  if constexpr (F::kBlocks == 8) {  // K-quant super-blocks: pairs (t, t + 1) within a unit
    for (int64_t u = 0; u < x.K / F::kUnit; ++u) {
      typename F::Head h[NB];
      const uint8_t* wu[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        wu[j] = w + j * rb + u * F::kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb + 128), _MM_HINT_T0);
        if (F::kBytes > 192) _mm_prefetch(reinterpret_cast<const char*>(wu[j] + kPrefetchRows * rb + 192), _MM_HINT_T0);
        h[j] = F::head(wu[j]);
      }
      if constexpr (F::kMins) {  // the even chain (lanes 0-7) only
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          const __m512 xs = _mm512_castps256_ps512(_mm256_loadu_ps(x.s + (m0 + i) * nbx + u * 8));
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j)
            acc[i * NB + j] = _mm512_mask3_fnmadd_ps(_mm512_castps256_ps512(h[j].mins), xs, acc[i * NB + j], __mmask16(0x00FF));
        }
      }
      // fl(dw * dx) of the unit's 8 blocks at once, lane t: the AVX2 body's per-block product
      __m512 sc[MB * NB];
      typename Unit<F>::Prep prep[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        prep[j] = Unit<F>::prep(h[j], wu[j]);
        const __m256 dw = Unit<F>::dsc(h[j], wu[j]);
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i)
          sc[i * NB + j] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(x.d + (m0 + i) * nbx + u * 8)));
      }
#pragma GCC unroll 4
      for (int t = 0; t < 8; t += 2) {
        const int64_t b = u * 8 + t;
        const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(t), _mm256_set1_epi32(t + 1), 1);
        __m512i v[NB], mul[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) v[j] = Unit<F>::pair(h[j], prep[j], wu[j], t, &mul[j]);
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          __m512i xv, start;
          q8v_x_pair<Unit<F>::kShift>(x, m0 + i, b, &xv, &start);
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) {
            __m512i p = _mm512_dpbusd_epi32(start, v[j], xv);
            if constexpr (F::kMul16) p = _mm512_mullo_epi32(p, mul[j]);
            acc[i * NB + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick, sc[i * NB + j]), acc[i * NB + j]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int t = 0; t < MB * NB; ++t)
      res[t] = ::isa_avx2::acc_sum(_mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1)));
  } else {  // one block per unit: pairs of units (u, u + 1)
    static_assert(F::kBlocks == 1, "a unit is one block or a K-quant super-block");
    static_assert(!F::kMul16, "one-block formats have no int16 multipliers");
    constexpr int kShift = q8v_shift<F>();
    int64_t b = 0;
    for (; b + 2 <= nbx; b += 2) {
      __m512i v[NB];
      __m512 dw[NB];  // lanes 0-7 block b's dw, 8-15 block b + 1's
      __m512 mins[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const uint8_t* wb = w + j * rb + b * F::kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchRows * rb), _MM_HINT_T0);
        if (2 * F::kBytes > 64) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchRows * rb + 64), _MM_HINT_T0);
        const typename F::Head h0 = F::head(wb), h1 = F::head(wb + F::kBytes);
        if constexpr (F::kMins) mins[j] = q8v_join_ps(h0.mins, h1.mins);
        float dw0, dw1;
        v[j] = q8v_join(q8v_block<F>(h0, wb, 0, &dw0), q8v_block<F>(h1, wb + F::kBytes, 0, &dw1));
        dw[j] = q8v_join_ps(_mm256_set1_ps(dw0), _mm256_set1_ps(dw1));
      }
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const int64_t m = m0 + i;
        if constexpr (F::kMins) {  // Q4_1: each block's min term just before it, in its chain
          const float* sp = x.s + m * nbx + b;
          const __m512 xs = q8v_join_ps(_mm256_setr_ps(sp[0], 0, 0, 0, 0, 0, 0, 0), _mm256_setr_ps(sp[1], 0, 0, 0, 0, 0, 0, 0));
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_fnmadd_ps(mins[j], xs, acc[i * NB + j]);
        }
        // What row m shares across the NB weight rows: its bytes, the start term and dx.
        // NOTE: fl(dw * dx) is one IEEE product per lane either way: q8v_scale's bits.
        __m512i xv, start;
        q8v_x_pair<kShift>(x, m, b, &xv, &start);
        const float* dp = x.d + m * nbx + b;
        const __m512 dx = q8v_join_ps(_mm256_broadcast_ss(dp), _mm256_broadcast_ss(dp + 1));
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) {
          const __m512i p = _mm512_dpbusd_epi32(start, v[j], xv);
          acc[i * NB + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[j], dx), acc[i * NB + j]);
        }
      }
    }
    __m256 lo[MB * NB];
#pragma GCC unroll 16
    for (int t = 0; t < MB * NB; ++t) lo[t] = _mm512_castps512_ps256(acc[t]);
    if (b < nbx) {  // the last block alone: the even chain
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const uint8_t* wb = w + j * rb + b * F::kBytes;
        const typename F::Head h0 = F::head(wb);
        float dw;
        const __m256i v0 = q8v_block<F>(h0, wb, 0, &dw);
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          if constexpr (F::kMins) {
            const float* sp = x.s + (m0 + i) * nbx + b;
            lo[i * NB + j] = _mm256_fnmadd_ps(h0.mins, _mm256_setr_ps(sp[0], 0, 0, 0, 0, 0, 0, 0), lo[i * NB + j]);
          }
          lo[i * NB + j] = q8v_single<F>(x, m0 + i, b, v0, q8v_scale(x, m0 + i, b, dw), lo[i * NB + j]);
        }
      }
    }
#pragma GCC unroll 16
    for (int t = 0; t < MB * NB; ++t) res[t] = ::isa_avx2::acc_sum(_mm256_add_ps(lo[t], _mm512_extractf32x8_ps(acc[t], 1)));
  }
}

template <class F, int MB, int NB = (MB <= 2 ? 4 : 2)>
inline void q8v_rows(const ::isa_avx2::XQ& x, int64_t m0, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1,
                     const Out& out) {
  float res[MB * NB];
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    q8v_tile<F, MB, NB>(x, m0, w + n * rb, rb, res);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) ::isa_avx2::put_out(out, m0 + i, n + j, res[i * NB + j]);
  }
  for (; n < n1; ++n) {
    q8v_tile<F, MB, 1>(x, m0, w + n * rb, rb, res);
    for (int i = 0; i < MB; ++i) ::isa_avx2::put_out(out, m0 + i, n, res[i]);
  }
}

template <class F>
inline void q8v_range(const ::isa_avx2::XQ& x, int64_t m0, int64_t m1, const uint8_t* w, int64_t rb,
                      int64_t n0, int64_t n1, const Out& out) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) q8v_rows<F, 4>(x, m, w, rb, n0, n1, out);
  switch (m1 - m) {
    case 3: q8v_rows<F, 3>(x, m, w, rb, n0, n1, out); break;
    case 2: q8v_rows<F, 2>(x, m, w, rb, n0, n1, out); break;
    case 1: q8v_rows<F, 1>(x, m, w, rb, n0, n1, out); break;
  }
}

// Output columns [nb, ne) (whole 16-row blocks of W) of the product with x quantized with
// offset 1 (x.o: the plain sums of 4 qx): qlinear_q8.h's q8_product_range, tile for tile.
template <class F>
void q8v_product_range(const ::isa_avx2::XQ& x, int64_t M, const uint8_t* w, int64_t rb, const Out& out,
                       int64_t nb, int64_t ne) {
  // NOTE: one weight row at a time for one row of x, as q8_product_range (see its NOTE). On Zen 4
  // (one core, weights out of cache: the decode case) 1 row beat 2 and 4 for Q4_K and Q6_K (Q6_K
  // LM head 12.5 GB/s against 9.0 and 7.2); with the weights in L3, 4 rows were faster (15.4
  // against 10.7 GB/s, Q4_K), a case decode does not have.
  if (M == 1) {
    q8v_rows<F, 1, 1>(x, 0, w, rb, nb, ne, out);
    return;
  }
  ::isa_avx2::Stage st(out, M, nb);
  for (int64_t s0 = nb; s0 < ne; s0 += ::isa_avx2::Stage::kCols) {
    const int64_t s1 = std::min(ne, s0 + ::isa_avx2::Stage::kCols);
    for (int64_t m0 = 0; m0 < M; m0 += 64)
      for (int64_t n0 = s0; n0 < s1; n0 += 16)
        q8v_range<F>(x, m0, std::min<int64_t>(M, m0 + 64), w, rb, n0, std::min<int64_t>(s1, n0 + 16), st.out);
    st.flush_and_move(s1);
  }
}

// qlinear_q8.h's q8_range_fmt on this level: x quantized with offset 1 (`q8v_offset`).
inline void q8v_range_fmt(int64_t fmt, const ::isa_avx2::XQ& xq, int64_t M, const uint8_t* w, int64_t rb,
                          const Out& out, int64_t nb, int64_t ne) {
  ::isa_avx2::visit_dot8(fmt, [&](auto f) { q8v_product_range<typename decltype(f)::type>(xq, M, w, rb, out, nb, ne); });
}

// The offset x is quantized with for this kernel: 1, so that x.o holds the plain sums of 4 qx
// that every format's start term is a power-of-two multiple of.
constexpr int q8v_offset = 1;
