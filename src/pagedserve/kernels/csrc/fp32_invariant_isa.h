// The SIMD body of fp32_invariant.cpp, included there once per instruction set, inside a
// `#pragma GCC target` region and a namespace that defines:
//   struct V   a 16-lane fp32 vector, with zero/load/store/fmadd/mul/div/set1 and hsum
//   MR, NR     the linear's register tile (rows of x, rows of W)
//   ATT_GH, ATT_DV  attention's register tiles: query heads x 16-lane vectors of the head
// No include guard on purpose; nothing here may include headers (they are included before).
//
// NOTE: the arithmetic order below is the contract of the file: every ISA performs exactly the
// same IEEE operations in the same order (16 lanes, lane j summing the products of k = j, j + 16,
// ... in increasing k with fused multiply-adds, tails zero-filled, then the fixed tree of hsum), so
// results are bit-identical across tiles, row counts, thread counts and the two ISAs.

// ---- linear ---------------------------------------------------------------------------------

// y[m, n] = hsum(sum_k x[m, k] w[n, k]) (+ bias[n]) for an MRT x NRT tile, over k in [k0, k1):
// the accumulators start from zero (k0 == 0) or from `spill` (a previous K block), and end in
// `spill` (k1 < K) or reduced into y (k1 == K; the zero-filled tail is then the last step). Spilling
// stores and reloads the vectors exactly, so K blocks change no bit.
template <int MRT, int NRT>
void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, int64_t k0,
          int64_t k1, const float* bias, float* y, int64_t ldy, float* spill) {
  V acc[MRT][NRT];
  for (int m = 0; m < MRT; ++m)
    for (int n = 0; n < NRT; ++n)
      acc[m][n] = k0 == 0 ? V::zero() : V::load(spill + 16 * (m * NRT + n));
  int64_t k = k0;
  for (; k + 16 <= k1; k += 16) {
    V xv[MRT];
    for (int m = 0; m < MRT; ++m) xv[m] = V::load(x + m * ldx + k);
    for (int n = 0; n < NRT; ++n) {
      const V wv = V::load(w + n * ldw + k);
      for (int m = 0; m < MRT; ++m) acc[m][n] = V::fmadd(xv[m], wv, acc[m][n]);
    }
  }
  if (k < k1) {  // only in the last block (k1 == K)
    const int rem = static_cast<int>(k1 - k);
    V xv[MRT];
    for (int m = 0; m < MRT; ++m) xv[m] = V::load_tail(x + m * ldx + k, rem);
    for (int n = 0; n < NRT; ++n) {
      const V wv = V::load_tail(w + n * ldw + k, rem);
      for (int m = 0; m < MRT; ++m) acc[m][n] = V::fmadd(xv[m], wv, acc[m][n]);
    }
  }
  if (k1 < K) {
    for (int m = 0; m < MRT; ++m)
      for (int n = 0; n < NRT; ++n) acc[m][n].store(spill + 16 * (m * NRT + n));
    return;
  }
  for (int m = 0; m < MRT; ++m)
    for (int n = 0; n < NRT; ++n) {
      const float s = acc[m][n].hsum();
      y[m * ldy + n] = bias ? s + bias[n] : s;
    }
}

template <int MRT>
void tile_n(int nr, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
            int64_t k0, int64_t k1, const float* bias, float* y, int64_t ldy, float* spill) {
  static_assert(NR <= 8, "extend the switch");
#define PS_TILE(NRT) tile<MRT, NRT>(x, ldx, w, ldw, K, k0, k1, bias, y, ldy, spill)
  switch (nr) {
    case 8: if constexpr (NR >= 8) { PS_TILE(8); } break;
    case 7: if constexpr (NR >= 7) { PS_TILE(7); } break;
    case 6: if constexpr (NR >= 6) { PS_TILE(6); } break;
    case 5: if constexpr (NR >= 5) { PS_TILE(5); } break;
    case 4: if constexpr (NR >= 4) { PS_TILE(4); } break;
    case 3: PS_TILE(3); break;
    case 2: PS_TILE(2); break;
    default: PS_TILE(1); break;
  }
#undef PS_TILE
}

