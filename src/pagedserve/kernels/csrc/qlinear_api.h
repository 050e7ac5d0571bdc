// The format-generic product of csrc/qlinear.cpp for the other sources of the extension that
// schedule products themselves (csrc/moe.cpp): a product set up once -- its kernel chosen exactly
// as `qlinear` chooses it for the same x, weight, format, ISA level and gemm_rows, x quantized or
// packed once per `XShare` -- then run over any ranges of its output columns, by any threads.
// Each range's values are those `qlinear` writes for those columns, bit for bit.
//
// NOTE: `prepare` may run inside a parallel region (for different XShares), but it checks its
// arguments with TORCH_CHECK: the caller validates them first (an exception must not leave a
// parallel region).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace ps_qlinear {

// What the products of one x share (x quantized to 8-bit blocks, converted, packed): opaque.
struct XShare;
std::shared_ptr<XShare> new_x_share();

// x [M, K] @ W[N, K]^T (+ bias[N]), set up. `run(y, ldy, n0, nb, ne)` writes columns [nb, ne)
// (whole 16-row blocks of W, or up to N) of rows 0..M-1 at y + m * ldy + (n - n0), as fp32 when
// `y_fp32` (fp32 x, or out_fp32) else in x's dtype (bf16), each rounded once. It reads x and the
// XShare: both must outlive it.
struct Prepared {
  int64_t N = 0;
  bool y_fp32 = false;
  std::function<void(void* y, int64_t ldy, int64_t n0, int64_t nb, int64_t ne)> run;
};

Prepared prepare(XShare& share, const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                 const c10::optional<at::Tensor>& bias, bool out_fp32, int64_t isa,
                 int64_t gemm_rows);

// Bytes of one row of K values in format fmt; -1 if K does not fit the format's blocks.
int64_t row_bytes_of(int64_t fmt, int64_t K);

}  // namespace ps_qlinear
