// Greedy tokens from bf16 logits on x86-64 CPUs: `argmax_bf16(x)`, the argmax of each row of a
// bf16 [M, N] tensor, by torch.argmax's rule (the first maximum; a NaN counts as the maximum, the
// first NaN wins). Rows are split into pieces that run on torch's OpenMP pool, so one long row (a
// 262k-token vocabulary) still uses every thread; pieces merge by a total order on (value, index).
//
// Registered as torch.ops.pagedserve_cpu.argmax_bf16 (this file holds the library's one
// TORCH_LIBRARY block; the other sources add TORCH_LIBRARY_FRAGMENTs); the Python wrapper is
// pagedserve/kernels/cpu_argmax.py. The scan is argmax_impl.h, built for AVX2 and AVX-512
// (vec16_build.h); `isa` (kernels.cpu_isa) picks one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace {

using bf16_t = uint16_t;

// ----------------------------------------------------------------------------------------------
// Argmax of bf16 rows (torch.argmax's rule: first maximum, NaN counts as the maximum).
// ----------------------------------------------------------------------------------------------

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

}  // namespace

#define PS_VEC_KERNEL "argmax_impl.h"
#include "vec16_build.h"

namespace {

using ScanFn = ArgBest (*)(const bf16_t*, int64_t, int64_t);

// Per-row results merged from chunks that finish on different threads.
class RowArgmax {
 public:
  RowArgmax(int64_t rows, ScanFn scan) : best_(size_t(rows)), scan_(scan) {}

  // Scans rows [first, end_row) of y (row stride ld) over columns [begin, end) and merges the
  // results into those rows'.
  void scan(const bf16_t* y, int64_t first, int64_t end_row, int64_t ld, int64_t begin,
            int64_t end) {
    ArgBest local[32];
    for (int64_t r0 = first; r0 < end_row; r0 += 32) {
      const int64_t n = std::min<int64_t>(32, end_row - r0);
      for (int64_t r = 0; r < n; ++r) local[r] = scan_(y + (r0 + r) * ld, begin, end);
      std::lock_guard<std::mutex> guard(mu_);
      for (int64_t r = 0; r < n; ++r)
        if (arg_better(local[r], best_[r0 + r])) best_[r0 + r] = local[r];
    }
  }

  at::Tensor result(const at::TensorOptions& opts) const {
    at::Tensor out = at::empty({int64_t(best_.size())}, opts.dtype(at::kLong));
    int64_t* p = out.data_ptr<int64_t>();
    for (size_t r = 0; r < best_.size(); ++r) p[r] = std::max<int64_t>(best_[r].idx, 0);
    return out;
  }

 private:
  std::vector<ArgBest> best_;
  ScanFn scan_;
  std::mutex mu_;
};

// argmax over the last dim of a bf16 [M, N] tensor: [M] int64 (rows split into pieces of 32K
// elements, so that one long row still uses every thread).
at::Tensor argmax_bf16(const at::Tensor& x, int64_t isa) {
  ps_isa::check_isa("argmax_bf16", isa);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous(),
              "argmax_bf16: x must be a contiguous [M, N] bfloat16 CPU tensor");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N > 0 || M == 0, "argmax_bf16: argmax of an empty row");
  if (M == 0) return at::empty({0}, x.options().dtype(at::kLong));
  constexpr int64_t kPiece = 32768;
  const int64_t pieces = (N + kPiece - 1) / kPiece;
  const auto* xp = reinterpret_cast<const bf16_t*>(x.data_ptr());
  RowArgmax best(M, ps_isa::use_avx512(isa) ? vec_avx512::scan_bf16 : vec_avx2::scan_bf16);
  at::parallel_for(0, M * pieces, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = u / pieces, p = u % pieces;
      best.scan(xp, r, r + 1, N, p * kPiece, std::min(N, (p + 1) * kPiece));
    }
  });
  return best.result(x.options());
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("argmax_bf16(Tensor x, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("argmax_bf16", &argmax_bf16);
}
