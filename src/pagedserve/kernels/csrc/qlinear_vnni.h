// The 8-bit GEMM over DOT8 blocks (the formats whose gemm is VNNI in qformats.h) on AVX512-VNNI: rows of x in
// the vector lanes, weights broadcast, integer products by vpdpbusd (64 per instruction: twice
// vdpbf16ps's 32). Included by qlinear_impl.h at the AVX512-BF16 level (every CPU of that level
// has AVX512-VNNI: detect_isa requires it), used from gemm_rows rows on for these formats.
//
//   y[m, n] = sum_b  fl(dx[m, b] * dw[n, b]) * (qx[m, b] . qw[n, b])  -  mw[n, b] * sx[m, b]
//
// over the blocks b of 32 values: dw the block's scale (the K-quants: d * sc), mw its min term
// (the K-quants: dmin * mn; Q4_1: -m; else none) and sx[m, b] = dx * sum(qx). x is the 8-bit quantization
// of the small-batch kernel (qlinear_q8.h `quantize_x`: qx = round(x * 127 / amax), dx = amax /
// 127), packed once per call (`vnni_quantize_pack`) as signed bytes, four k of one row per 32-bit lane:
// [M / 16][K / 32][8 quads][16 rows][4], with -sum(qx) per row and block. The weights of a block
// of columns are unpacked once per call into unsigned bytes as the formats store them (Q4_0 /
// Q5_0 / the K-quants: q; Q8_0: q + 128), broadcast four at a time; each block's integer sum
// starts at -offset * sum(qx) (offset 8, 16, 0, 128), which cancels the stored offset exactly, so
// it is exact; then one fp32 FMA per block and row (and one for the mins). Q6_K (an int8 scale per
// 16 values: kMul16) sums each half of a block apart, from -128 * that half's sum(qx), and its
// block's integer sum is sc0 * lo + sc1 * hi, exact in int32 too.
//
// NOTE: batch invariance. y[m, n] is one lane that walks the blocks of K in order, whatever M is
// and wherever row m sits (a padding row is zeros and is never stored), so results do not
// depend on the batch among GEMM-sized batches. The small-batch kernel sums the same exact block
// products in another order (8 lanes, then a horizontal sum): the two differ in the last bits,
// which is why this path serves only outside the batch-invariant mode, as the bf16 GEMM does.

#if PS_ISA != 3
#error "qlinear_vnni.h is the AVX512-BF16 (+ VNNI) build only"
#endif

// x quantized and packed for the tiles: xq [MBk][KB][8][16][4] bytes, dx and sx [MBk][KB][16],
// nsum [MBk][KB][16] = -sum(qx), nsum_lo the same over a block's first 16 values (Q6_K's halves).
// NOTE: uninitialized storage (no zero fill: a prompt's x is 1-5 MB, which one thread cleared
// while the other waited); vnni_quantize_pack writes every element, padding rows as zeros.
struct VnniX {
  std::unique_ptr<uint8_t[]> buf;
  std::unique_ptr<float[]> dxsx;        // dx, then sx
  std::unique_ptr<int32_t[]> sums;      // nsum, then nsum_lo
  const uint8_t* xq = nullptr;
  const float* dx = nullptr;
  const float* sx = nullptr;
  const int32_t* nsum = nullptr;
  const int32_t* nsum_lo = nullptr;
};

// 16 values of x as fp32 (bf16 widened exactly).
__attribute__((always_inline)) inline __m512 vnni_load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
__attribute__((always_inline)) inline __m512 vnni_load16(const float* p) { return _mm512_loadu_ps(p); }

// One row of x (K values) to blocks of 32 exactly as ::isa_avx2::quantize_row computes them (the
// same amax, 127 / amax, products, round-to-nearest-even conversion and int sums: the same qx, d
// and s, bit for bit), on 16 lanes; with each block's sum(qx) and the sum of its first 16 values.
template <typename X>
inline void vnni_quantize_row(const X* x, int64_t KB, int8_t* q, float* d, float* s, int32_t* sum, int32_t* lo) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 v0 = vnni_load16(x + b * 32), v1 = vnni_load16(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
    const __m512 vid = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(i1));
    const int32_t l = _mm512_reduce_add_epi32(i0), t = l + _mm512_reduce_add_epi32(i1);
    d[b] = amax / 127.0f;
    s[b] = d[b] * float(t);
    sum[b] = t;
    lo[b] = l;
  }
}

