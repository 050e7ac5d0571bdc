// Per-head products in one call (layers/mla.py: the latent attention's absorbed projections, a
// different weight for each query head; Python side kernels/cpu_gemm.py `linear_heads`): for x
// [T, Hh, K] and stacked weights w [Hh, N, K] (bf16, or a quantized format's [Hh, N, row_bytes]),
//
//   y[:, h] = x[:, h] @ w[h]^T        y [T, Hh, N] in x's dtype
//
// on the format-generic kernel of csrc/qlinear.cpp (qlinear_api.h), in one OpenMP region: every
// head set up (x[:, h] converted / quantized once), then (head, 64-column tile) items.
//
// NOTE: bit-identical to a loop of `qlinear` over the heads (x[:, h] made contiguous, w[h], the
// same format, ISA level and gemm_rows): qlinear_api.h's `prepare` chooses each product's kernel
// as `qlinear` does and every range of columns holds what `qlinear` writes there. Which thread
// computes a tile changes no bit.
//
// Registered as torch.ops.pagedserve_cpu.qlinear_heads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include "cpu_isa.h"
#include "omp_region.h"
#include "qlinear_api.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kTile = 64;  // output columns per work item (4 of the kernels' 16-row blocks)

at::Tensor qlinear_heads(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                         int64_t isa, int64_t gemm_rows) {
  ps_isa::check_isa("qlinear_heads", isa);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.size(2) == K &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "qlinear_heads: x must be a bf16 or float32 [T, Hh, K] CPU tensor");
  const int64_t T = x.size(0), Hh = x.size(1);
  const int64_t rb = ps_qlinear::row_bytes_of(fmt, K);
  TORCH_CHECK(rb > 0, "qlinear_heads: K = ", K, " does not fit format ", fmt);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && w.is_contiguous() && w.size(0) == Hh &&
                  w.size(2) * int64_t(w.element_size()) == rb &&
                  w.scalar_type() == (fmt == 0 ? at::kBFloat16 : at::kByte),
              "qlinear_heads: w must be a contiguous [Hh, N, K] bf16 (format 0) or [Hh, N, row_bytes] "
              "uint8 CPU tensor of format ", fmt, ", got ", w.sizes());
  const int64_t N = w.size(1);
  at::Tensor y = at::empty({T, Hh, N}, x.options());
  if (T == 0 || N == 0) return y;
  const at::Tensor xt = x.transpose(0, 1).contiguous();  // [Hh, T, K]: each head's rows contiguous
  const int64_t es = x.element_size();
  auto* y_p = static_cast<char*>(y.data_ptr());

  const size_t nh = static_cast<size_t>(Hh);
  std::vector<std::shared_ptr<ps_qlinear::XShare>> share(nh);
  std::vector<ps_qlinear::Prepared> prepared(nh);
  const int64_t tiles = (N + kTile - 1) / kTile;
  ps_omp::Region region;

#pragma omp parallel num_threads(region.threads)
  {
    at::ThreadLocalStateGuard tls_guard(region.tls);
#pragma omp for schedule(dynamic, 1)
    for (int64_t h = 0; h < Hh; ++h) {
      if (region.failed) continue;
      try {
        share[size_t(h)] = ps_qlinear::new_x_share();
        prepared[size_t(h)] = ps_qlinear::prepare(*share[size_t(h)], xt.select(0, h), w.select(0, h), fmt, K,
                                                  c10::nullopt, false, isa, gemm_rows);
      } catch (...) {
        region.capture();
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < Hh * tiles; ++item) {
      if (region.failed) continue;
      const int64_t h = item / tiles, nb = item % tiles * kTile, ne = std::min(N, nb + kTile);
      prepared[size_t(h)].run(y_p + h * N * es, Hh * N, 0, nb, ne);
    }
  }
  region.rethrow();
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("qlinear_heads(Tensor x, Tensor w, int fmt, int K, int isa, int gemm_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("qlinear_heads", &qlinear_heads); }
