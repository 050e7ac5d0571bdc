// LoRA's low-rank products for bf16 activations on x86-64 CPUs (AVX2 or AVX-512,
// lora_bgmv_impl.h), Punica's BGMV: each token gathers its own adapter's A and B from the slot
// table (one call per projection for every adapter of the batch; tokens of the base model, slot
// -1, get nothing), so the work is each token's rank against its own adapter only.
//
//   lora_shrink(x [T, K] bf16, At [slots, K, W] bf16, slots [T]) -> h [T, W] fp32
//       h[t] = x[t] At[slots[t]]            (0 where slots[t] < 0)
//   lora_expand_(y [T, N] bf16, h [T, W] fp32, col, Bt [slots, R, N] bf16, slots [T])
//       y[t] = bf16(y[t] + h[t, col:col + R] Bt[slots[t]])   (in place; untouched where < 0)
//
// A group of projections that read one x (q/k/v, gate/up) shares one shrink: At holds the
// members' A^T side by side (W = members * R), each member expands its R columns of h. Both run
// in fp32 in a fixed order per token (see lora_bgmv_impl.h): a token's result does not depend on
// its batch, its slot, the other adapters or the thread that computed it -- the engine's
// exactness rule for adapters (lora/layers.py; tests/lora). Small calls (decode) run on the
// calling thread: no pool wake-up per projection; prompts split by tokens.
//
// Registered as torch.ops.pagedserve_cpu.lora_shrink / lora_expand_ (a fragment of the library
// argmax.cpp defines); callers: lora/layers.py and the fused decode layer (decoder_layer.cpp).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cstdint>

#define PS_VEC_KERNEL "lora_bgmv_impl.h"
#include "vec16_build.h"

namespace {

// A call's tokens per thread: ~2M multiply-adds each (decode batches stay on one thread).
int64_t grain(int64_t work_per_token) { return std::max<int64_t>(1, (int64_t(1) << 21) / std::max<int64_t>(1, work_per_token)); }

const int64_t* check_slots(const char* op, const at::Tensor& slots, int64_t T) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == T && slots.is_contiguous(),
              op, ": slots must be a contiguous int64 [T] CPU tensor");
  return slots.data_ptr<int64_t>();
}

void check_bf16(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == dim && t.is_contiguous(),
              op, ": ", name, " must be a contiguous ", dim, "-D bfloat16 CPU tensor");
}

void check_slot_range(const char* op, const int64_t* sp, int64_t T, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < num_slots, op, ": slot ", sp[t], " out of range (", num_slots, " slots)");
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& at, const at::Tensor& slots, int64_t isa) {
  ps_isa::check_isa("lora_shrink", isa);
  check_bf16("lora_shrink", "x", x, 2);
  check_bf16("lora_shrink", "At", at, 3);
  const int64_t T = x.size(0), K = x.size(1), W = at.size(2);
  TORCH_CHECK(at.size(1) == K, "lora_shrink: At must be [slots, K, W] with K = ", K);
  const int64_t* sp = check_slots("lora_shrink", slots, T);
  check_slot_range("lora_shrink", sp, T, at.size(0));
  at::Tensor h = at::empty({T, W}, x.options().dtype(at::kFloat));
  if (T == 0 || W == 0) return h;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ap = reinterpret_cast<const uint16_t*>(at.data_ptr());
  float* hp = h.data_ptr<float>();
  at::parallel_for(0, T, grain(K * W), [&](int64_t t0, int64_t t1) {
    if (ps_isa::use_avx512(isa)) isa_avx512bf16::shrink_rows(xp, K, ap, W, sp, hp, t0, t1);
    else isa_avx2::shrink_rows(xp, K, ap, W, sp, hp, t0, t1);
  });
  return h;
}

void lora_expand_(const at::Tensor& y, const at::Tensor& h, int64_t col, const at::Tensor& bt,
                  const at::Tensor& slots, int64_t isa) {
  ps_isa::check_isa("lora_expand_", isa);
  check_bf16("lora_expand_", "y", y, 2);
  check_bf16("lora_expand_", "Bt", bt, 3);
  const int64_t T = y.size(0), N = y.size(1), R = bt.size(1);
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous() &&
                  h.size(0) == T,
              "lora_expand_: h must be a contiguous float32 [T, W] CPU tensor");
  TORCH_CHECK(bt.size(2) == N, "lora_expand_: Bt must be [slots, R, N] with N = ", N);
  TORCH_CHECK(col >= 0 && col + R <= h.size(1), "lora_expand_: columns [", col, ", ", col + R,
              ") outside h's ", h.size(1));
  const int64_t* sp = check_slots("lora_expand_", slots, T);
  check_slot_range("lora_expand_", sp, T, bt.size(0));
  if (T == 0 || N == 0 || R == 0) return;
  const float* hp = h.data_ptr<float>();
  const auto* bp = reinterpret_cast<const uint16_t*>(bt.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t W = h.size(1);
  at::parallel_for(0, T, grain(R * N), [&](int64_t t0, int64_t t1) {
    if (ps_isa::use_avx512(isa)) isa_avx512bf16::expand_rows(hp, W, col, R, bp, N, sp, yp, t0, t1);
    else isa_avx2::expand_rows(hp, W, col, R, bp, N, sp, yp, t0, t1);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor At, Tensor slots, int isa) -> Tensor");
  m.def("lora_expand_(Tensor(a!) y, Tensor h, int col, Tensor Bt, Tensor slots, int isa) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand_", &lora_expand_);
}