// x [M][K] (bf16 or fp32) quantized as quantize_x quantizes it (vnni_quantize_row: the same qx,
// dx and sx, bit for bit) and packed into the lanes layout, in one pass: each task takes whole
// groups of 16 rows, quantizes them into its own buffer and transposes them into place.
template <typename X>
inline void vnni_quantize_pack(const X* x, int64_t M, int64_t K, VnniX& out) {
  const int64_t KB = K / 32, MBk = (M + 15) / 16, n = MBk * KB * 16;
  out.buf.reset(new uint8_t[size_t(n * 32 + 64)]);
  out.dxsx.reset(new float[size_t(2 * n)]);
  out.sums.reset(new int32_t[size_t(2 * n)]);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(out.buf.get()) + 63) & ~uintptr_t(63));
  float* dx = out.dxsx.get();
  float* sx = dx + n;
  int32_t* nsum = out.sums.get();
  int32_t* nsum_lo = nsum + n;
  at::parallel_for(0, MBk, 1, [&](int64_t g0, int64_t g1) {
    std::unique_ptr<int8_t[]> q(new int8_t[size_t(16 * K)]);
    std::unique_ptr<float[]> ds(new float[size_t(32 * KB)]);     // d, then s: [16][KB] each
    std::unique_ptr<int32_t[]> ts(new int32_t[size_t(32 * KB)]);  // sum, then lo: [16][KB] each
    const __m512i rows_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(int32_t(K / 4)));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t rows = std::min<int64_t>(16, M - g * 16);
      for (int64_t mi = 0; mi < rows; ++mi)
        vnni_quantize_row(x + (g * 16 + mi) * K, KB, q.get() + mi * K, ds.get() + mi * KB,
                          ds.get() + (16 + mi) * KB, ts.get() + mi * KB, ts.get() + (16 + mi) * KB);
      if (rows < 16) {  // padding rows: zeros
        std::memset(q.get() + rows * K, 0, size_t((16 - rows) * K));
        for (int64_t h = 0; h < 2; ++h) {
          std::fill(ds.get() + (16 * h + rows) * KB, ds.get() + (16 * h + 16) * KB, 0.0f);
          std::fill(ts.get() + (16 * h + rows) * KB, ts.get() + (16 * h + 16) * KB, 0);
        }
      }
      for (int64_t b = 0; b < KB; ++b) {
        // dst[p][mi][0..3] = q[mi][b * 32 + 4 p ..]: the 16 rows' 8 dwords transposed, gathered
        // from the group's buffer (in L1 / L2) one quad p at a time
        uint8_t* dst = base + (g * KB + b) * 512;
        const int8_t* qb = q.get() + b * 32;
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p)
          _mm512_store_si512(dst + p * 64, _mm512_i32gather_epi32(rows_at, qb + 4 * p, 4));
        const int64_t at = (g * KB + b) * 16;
        for (int mi = 0; mi < 16; ++mi) {
          dx[at + mi] = ds[mi * KB + b];
          sx[at + mi] = ds[(16 + mi) * KB + b];
          nsum[at + mi] = -ts[mi * KB + b];
          nsum_lo[at + mi] = -ts[(16 + mi) * KB + b];
        }
      }
    }
  });
  out.xq = base;
  out.dx = dx;
  out.sx = sx;
  out.nsum = nsum;
  out.nsum_lo = nsum_lo;
}

// The offset a format's unpacked bytes carry (value = byte - offset, times the scale): log2 of
// it, or -1 for none. Signed formats (Q8_0, Q4_Z, Q8_F) are unpacked as q + 128.
template <class F>
constexpr int vnni_offset_shift() {
  return !F::kUnsigned ? 7 : F::kOffset == 8 ? 3 : F::kOffset == 16 ? 4 : -1;
}

