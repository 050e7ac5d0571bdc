// The AVX512-BF16 GEMM over ggml blocks: rows of x in the vector lanes, weights broadcast.
// Included by qlinear_impl.h (PS_ISA >= 3), used by its run_range when the product was prepared
// with x packed (run_prepare(..., pack = true): ggml formats from gemm_rows rows on, K % 32 == 0).
//
//   acc[j] (16 lanes: rows m0 .. m0 + 15 of x)  +=  x[m, 2p .. 2p + 1] . w[n0 + j, 2p .. 2p + 1]
//
// x is packed once per call as pairs of bf16 (`pack_x_pairs`: [M / 16][K / 2][16 rows][2], the
// layout AMX's B tiles read too), so one 64-byte load feeds 16 rows; each weight pair is
// broadcast from the block's dequantized rows (vdpbf16ps with a 32-bit broadcast operand). 16
// accumulators (16 columns) per group of 16 rows: no horizontal sums at all (the dot-product form
// of `dot_block` ends every 4 x 4 tile with shuffle trees: ~16% of the work at K = 640); one
// 16 x 16 transpose per tile puts the results in y's row order.
//
// NOTE: batch invariance. y[m, n] is one lane that walks K in pairs, in order, whatever M is and
// wherever row m sits (a padding row is zeros and is never stored). So results do not depend on
// the batch among GEMM-sized batches; they differ from the 8-bit kernel's below gemm_rows rows,
// which is why this path serves only the ggml formats outside the batch-invariant mode (bf16 and
// INT8 weights keep `dot_block`, invariant at every M).

#if PS_ISA < 3
#error "qlinear_bcast.h needs AVX512-BF16"
#endif

#include "transpose16.h"

// x [M, K] bf16 -> xpk [ceil(M / 16)][K / 32][16 pairs][16 rows][2], zero-padded rows: each
// 1 KiB tile (16 rows x 16 pairs) one 32-bit transpose, the tiles in parallel (a bit-exact move:
// shuffles only).
inline void pack_x_pairs(const uint16_t* x, int64_t M, int64_t K, uint16_t* xpk) {
  const int64_t KC = K / 32, MBk = (M + 15) / 16;
  at::parallel_for(0, MBk * KC, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t mb = t / KC, kc = t % KC, rows = std::min<int64_t>(16, M - mb * 16);
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(x + (mb * 16 + i) * K + kc * 32))
                        : _mm512_setzero_ps();
      transpose16(r);  // r[p]: pair p of the 16 rows
      float* dst = reinterpret_cast<float*>(xpk + t * 512);
      for (int p = 0; p < 16; ++p) _mm512_store_ps(dst + p * 16, r[p]);
    }
  });
}

// y[m, n0 .. n0 + nr) = v + bias, rounded once to y's dtype (as put_out, 16 at a time).
inline void put_out16(const Out& o, int64_t m, int64_t n0, __m512 v, int64_t nr) {
  const __mmask16 mask = (__mmask16)((1u << nr) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + n0));
  const int64_t at = m * o.ldy + (n0 - o.n0);
  if (o.fp32) {
    _mm512_mask_storeu_ps(static_cast<float*>(o.y) + at, mask, v);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.y) + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows 32 mb .. 32 mb + 31 (two groups of 16) times columns j0 .. j0 + 7 of the block: 16
// accumulators, two x loads and 8 broadcasts a step (fewer loads than one group x 16 columns).
inline void bcast_tile2(const uint16_t* xb0, const uint16_t* xb1, int64_t K, const uint32_t* wp,
                        int64_t ldp, __m512* c0, __m512* c1) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) c0[j] = c1[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xb0 + p * 32);
    const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xb1 + p * 32);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(int(wp[j * ldp + p]));
      c0[j] = _mm512_dpbf16_ps(c0[j], x0, wv);
      c1[j] = _mm512_dpbf16_ps(c1[j], x1, wv);
    }
  }
}

