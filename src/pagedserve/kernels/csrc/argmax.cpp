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

#include "argmax_best.h"

#define PS_VEC_KERNEL "argmax_impl.h"
#include "vec16_build.h"

namespace {

#include "argmax_rows.h"

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
  RowArgmax best(M, ps_isa::use_avx512(isa) ? isa_avx512bf16::scan_bf16 : isa_avx2::scan_bf16);
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