// One row of W (K values, format F) -> unsigned bytes wq [K] (see vnni_offset_shift) and, per
// block of 32, its scale dw and min term mw (0 without mins); Q6_K: sc [K / 32][2], the int8
// scales of each block's halves.
template <typename F>
inline void vnni_weight_row(const uint8_t* row, int64_t K, uint8_t* wq, float* dw, float* mw, int32_t* sc) {
  for (int64_t u = 0; u < K / F::kUnit; ++u) {
    const uint8_t* up = row + u * F::kBytes;
    const typename F::Head h = F::head(up);
    float mins[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if constexpr (F::kMins) _mm256_storeu_ps(mins, h.mins);
    for (int t = 0; t < F::kBlocks; ++t) {
      const int64_t b = u * F::kBlocks + t;
      float d;
      __m256i mul = _mm256_setzero_si256();
      __m256i v = F::block(h, up, t, &d, &mul);
      if constexpr (!F::kUnsigned) v = _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));  // q + 128
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + b * 32), v);
      dw[b] = d;
      mw[b] = mins[t];
      if constexpr (F::kMul16) {
        sc[2 * b] = int16_t(_mm256_extract_epi16(mul, 0));
        sc[2 * b + 1] = int16_t(_mm256_extract_epi16(mul, 8));
      }
    }
  }
}

// Per-block weight data of a group of columns: rows of KB.
struct VnniW {
  const uint8_t* wq;  // rows of ldq bytes
  int64_t ldq;
  const float* dw;
  const float* mw;
  const int32_t* sc;  // Q6_K: [columns][KB][2], the halves' int8 scales
  int shift;          // vnni_offset_shift
};

// A block's integer sums start at -offset * sum(qx) (zero without an offset).
inline __m512i vnni_start(const int32_t* nsum, int shift) {
  return shift < 0 ? _mm512_setzero_si512() : _mm512_sll_epi32(_mm512_loadu_si512(nsum), _mm_cvtsi32_si128(shift));
}

// A block's integer sums over 16 rows of x: s[j] for the NB columns of w (wcol(j, p): the 4 bytes
// of quad p of the column's block), xv the block's 8 quads of 16 rows. kMul16 (Q6_K): each half
// (quads 0-3, 4-7) from its own start, then sc0 * lo + sc1 * hi (sc[j]: the column's scale pair).
template <bool kMul16, int NB, class W>
__attribute__((always_inline)) inline void vnni_sums(const __m512i* xv, const int32_t* nsb, const int32_t* nlb,
                                                     int shift, W wcol, const int32_t* const* sc, __m512i* s) {
  if constexpr (!kMul16) {
    const __m512i z = vnni_start(nsb, shift);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) s[j] = z;
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i x = _mm512_load_si512(xv + p);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) s[j] = _mm512_dpbusd_epi32(s[j], _mm512_set1_epi32(wcol(j, p)), x);
    }
  } else {
    const __m512i nl = _mm512_loadu_si512(nlb);
    const __m512i zl = _mm512_sll_epi32(nl, _mm_cvtsi32_si128(shift));
    const __m512i zh = _mm512_sll_epi32(_mm512_sub_epi32(_mm512_loadu_si512(nsb), nl), _mm_cvtsi32_si128(shift));
    __m512i lo[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) lo[j] = zl, s[j] = zh;
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i x = _mm512_load_si512(xv + p);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m512i wb = _mm512_set1_epi32(wcol(j, p));
        if (p < 4) lo[j] = _mm512_dpbusd_epi32(lo[j], wb, x);
        else s[j] = _mm512_dpbusd_epi32(s[j], wb, x);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      s[j] = _mm512_add_epi32(_mm512_mullo_epi32(lo[j], _mm512_set1_epi32(sc[j][0])),
                              _mm512_mullo_epi32(s[j], _mm512_set1_epi32(sc[j][1])));
  }
}