// Rows [m0, m1) x columns [n0, n1) of y: K in blocks of kBlockK (a multiple of 16) when it is
// long, so that an NR-row slice of W stays in L1 while all rows of the block pass over it; each
// tile's accumulators wait in `spill` ([tiles][MR * NR][16]) between K blocks.
void linear_block(const float* x, const float* w, const float* bias, float* y, int64_t K,
                  int64_t N, int64_t m0, int64_t m1, int64_t n0, int64_t n1, float* spill) {
  static_assert(MR <= 4, "extend the switch");
  const int64_t kb = K > kSplitK ? kBlockK : K;
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t k1 = std::min(K, k0 + kb);
    float* sp = spill;
    for (int64_t n = n0; n < n1; n += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
      const float* wn = w + n * K;
      const float* bn = bias ? bias + n : nullptr;
      for (int64_t m = m0; m < m1; m += MR, sp += 16 * MR * NR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
        const float* xm = x + m * K;
        float* ym = y + m * N + n;
        switch (mr) {
          case 4: if constexpr (MR >= 4) { tile_n<4>(nr, xm, K, wn, K, K, k0, k1, bn, ym, N, sp); } break;
          case 3: if constexpr (MR >= 3) { tile_n<3>(nr, xm, K, wn, K, K, k0, k1, bn, ym, N, sp); } break;
          case 2: tile_n<2>(nr, xm, K, wn, K, K, k0, k1, bn, ym, N, sp); break;
          default: tile_n<1>(nr, xm, K, wn, K, K, k0, k1, bn, ym, N, sp); break;
        }
      }
    }
  }
}

// ---- activations ---------------------------------------------------------------------------

#include "act_formula.h"

void activation(const float* x, float* y, int64_t n, int64_t act) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) act_v(V::load(x + i), act).store(y + i);
  if (i < n) act_v(V::load_tail(x + i, int(n - i)), act).store_tail(y + i, int(n - i));
}

// bf16 in and out: each value widened to fp32 exactly, the same act_v, one rounding to bf16
// (nearest even, NaN kept a quiet NaN), as torch's bf16 activations round their fp32 results.
void activation_bf16(const uint16_t* x, uint16_t* y, int64_t n, int64_t act) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) act_v(V::load_bf16(x + i), act).store_bf16(y + i);
  if (i < n) {
    alignas(32) uint16_t in[16] = {}, out[16];
    std::memcpy(in, x + i, sizeof(uint16_t) * size_t(n - i));
    act_v(V::load_bf16(in), act).store_bf16(out);
    std::memcpy(y + i, out, sizeof(uint16_t) * size_t(n - i));
  }
}

// act(g) * u, the gated MLP's middle, in one pass: the bits of activation(_bf16) then torch's
// product. bf16: act(g) rounded to bf16 (as activation_bf16 stores it), widened back exactly,
// times u widened, rounded once more (torch's bf16 mul: fp32 product, one rounding); fp32: the
// fp32 product.
void gated(const float* g, const float* u, float* y, int64_t n, int64_t act) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) V::mul(act_v(V::load(g + i), act), V::load(u + i)).store(y + i);
  if (i < n) {
    const int t = int(n - i);
    V::mul(act_v(V::load_tail(g + i, t), act), V::load_tail(u + i, t)).store_tail(y + i, t);
  }
}

void gated_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n, int64_t act) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    V::mul(act_v(V::load_bf16(g + i), act).round_bf16(), V::load_bf16(u + i)).store_bf16(y + i);
  if (i < n) {
    alignas(64) uint16_t gin[16] = {}, uin[16] = {}, out[16];
    std::memcpy(gin, g + i, sizeof(uint16_t) * size_t(n - i));
    std::memcpy(uin, u + i, sizeof(uint16_t) * size_t(n - i));
    V::mul(act_v(V::load_bf16(gin), act).round_bf16(), V::load_bf16(uin)).store_bf16(out);
    std::memcpy(y + i, out, sizeof(uint16_t) * size_t(n - i));
  }
}

// ---- attention ------------------------------------------------------------------------------

