// Fused per-head q/k RMSNorm and rotary embedding (RoPE, "rotate half" layout) for bf16
// activations on x86-64 CPUs (AVX2 or AVX-512, rotary_impl.h), in place on the q and k projections:
//
//   h   = norm(h)                                   (optional; Gemma or Llama numerics)
//   out = bf16( bf16(h * cos) + bf16(rotate_half(h) * sin) )
//
// with rotate_half(h) = [-h[D/2:], h[:D/2]] and cos/sin the step's bf16 tables [T, D]. Every
// rounding is where the eager torch ops of layers/rotary.py and layers/norms.py round (each bf16
// op computes in fp32 and rounds once), so the result is bit-identical to them except where the
// norm's sum of squares, accumulated in another order, moves r by an ulp (as csrc/rms_norm.cpp).
// One call replaces ~16 small torch ops per layer (2 norms, 2 x (2 muls, chunk, neg, cat, add)).
//
// Registered as torch.ops.pagedserve_cpu.qk_norm_rope_ (a fragment of the library argmax.cpp
// defines); the Python wrapper is pagedserve/kernels/cpu_rotary.py. `isa` picks the build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kMaxDim = 512;  // head_dim limit (a multiple of 32: each half whole 16-lane vectors)

}  // namespace

#define PS_VEC_KERNEL "rotary_impl.h"
#include "vec16_build.h"

namespace {

void check_heads(const at::Tensor& t, const char* name, int64_t T) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 3 &&
                  t.is_contiguous() && t.size(0) == T,
              "qk_norm_rope_: ", name, " must be a contiguous [T, heads, D] bfloat16 CPU tensor");
}

void check_weight(const c10::optional<at::Tensor>& w, const char* name, int64_t D) {
  TORCH_CHECK(w.has_value() && w->scalar_type() == at::kFloat && w->dim() == 1 && w->size(0) == D &&
                  w->is_contiguous(),
              "qk_norm_rope_: ", name, " must be a contiguous float32 [D] tensor when norm != 0");
}

void qk_norm_rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                   const at::Tensor& sin, const c10::optional<at::Tensor>& q_weight,
                   const c10::optional<at::Tensor>& k_weight, double eps, int64_t norm,
                   int64_t isa) {
  ps_isa::check_isa("qk_norm_rope_", isa);
  const int64_t T = q.size(0), D = q.size(2), Hq = q.size(1), Hk = k.size(1);
  check_heads(q, "q", T);
  check_heads(k, "k", T);
  TORCH_CHECK(k.size(2) == D && D % 32 == 0 && D <= kMaxDim, "qk_norm_rope_: head_dim ", D,
              " must be a multiple of 32, at most ", kMaxDim, ", the same for q and k");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == D && t->is_contiguous(),
                "qk_norm_rope_: cos/sin must be contiguous [T, D] bfloat16 tensors");
  TORCH_CHECK(norm >= 0 && norm <= 2, "qk_norm_rope_: norm must be 0 (none), 1 (Gemma), 2 (Llama)");
  const float* qw = nullptr;
  const float* kw = nullptr;
  if (norm) {
    check_weight(q_weight, "q_weight", D);
    check_weight(k_weight, "k_weight", D);
    qw = q_weight->data_ptr<float>();
    kw = k_weight->data_ptr<float>();
  }
  if (T == 0) return;
  auto* qp = reinterpret_cast<uint16_t*>(q.data_ptr());
  auto* kp = reinterpret_cast<uint16_t*>(k.data_ptr());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  const int64_t heads = Hq + Hk;
  const float e = static_cast<float>(eps);
  const int n = static_cast<int>(norm);
  // NOTE: a decode batch is a few heads a token: one thread (no pool wake-up); prompts by tokens.
  const int64_t grain = std::max<int64_t>(1, 16384 / (heads * D));
  const auto head_fn = ps_isa::use_avx512(isa) ? isa_avx512bf16::head_norm_rope : isa_avx2::head_norm_rope;
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* c = cp + t * D;
      const uint16_t* s = sp + t * D;
      for (int64_t h = 0; h < Hq; ++h) head_fn(qp + (t * Hq + h) * D, D, qw, e, n, c, s);
      for (int64_t h = 0; h < Hk; ++h) head_fn(kp + (t * Hk + h) * D, D, kw, e, n, c, s);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? q_weight, "
      "Tensor? k_weight, float eps, int norm, int isa) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("qk_norm_rope_", &qk_norm_rope_); }
