// Fused RMSNorm for bf16 activations on x86-64 CPUs (AVX2 or AVX-512, rms_norm_impl.h): one pass over each row for
// the sum of squares and one for the output, instead of the ~9 torch ops (and temporaries) of the
// eager formula. Matches HF's numerics (statistics in fp32, one rounding to bf16 where HF rounds):
//   mode 0, Gemma:  y = bf16( (x * r) * w1 )              with w1 = 1 + weight, in fp32
//   mode 1, Llama:  y = bf16( bf16(x * r) * w )          with w = the bf16 weight (as fp32)
// where r = 1 / sqrt(mean(x^2) + eps), all in fp32. The sum of squares is accumulated in 16 fp32
// lanes, the same order at both ISAs (torch sums in a different order: the last bit of r may differ, rarely a bf16 rounding).
//
// Registered as torch.ops.pagedserve_cpu.rms_norm (a fragment of the library argmax.cpp defines);
// the Python wrapper is pagedserve/kernels/cpu_norm.py. `isa` (kernels.cpu_isa) picks the build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cstdint>

#define PS_VEC_KERNEL "rms_norm_impl.h"
#include "vec16_build.h"

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight_f32, double eps, bool llama,
                    int64_t isa) {
  ps_isa::check_isa("rms_norm", isa);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous(),
              "rms_norm: x must be a contiguous [M, H] bfloat16 CPU tensor");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(weight_f32.scalar_type() == at::kFloat && weight_f32.dim() == 1 &&
                  weight_f32.size(0) == H && weight_f32.is_contiguous(),
              "rms_norm: weight must be a contiguous float32 [H] tensor");
  at::Tensor y = at::empty({M, H}, x.options());
  if (M == 0 || H == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* wp = weight_f32.data_ptr<float>();
  // NOTE: a decode batch is a few KB: one thread (no pool wake-up); prompts split by rows.
  const int64_t grain = std::max<int64_t>(1, 65536 / H);
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    if (ps_isa::use_avx512(isa)) isa_avx512bf16::norm_rows(xp, wp, yp, H, r0, r1, static_cast<float>(eps), llama);
    else isa_avx2::norm_rows(xp, wp, yp, H, r0, r1, static_cast<float>(eps), llama);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight_f32, float eps, bool llama, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