// One group of 16 rows times the block's 16 columns.
inline void bcast_tile1(const uint16_t* xb, int64_t K, const uint32_t* wp, int64_t ldp, __m512* acc) {
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + p * 32);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_set1_epi32(int(wp[j * ldp + p])));
  }
}

inline void bcast_store(const Out& out, int64_t M, int64_t mb, __m512* acc, int64_t n0, int64_t nr) {
  transpose16(acc);
  const int64_t rows = std::min<int64_t>(16, M - mb * 16);
  for (int64_t i = 0; i < rows; ++i) put_out16(out, mb * 16 + i, n0, acc[i], nr);
}

// Row groups [mb0, mb1) of x (packed) times the nr (<= 16) rows of one dequantized block (bf16,
// rows of ldw; rows nr .. 15 are zeros).
inline void bcast_block(const uint16_t* xpk, int64_t M, int64_t K, int64_t mb0, int64_t mb1,
                        const uint16_t* w, int64_t ldw, int64_t nr, const Out& out, int64_t n0) {
  const int64_t KC = K / 32;
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  const int64_t ldp = ldw / 2;  // pairs per weight row
  int64_t mb = mb0;
  for (; mb + 2 <= mb1; mb += 2) {
    __m512 a0[16], a1[16];
    const uint16_t* xb0 = xpk + mb * KC * 512;
    bcast_tile2(xb0, xb0 + KC * 512, K, wp, ldp, a0, a1);
    bcast_tile2(xb0, xb0 + KC * 512, K, wp + 8 * ldp, ldp, a0 + 8, a1 + 8);
    bcast_store(out, M, mb, a0, n0, nr);
    bcast_store(out, M, mb + 1, a1, n0, nr);
  }
  if (mb < mb1) {
    __m512 acc[16];
    bcast_tile1(xpk + mb * KC * 512, K, wp, ldp, acc);
    bcast_store(out, M, mb, acc, n0, nr);
  }
}

// Output columns [nb, ne) (whole 16-row blocks of W, format fmt) of the product with packed x.
// NOTE: blocked for the caches: kBlocks weight blocks are dequantized at once (their bf16 rows
// stay in L2) and multiplied by slabs of kSlab row groups of x (a slab stays in L2 across the
// blocks); one pass over all of x per block read x from L3 at K = 2048, M = 256 (half the speed).
inline void bcast_range(int64_t fmt, const uint16_t* xpk, int64_t M, int64_t K, const uint8_t* w,
                        int64_t row_bytes, int64_t N, const Out& out, int64_t nb, int64_t ne) {
  constexpr int64_t kBlocks = 4, kSlab = 4;
  const int64_t ldw = K + 32;  // see the NOTE on ldw in run_range
  const int64_t MBk = (M + 15) / 16;
  std::vector<uint16_t> buf(size_t(kBlocks * 16 * ldw + 32));
  std::vector<float> tmp(static_cast<size_t>(K));
  uint16_t* wb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  Stage st(out, M, nb);
  for (int64_t g0 = nb; g0 < ne; g0 += kBlocks * 16) {
    const int64_t g1 = std::min(ne, g0 + kBlocks * 16);
    if (g1 - st.out.n0 > Stage::kCols) st.flush_and_move(g0);  // the whole group fits
    for (int64_t n = g0; n < g1; ++n) dequant_ahead(fmt, w + n * row_bytes, row_bytes, K, wb + (n - g0) * ldw, tmp.data());
    const int64_t filled = g1 - g0, padded = (filled + 15) / 16 * 16;
    if (filled < padded) std::memset(wb + filled * ldw, 0, size_t((padded - filled) * ldw) * 2);
    for (int64_t s0 = 0; s0 < MBk; s0 += kSlab)
      for (int64_t n0 = g0; n0 < g1; n0 += 16)
        bcast_block(xpk, M, K, s0, std::min(MBk, s0 + kSlab), wb + (n0 - g0) * ldw, ldw,
                    std::min<int64_t>(16, g1 - n0), st.out, n0);
  }
  if (nb < ne) st.flush_and_move(ne);
}