// Scores of heads [g0, g0 + GH) against keys t and t + 1 (KT = 2) or t alone (KT = 1): each
// (head, key) is its own 16-lane accumulator over D, so the grouping changes no bit.
template <int GH, int KT>
void score_tile(const float* qs, const float* const* keys, int64_t D, float* out, int64_t L) {
  const int64_t nfull = D / 16, rem = D % 16;
  V a[GH][KT];
  for (int g = 0; g < GH; ++g)
    for (int j = 0; j < KT; ++j) a[g][j] = V::zero();
  for (int64_t i = 0; i < nfull; ++i) {
    V kv[KT];
    for (int j = 0; j < KT; ++j) kv[j] = V::load(keys[j] + 16 * i);
    for (int g = 0; g < GH; ++g) {
      const V qv = V::load(qs + g * D + 16 * i);
      for (int j = 0; j < KT; ++j) a[g][j] = V::fmadd(qv, kv[j], a[g][j]);
    }
  }
  if (rem) {
    V kv[KT];
    for (int j = 0; j < KT; ++j) kv[j] = V::load_tail(keys[j] + 16 * nfull, rem);
    for (int g = 0; g < GH; ++g) {
      const V qv = V::load_tail(qs + g * D + 16 * nfull, rem);
      for (int j = 0; j < KT; ++j) a[g][j] = V::fmadd(qv, kv[j], a[g][j]);
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int j = 0; j < KT; ++j) out[g * L + j] = a[g][j].hsum();
}

// acc[g][d-vectors i0 .. i0 + DV) = sum over the keys, in order, of p[g, t] v_t: lane-wise fused
// multiply-adds in key order, kept in registers across the keys (the order per lane is the same
// for every DV, GH).
template <int GH, int DV>
void value_tile(const float* p, int64_t L, const float* const* vals, int64_t i0, float* acc,
                int64_t D) {
  V a[GH][DV];
  for (int g = 0; g < GH; ++g)
    for (int j = 0; j < DV; ++j) a[g][j] = V::zero();
  for (int64_t t = 0; t < L; ++t) {
    V vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = V::load(vals[t] + 16 * (i0 + j));
    for (int g = 0; g < GH; ++g) {
      const V pg = V::set1(p[g * L + t]);
      for (int j = 0; j < DV; ++j) a[g][j] = V::fmadd(pg, vv[j], a[g][j]);
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int j = 0; j < DV; ++j) a[g][j].store(acc + g * D + 16 * (i0 + j));
}

// One query token, one KV head: out[g] = sum_t softmax_t(q[g] * scale . k_t) v_t over the keys
// t in [start, len) of its sequence (block table `table`), in increasing t; softcap > 0 caps
// each score s as softcap * tanh(s / softcap) (Gemma 2) before the softmax. `sink` (or null): a
// logit per query head of the group, one more term in the softmax's denominator (gpt-oss).
//
// `rows(which, ptrs)` points ptrs[0 .. L) at the L rows of fp32 keys (which 0) or values (1):
// the cache's own rows (`attend`), or fp8 rows widened into a buffer (`attend_fp8`); the
// arithmetic is the same either way.
template <class Rows>
void attend_rows(const float* q, const Rows& rows, int64_t L, int64_t G, int64_t D, float scale,
                 float softcap, float* out, float* qs, float* scores, float* acc,
                 const float** ptrs, const float* sink) {
  const int64_t nfull = D / 16, rem = D % 16;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * scale;
  // Pass 1: scores[g, t] = hsum(lanes of q_s[g] * k_t).
  rows(0, ptrs);
  for (int64_t g = 0; g < G; g += ATT_GH) {
    const bool full = g + ATT_GH <= G;
    int64_t j = 0;
    for (; j + 2 <= L; j += 2) {
      if (full) score_tile<ATT_GH, 2>(qs + g * D, ptrs + j, D, scores + g * L + j, L);
      else for (int64_t h = g; h < G; ++h) score_tile<1, 2>(qs + h * D, ptrs + j, D, scores + h * L + j, L);
    }
    for (; j < L; ++j) {
      if (full) score_tile<ATT_GH, 1>(qs + g * D, ptrs + j, D, scores + g * L + j, L);
      else for (int64_t h = g; h < G; ++h) score_tile<1, 1>(qs + h * D, ptrs + j, D, scores + h * L + j, L);
    }
  }
  if (softcap > 0.f)  // scalar libm tanh: the same bits for a score wherever it is computed
    for (int64_t i = 0; i < G * L; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  // Softmax weights (unnormalised): exp(s - max), summed in key order.
  float sums[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float mx = sg[0];
    for (int64_t j = 1; j < L; ++j) mx = std::max(mx, sg[j]);
    if (sink) mx = std::max(mx, sink[g]);
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      sum += sg[j];
    }
    if (sink) sum += std::exp(sink[g] - mx);  // the sink's weight, dropped from the output
    sums[g] = sum;
  }
  // Pass 2: acc[g] = sum_t p[g, t] v_t.
  rows(1, ptrs);
  for (int64_t g = 0; g < G; g += ATT_GH) {
    const int64_t heads = std::min<int64_t>(ATT_GH, G - g);
    for (int64_t h = g; h < g + heads; h += heads == ATT_GH ? ATT_GH : 1) {
      int64_t i = 0;
      for (; i + ATT_DV <= nfull; i += ATT_DV) {
        if (heads == ATT_GH) value_tile<ATT_GH, ATT_DV>(scores + h * L, L, ptrs, i, acc + h * D, D);
        else value_tile<1, ATT_DV>(scores + h * L, L, ptrs, i, acc + h * D, D);
      }
      for (; i < nfull; ++i) {
        if (heads == ATT_GH) value_tile<ATT_GH, 1>(scores + h * L, L, ptrs, i, acc + h * D, D);
        else value_tile<1, 1>(scores + h * L, L, ptrs, i, acc + h * D, D);
      }
    }
  }
  if (rem) {  // the last D % 16 lanes, zero-filled
    for (int64_t g = 0; g < G; ++g) {
      V a = V::zero();
      for (int64_t t = 0; t < L; ++t)
        a = V::fmadd(V::set1(scores[g * L + t]), V::load_tail(ptrs[t] + 16 * nfull, rem), a);
      a.store_tail(acc + g * D + 16 * nfull, rem);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = acc[g * D + i] / sums[g];
}

// One query token, one KV head over float32 caches (see attend_rows).
void attend(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
            int64_t len, int64_t start, int64_t block_size, int64_t row, int64_t G, int64_t D,
            float scale, float softcap, float* out, float* qs, float* scores, float* acc,
            const float** ptrs, const float* sink = nullptr) {
  const auto rows = [&](int which, const float** p) {
    const float* cache = which ? v_cache : k_cache;
    for (int64_t t = start; t < len; ++t)
      p[t - start] = cache + (table[t / block_size] * block_size + t % block_size) * row;
  };
  attend_rows(q, rows, len - start, G, D, scale, softcap, out, qs, scores, acc, ptrs, sink);
}

// The same over fp8 caches (E5M2 true: float8_e5m2, else float8_e4m3fn; attention/kv_dtype.py):
// the convert-on-load path. Each key / value row is widened exactly to fp32 into `buf` ([L][D])
// as it is read (V::load_fp8, 16 values at a time), then attended as float32 rows: a token's bits
// are those of a float32 cache holding the same values.
template <bool E5M2>
void attend_fp8_rows(const float* q, const uint8_t* k_cache, const uint8_t* v_cache,
                const int64_t* table, int64_t len, int64_t start, int64_t block_size, int64_t row,
                int64_t G, int64_t D, float scale, float softcap, float* out, float* qs,
                float* scores, float* acc, const float** ptrs, float* buf,
                const float* sink = nullptr) {
  const int64_t nfull = D / 16, rem = D % 16;
  const auto rows = [&](int which, const float** p) {
    const uint8_t* cache = which ? v_cache : k_cache;
    for (int64_t t = start; t < len; ++t) {
      const uint8_t* src = cache + (table[t / block_size] * block_size + t % block_size) * row;
      float* dst = buf + (t - start) * D;
      for (int64_t i = 0; i < nfull; ++i) V::load_fp8<E5M2>(src + 16 * i).store(dst + 16 * i);
      if (rem) {  // the last D % 16 values through a zero-padded copy
        alignas(64) uint8_t tail[16] = {};
        std::memcpy(tail, src + 16 * nfull, size_t(rem));
        V::load_fp8<E5M2>(tail).store_tail(dst + 16 * nfull, int(rem));
      }
      p[t - start] = dst;
    }
  };
  attend_rows(q, rows, len - start, G, D, scale, softcap, out, qs, scores, acc, ptrs, sink);
}

// attend_fp8_rows for the cache's format, instantiated here (inside the ISA's target region).
void attend_fp8(bool e5m2, const float* q, const uint8_t* k_cache, const uint8_t* v_cache,
                const int64_t* table, int64_t len, int64_t start, int64_t block_size, int64_t row,
                int64_t G, int64_t D, float scale, float softcap, float* out, float* qs,
                float* scores, float* acc, const float** ptrs, float* buf, const float* sink) {
  if (e5m2)
    attend_fp8_rows<true>(q, k_cache, v_cache, table, len, start, block_size, row, G, D, scale,
                          softcap, out, qs, scores, acc, ptrs, buf, sink);
  else
    attend_fp8_rows<false>(q, k_cache, v_cache, table, len, start, block_size, row, G, D, scale,
                           softcap, out, qs, scores, acc, ptrs, buf, sink);
}
