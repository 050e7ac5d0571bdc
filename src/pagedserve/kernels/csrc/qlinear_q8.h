// Integer dot products of weight blocks (the DOT8 formats of qformats.h) with 8-bit activations
// (AVX2), as llama.cpp computes its quantized products: included once by qlinear.cpp, inside
// `namespace isa_avx2` after qlinear_impl.h (whose helpers and block routines, qlinear_blocks.h,
// it uses), and run for the DOT8 formats at every ISA level (qlinear_q8_vnni.h: its twin on VNNI).
//
//   y[m, n] = sum_b  dx[m, b] * dw[n, b] * (qx[m, b] . qw[n, b])   (- the K-quants' mins term)
//
// Each row of x is quantized first (`quantize_x`) to blocks of 32: qx int8 in [-127, 127] and an
// fp32 scale dx = amax / 127 (Q8_0-style, with an fp32 scale; also for the K-quants, whose
// sub-blocks are 32 wide, or 16 wide for Q6_K with an int16 multiplier per half). Each weight block
// of 32 is unpacked to 8 bits (`Q8_0`, `Q4_0`, ... of qlinear_blocks.h) and multiplied with _mm256_maddubs_epi16
// -- on |qw| and sign(qx, qw) for signed values (Q8_0, Q6_K), on the stored unsigned values as
// they are for the others (Q4_0 / Q5_0 then subtract offset * sum(qx), precomputed per block of x)
// -- then _mm256_madd_epi16: exact int32 sums (the same either way), one fp32 FMA per block.
//
// NOTE: batch invariance. y[m, n] is two 8-lane fp32 accumulators (the even and the odd blocks)
// that walk the blocks of K in order with the same instructions (mins term of a super-block, then
// its blocks' FMAs with the scale dw * dx computed the same way), then their lane-wise sum and the
// fixed horizontal sum of qlinear_impl.h (`acc_sum`), + bias and one rounding, whatever the tile
// (MB rows x NB columns) it sits in (q8_tile's NOTE); the int32 block sums are exact. So a row's result does not depend on M or its neighbours. Keep it
// so: every tile shape instantiates the one `q8_tile` template, and nothing depends on M.
// NOTE: qlinear_q8_vnni.h performs these very operations on AVX512-VNNI CPUs (bit for bit, tested
// against this body): a change to the order or the scales here is a change there too.

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

// The weight formats' block routines (Q8_0, Q4_0, ..., `head` / `block`) are in qlinear_blocks.h.

// ---------------------------------------------------------------------------------------------
// Tiles: MB rows of x (from row m0) times NB weight rows (w, stride rb), over all of K.
// ---------------------------------------------------------------------------------------------

// One unit u (a K-quant super-block of 8 blocks, or one block) of MB rows of x times NB weight
// rows: the unit's mins term into acc0, then block t's FMA into acc0 (t even) or acc1 (t odd).
// (One-block formats: the caller passes the chain of the block's parity as both.)
template <class F, int MB, int NB>
__attribute__((always_inline)) inline void q8_unit(const XQ& x, int64_t m0, const uint8_t* w, int64_t rb,
                                                   int64_t u, __m256* acc0, __m256* acc1) {
  const int64_t nbx = x.K / 32;  // blocks of 32 per row
  const __m256i ones16 = _mm256_set1_epi16(1);
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
      for (int j = 0; j < NB; ++j) acc0[i * NB + j] = _mm256_fnmadd_ps(h[j].mins, xs, acc0[i * NB + j]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < F::kBlocks; ++t) {
    const int64_t b = u * F::kBlocks + t;
    __m256* acc = (t & 1) ? acc1 : acc0;
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

// NOTE: the order of the sum, which qlinear_q8_vnni.h repeats lane for lane: two 8-lane chains
// per output, acc0 the even blocks of K (and every mins term of a K-quant super-block; Q4_1's
// of its even blocks), acc1 the odd ones (Q4_1: each block's min term just before it), each in
// the order of K; then acc_sum(acc0 + acc1). Two chains, not one: a single accumulator made the
// one-row product wait on the FMA latency (see docs/benchmarks.md, issue 35's MoE section).
template <class F, int MB, int NB>
__attribute__((always_inline)) inline void q8_tile(const XQ& x, int64_t m0, const uint8_t* w, int64_t rb,
                                                   float* res) {
  __m256 acc0[MB * NB], acc1[MB * NB];
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  const int64_t nu = x.K / F::kUnit;
  if constexpr (F::kBlocks == 8) {
    for (int64_t u = 0; u < nu; ++u) q8_unit<F, MB, NB>(x, m0, w, rb, u, acc0, acc1);
  } else {
    static_assert(F::kBlocks == 1, "a unit is one block or a K-quant super-block");
    int64_t u = 0;
    for (; u + 2 <= nu; u += 2) {
      q8_unit<F, MB, NB>(x, m0, w, rb, u, acc0, acc0);
      q8_unit<F, MB, NB>(x, m0, w, rb, u + 1, acc1, acc1);
    }
    if (u < nu) q8_unit<F, MB, NB>(x, m0, w, rb, u, acc0, acc0);
  }
#pragma GCC unroll 16
  for (int t = 0; t < MB * NB; ++t) res[t] = acc_sum(_mm256_add_ps(acc0[t], acc1[t]));
}

// Tile widths: two accumulators per output, at most 4 outputs a tile (8 of AVX2's 16 registers).
template <class F, int MB, int NB = (MB == 1 ? 4 : 2)>
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

// x [M, K] quantized to 8-bit blocks of 32 for formats of `offset` (the buffers it points into).
struct QuantizedX {
  // NOTE: uninitialized (new T[n], no value-init): quantize_row writes every element, and the
  // zero fill of a prompt's x (1-4 MB) ran on one thread while the other waited.
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> ds;
  std::unique_ptr<int32_t[]> os;  // 8 int32 per block of 32, for offset formats
  XQ xq;
};

// One row of x as fp32 (bf16 widened exactly) into row [K]; fp32 x is read in place.
inline const float* x_row_f32(const float* xr, int64_t, float*) { return xr; }
inline const float* x_row_f32(const uint16_t* xr, int64_t K, float* row) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + k)));
    _mm256_storeu_ps(row + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  for (; k < K; ++k) row[k] = bf16_to_float(xr[k]);
  return row;
}

template <typename X>
void quantize_x(const X* x, int64_t M, int64_t K, int offset, QuantizedX& out) {
  const int64_t nbx = K / 32;
  out.q.reset(new int8_t[size_t(M * K)]);
  out.ds.reset(new float[size_t(2 * M * nbx)]);
  out.os.reset(offset ? new int32_t[size_t(M * nbx * 8)] : nullptr);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    std::unique_ptr<float[]> row(new float[size_t(K)]);
    for (int64_t m = b; m < e; ++m)
      quantize_row(x_row_f32(x + m * K, K, row.get()), K, out.q.get() + m * K, out.ds.get() + m * nbx,
                   out.ds.get() + (M + m) * nbx, offset ? out.os.get() + m * nbx * 8 : nullptr, offset);
  });
  out.xq = XQ{out.q.get(), out.ds.get(), out.ds.get() + M * nbx, out.os.get(), K};
}

// Output columns [nb, ne) of the product of x quantized for fmt's offset with DOT8 format fmt.
inline void q8_range_fmt(int64_t fmt, const XQ& xq, int64_t M, const uint8_t* w, int64_t rb,
                         const Out& out, int64_t nb, int64_t ne) {
  visit_dot8(fmt, [&](auto f) { q8_product_range<typename decltype(f)::type>(xq, M, w, rb, out, nb, ne); });
}
