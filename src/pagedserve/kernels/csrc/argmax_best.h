// The argmax of bf16 rows by torch.argmax's rule (the first maximum; a NaN counts as the maximum,
// the first NaN wins): what argmax_impl.h's scan returns for a range of a row. Shared by
// argmax.cpp (`argmax_bf16`) and qlinear.cpp (`qlinear_argmax`); include before vec16_build.h
// builds argmax_impl.h. Plain x86-64 code.

#pragma once

#include <cstdint>

using bf16_t = uint16_t;

// The best element seen so far of one row; idx < 0: none yet.
struct ArgBest {
  int64_t idx = -1;
  float val = 0.0f;
  bool nan = false;
};

// Whether a beats b in torch.argmax's order: any NaN beats any number, the larger number beats
// the smaller, and between equals (or two NaNs) the smaller index wins. NOTE: a total order on
// (element, index), so chunk results merge in any order to the row's argmax.
inline bool arg_better(const ArgBest& a, const ArgBest& b) {
  if (a.idx < 0) return false;
  if (b.idx < 0) return true;
  if (a.nan != b.nan) return a.nan;
  if (!a.nan && a.val != b.val) return a.val > b.val;
  return a.idx < b.idx;
}
