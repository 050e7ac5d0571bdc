// The SIMD body of argmax.cpp on V16 (csrc/vec16.h), compiled once per ISA by vec16_build.h.
// No include guard on purpose; nothing here may include headers.

// The argmax of row[begin, end) (indices into row) by torch.argmax's rule.
inline ArgBest scan_bf16(const uint16_t* row, int64_t begin, int64_t end) {
  ArgBest best;
  if (begin >= end) return best;
  constexpr uint16_t kNegInf = 0xFF80;  // bf16 -inf: fills a tail without winning
  const float inf = std::numeric_limits<float>::infinity();
  V16 vmax = v_set1(-inf);
  for (int64_t i = begin; i < end; i += 16) {
    const int64_t n = std::min<int64_t>(16, end - i);
    const V16 v = n == 16 ? v_load_bf16(row + i) : v_load_bf16_n(row + i, n, kNegInf);
    const unsigned nan = v_nan_mask(v);
    if (nan) {  // the first NaN of the range: nothing after it can win
      best.idx = i + __builtin_ctz(nan);
      best.nan = true;
      return best;
    }
    vmax = v_max(vmax, v);
  }
  const float mx = v_hmax(vmax);
  const V16 target = v_set1(mx);
  // Second pass, from L1/L2: the first element equal to the maximum (-0 == +0, as torch compares).
  for (int64_t i = begin; i < end; i += 16) {
    const int64_t n = std::min<int64_t>(16, end - i);
    const V16 v = n == 16 ? v_load_bf16(row + i) : v_load_bf16_n(row + i, n, kNegInf);
    const unsigned eq = v_eq_mask(v, target) & ((1u << n) - 1u);
    if (eq) {
      best.idx = i + __builtin_ctz(eq);
      best.val = mx;
      return best;
    }
  }
  return best;  // not reached: the maximum is one of the elements
}