// Lines to prefetch into L2, a few per block of a tile's loop (a burst of them stalled on the miss
// buffers: 7.5% of the LM head's time).
struct PrefetchStream {
  const char* p = nullptr;
  const char* end = nullptr;
  __attribute__((always_inline)) inline void step() {
    for (int i = 0; i < 5 && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

// 16 rows of x (one packed group: xb, dxb, sxb) times 8 weight columns from column c of w:
// r[j] = column c + j over the 16 rows.
template <bool kMins, bool kMul16>
inline void vnni_tile8(const uint8_t* xb, const float* dxb, const float* sxb, const int32_t* nsb,
                       const int32_t* nlb, int64_t KB, const VnniW& w, int64_t c, __m512* r,
                       PrefetchStream& pf) {
  PrefetchStream ps = pf;  // in registers through the loop (pf's address is taken)
  const uint8_t* wq = w.wq + c * w.ldq;
  const int64_t ldq = w.ldq;
  const float* dw = w.dw + c * KB;
  const float* mw = w.mw + c * KB;
  __m512 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    ps.step();
    const __m512i* xv = reinterpret_cast<const __m512i*>(xb + b * 512);
    __m512i s[8];
    const int32_t* sc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) sc[j] = kMul16 ? w.sc + ((c + j) * KB + b) * 2 : nullptr;
    const auto wcol = [&](int j, int p) {
      int32_t wv;
      std::memcpy(&wv, wq + j * ldq + b * 32 + 4 * p, 4);
      return wv;
    };
    vnni_sums<kMul16, 8>(xv, nsb + b * 16, nlb + b * 16, w.shift, wcol, sc, s);
    const __m512 d = _mm512_loadu_ps(dxb + b * 16);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j]), _mm512_mul_ps(d, _mm512_set1_ps(dw[j * KB + b])), acc[j]);
    if constexpr (kMins) {
      const __m512 sv = _mm512_loadu_ps(sxb + b * 16);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fnmadd_ps(sv, _mm512_set1_ps(mw[j * KB + b]), acc[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) r[j] = acc[j];
  pf = ps;
}

// Two groups of 16 rows (xb0 / xb1, 32 rows) times 4 weight columns from column c: r0[j], r1[j]
// = column c + j over each group's rows. The same per-lane steps as vnni_tile8 (so the same
// bits), with half the weight broadcasts per product.
template <bool kMins, bool kMul16>
inline void vnni_tile2x4(const uint8_t* xb0, const uint8_t* xb1, const float* dx0, const float* dx1,
                         const float* sx0, const float* sx1, const int32_t* ns0, const int32_t* ns1,
                         const int32_t* nl0, const int32_t* nl1, int64_t KB, const VnniW& w, int64_t c,
                         __m512* r0, __m512* r1, PrefetchStream& pf) {
  PrefetchStream ps = pf;  // in registers through the loop (pf's address is taken)
  const uint8_t* wq = w.wq + c * w.ldq;
  const int64_t ldq = w.ldq;
  const float* dw = w.dw + c * KB;
  const float* mw = w.mw + c * KB;
  __m512 a0[4], a1[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    ps.step();
    const __m512i* xv0 = reinterpret_cast<const __m512i*>(xb0 + b * 512);
    const __m512i* xv1 = reinterpret_cast<const __m512i*>(xb1 + b * 512);
    __m512i s0[4], s1[4];
    if constexpr (!kMul16) {
      const __m512i z0 = vnni_start(ns0 + b * 16, w.shift), z1 = vnni_start(ns1 + b * 16, w.shift);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) s0[j] = z0, s1[j] = z1;
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i x0 = _mm512_load_si512(xv0 + p), x1 = _mm512_load_si512(xv1 + p);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          int32_t wv;
          std::memcpy(&wv, wq + j * ldq + b * 32 + 4 * p, 4);
          const __m512i wb = _mm512_set1_epi32(wv);
          s0[j] = _mm512_dpbusd_epi32(s0[j], wb, x0);
          s1[j] = _mm512_dpbusd_epi32(s1[j], wb, x1);
        }
      }
    } else {  // Q6_K: one row group after the other (its halves take twice the registers)
      const int32_t* sc[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) sc[j] = w.sc + ((c + j) * KB + b) * 2;
      const auto wcol = [&](int j, int p) {
        int32_t wv;
        std::memcpy(&wv, wq + j * ldq + b * 32 + 4 * p, 4);
        return wv;
      };
      vnni_sums<true, 4>(xv0, ns0 + b * 16, nl0 + b * 16, w.shift, wcol, sc, s0);
      vnni_sums<true, 4>(xv1, ns1 + b * 16, nl1 + b * 16, w.shift, wcol, sc, s1);
    }
    const __m512 d0 = _mm512_loadu_ps(dx0 + b * 16), d1 = _mm512_loadu_ps(dx1 + b * 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 wd = _mm512_set1_ps(dw[j * KB + b]);
      a0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[j]), _mm512_mul_ps(d0, wd), a0[j]);
      a1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[j]), _mm512_mul_ps(d1, wd), a1[j]);
    }
    if constexpr (kMins) {
      const __m512 v0 = _mm512_loadu_ps(sx0 + b * 16), v1 = _mm512_loadu_ps(sx1 + b * 16);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512 m = _mm512_set1_ps(mw[j * KB + b]);
        a0[j] = _mm512_fnmadd_ps(v0, m, a0[j]);
        a1[j] = _mm512_fnmadd_ps(v1, m, a1[j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) r0[j] = a0[j], r1[j] = a1[j];
  pf = ps;
}

// Output columns [nb, ne) (whole 16-row blocks of W, format fmt) of the product with packed x.
// NOTE: blocked for the caches as bcast_range is: kCols columns unpacked at once (they stay in
// L2) and multiplied by slabs of kSlab row groups of x (a slab stays in L2 across them).
template <class F>
inline void vnni_range(const VnniX& vx, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                       const Out& out, int64_t nb, int64_t ne) {
  constexpr int64_t kCols = 64, kSlab = 4;
  const int64_t KB = K / 32, MBk = (M + 15) / 16;
  const int64_t ldq = K + 64;  // bytes: 8 columns read side by side stay out of one L1 set
  // uninitialized: a group's rows are unpacked (or zeroed past ne) before its tiles read them
  std::unique_ptr<uint8_t[]> buf(new uint8_t[size_t(kCols * ldq + 64)]);
  uint8_t* wq = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.get()) + 63) & ~uintptr_t(63));
  std::unique_ptr<float[]> dwmw(new float[size_t(2 * kCols * KB)]);
  float* const dw = dwmw.get();
  float* const mw = dw + kCols * KB;
  std::unique_ptr<int32_t[]> scb(F::kMul16 ? new int32_t[size_t(kCols * KB * 2)] : nullptr);
  int32_t* const sc = scb.get();
  const VnniW wv{wq, ldq, dw, mw, sc, vnni_offset_shift<F>()};
  constexpr bool mins = F::kMins, mul16 = F::kMul16;
  Stage st(out, M, nb);
  for (int64_t g0 = nb; g0 < ne; g0 += kCols) {
    const int64_t g1 = std::min(ne, g0 + kCols);
    if (g1 - st.out.n0 > Stage::kCols) st.flush_and_move(g0);  // the whole group fits
    for (int64_t n = g0; n < g1; ++n) {
      const int64_t c = n - g0;
      prefetch_ahead(w + n * row_bytes, row_bytes);  // as dequant_ahead does
      vnni_weight_row<F>(w + n * row_bytes, K, wq + c * ldq, dw + c * KB, mw + c * KB,
                         mul16 ? sc + c * KB * 2 : nullptr);
    }
    const int64_t filled = g1 - g0, padded = (filled + 15) / 16 * 16;
    if (filled < padded) {  // missing columns: zeros (never stored)
      std::memset(wq + filled * ldq, 0, size_t((padded - filled) * ldq));
      std::fill(dw + filled * KB, dw + padded * KB, 0.0f);
      std::fill(mw + filled * KB, mw + padded * KB, 0.0f);
      if (mul16) std::fill(sc + filled * KB * 2, sc + padded * KB * 2, 0);
    }
    for (int64_t s0 = 0; s0 < MBk; s0 += kSlab)
      for (int64_t n0 = g0; n0 < g1; n0 += 16) {
        const int64_t c = n0 - g0;
        const int64_t s1 = std::min(MBk, s0 + kSlab);
        // NOTE: why both prefetches: unpacking a group streams its W rows from memory (the LM
        // head: 178 MB a step) while its tiles run from cache, so memory idled during the tiles
        // and the tiles during the unpacking. The next group's rows matching these 16 columns go
        // to L2 during this group's tiles (T1: T0 was slower), and each row's unpacking asks for
        // the lines 2.5 KiB on; Q8_0 LM head at 16 rows 331 -> 395 GFLOP/s, 64 rows 533 -> 574
        // (Zen 4, 2 cores; only the first alone: 346, only the second: 367), asked 5 lines a
        // block of the tiles' loops (PrefetchStream), not in one burst: 16 rows 395 -> 489, 64 rows
        // 573 -> 611.
        PrefetchStream pf;  // (what the tiles leave unasked the row-ahead prefetch covers)
        if (s0 == 0 && n0 + kCols < ne) {
          pf.p = reinterpret_cast<const char*>(w + (n0 + kCols) * row_bytes);
          pf.end = reinterpret_cast<const char*>(w + std::min(ne, n0 + kCols + 16) * row_bytes);
        }
        int64_t mb = s0;
        for (; mb + 2 <= s1; mb += 2) {  // two row groups at a time
          __m512 acc0[16], acc1[16];
          const uint8_t* xb0 = vx.xq + mb * KB * 512;
          const float* dx0 = vx.dx + mb * KB * 16;
          const float* sx0 = vx.sx + mb * KB * 16;
          const int32_t* ns0 = vx.nsum + mb * KB * 16;
          const int32_t* nl0 = vx.nsum_lo + mb * KB * 16;
          for (int64_t q = 0; q < 16; q += 4)
            vnni_tile2x4<mins, mul16>(xb0, xb0 + KB * 512, dx0, dx0 + KB * 16, sx0, sx0 + KB * 16, ns0,
                                      ns0 + KB * 16, nl0, nl0 + KB * 16, KB, wv, c + q, acc0 + q, acc1 + q, pf);
          bcast_store(st.out, M, mb, acc0, n0, std::min<int64_t>(16, g1 - n0));
          bcast_store(st.out, M, mb + 1, acc1, n0, std::min<int64_t>(16, g1 - n0));
        }
        for (; mb < s1; ++mb) {
          __m512 acc[16];
          const uint8_t* xb = vx.xq + mb * KB * 512;
          const float* dxb = vx.dx + mb * KB * 16;
          const float* sxb = vx.sx + mb * KB * 16;
          const int32_t* nsb = vx.nsum + mb * KB * 16;
          const int32_t* nlb = vx.nsum_lo + mb * KB * 16;
          vnni_tile8<mins, mul16>(xb, dxb, sxb, nsb, nlb, KB, wv, c, acc, pf);
          vnni_tile8<mins, mul16>(xb, dxb, sxb, nsb, nlb, KB, wv, c + 8, acc + 8, pf);
          bcast_store(st.out, M, mb, acc, n0, std::min<int64_t>(16, g1 - n0));
        }
      }
  }
  if (nb < ne) st.flush_and_move(ne);
}

// The same for DOT8 format fmt (its table row's gemm is VNNI: ps_fmt::vnni_format).
inline void vnni_range(int64_t fmt, const VnniX& vx, int64_t M, int64_t K, const uint8_t* w,
                       int64_t row_bytes, const Out& out, int64_t nb, int64_t ne) {
  ::isa_avx2::visit_dot8(fmt, [&](auto f) {
    using F = typename decltype(f)::type;
    vnni_range<F>(vx, M, K, w, row_bytes, out, nb, ne);
  });
}
