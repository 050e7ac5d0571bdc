// An MoE layer's routed experts in one call (layers/moe.py, MoEExperts; Python side
// kernels/cpu_moe.py): for x [T, H] and each token's top-k (expert, weight) pairs,
//
//   out[t] = sum over t's experts e, ascending:  w_te * down_e(act(gate_e(x[t])) * up_e(x[t]))
//
// in float32, with every expert's products over only its routed tokens, on the format-generic
// kernel of csrc/qlinear.cpp (qlinear_api.h: the 8-bit GEMV for few rows, the 8-bit GEMM for many,
// the dequantized paths -- chosen per expert exactly as `qlinear` chooses for its row count), the
// weights as the layer holds them: stacked [E, N, row_bytes] ggml / INT8 blocks, or bf16 [E, N, K].
// GPTQ act-order stacks store each expert's input features in its own order: perm_x [E, H] (gate
// and up share it) and perm_h [E, I] (down); the rows of x / h an expert multiplies are gathered
// in that order first, as `qlinear` gathers them for one expert's weight.
//
// One OpenMP parallel region of torch's threads, four work lists handed out dynamically, each
// ended by the `omp for` barrier:
//   1. per expert: gather its tokens' rows of x (features by perm_x); set up gate and up (x
//      quantized once for both);
//   2. per (expert, 64-column tile of I): gate and up over the tile, then h = act(gate) * up;
//   3. per expert: set up down over its h (features gathered by perm_h; quantized once);
//   4. per 64-column tile of H: every expert's down over the tile, ascending, each added into its
//      tokens' rows of out with the routing weight (so a token's sum runs in ascending expert order).
//
// NOTE: bit-identical to the layer's torch loop (layers/moe.py): the same products (the same rows
// per expert, so the same kernels), the activation by fp32_activation's formula (moe_impl.h),
// the same roundings (gate / up / h / down in x's dtype, the sum in fp32, one add per expert).
// Which thread computes a tile never changes a bit. A token's bits depend on its batch only
// where `qlinear`'s do (gemm_rows > 0 switches kernels by an expert's row count).
//
// Registered as torch.ops.pagedserve_cpu.moe_experts.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include "cpu_isa.h"
#include "omp_region.h"
#include "qlinear_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#define PS_VEC_KERNEL "moe_impl.h"
#include "vec16_build.h"

namespace {

using OptTensor = c10::optional<at::Tensor>;
constexpr int64_t kTile = 64;  // output columns per work item (4 of the kernels' 16-row blocks)

void check_stack(const char* name, const at::Tensor& w, int64_t fmt, int64_t E, int64_t N, int64_t K) {
  const int64_t rb = ps_qlinear::row_bytes_of(fmt, K);
  TORCH_CHECK(rb > 0, "moe_experts: ", name, ": K = ", K, " does not fit format ", fmt);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && w.is_contiguous(), "moe_experts: ", name,
              " must be a contiguous 3-D CPU tensor");
  TORCH_CHECK(w.scalar_type() == (fmt == 0 ? at::kBFloat16 : at::kByte), "moe_experts: ", name,
              " dtype does not match format ", fmt);
  TORCH_CHECK(w.size(0) == E && w.size(1) == N && w.size(2) * int64_t(w.element_size()) == rb,
              "moe_experts: ", name, " must be [", E, ", ", N, ", ", rb, " bytes], got ", w.sizes());
}

const OptTensor& check_bias(const char* name, const OptTensor& b, int64_t E, int64_t N) {
  if (b.has_value() && b->defined())
    TORCH_CHECK(b->device().is_cpu() && b->dim() == 2 && b->size(0) == E && b->size(1) == N &&
                    b->scalar_type() == at::kFloat && b->is_contiguous(),
                "moe_experts: ", name, " must be a contiguous float32 [", E, ", ", N, "] CPU tensor");
  return b;
}

// Expert e's order of n features (perm [E, n] int64), or nullptr (none).
const int64_t* order_of(const OptTensor& perm, int64_t e, int64_t n) {
  if (!perm.has_value() || !perm->defined()) return nullptr;
  return perm->data_ptr<int64_t>() + e * n;
}

void check_perm(const char* name, const OptTensor& perm, int64_t E, int64_t n) {
  if (perm.has_value() && perm->defined())
    TORCH_CHECK(perm->device().is_cpu() && perm->dim() == 2 && perm->size(0) == E && perm->size(1) == n &&
                    perm->scalar_type() == at::kLong && perm->is_contiguous(),
                "moe_experts: ", name, " must be a contiguous int64 [", E, ", ", n, "] CPU tensor");
}

// Row src of n elements (es bytes each) with its features in order `order` into dst.
void gather_row(char* dst, const char* src, const int64_t* order, int64_t n, int64_t es) {
  if (order == nullptr) {
    std::memcpy(dst, src, size_t(n * es));
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(uint64_t(order[j]) < uint64_t(n), "moe_experts: a perm names feature ", order[j],
                " of ", n);
    if (es == 2) reinterpret_cast<uint16_t*>(dst)[j] = reinterpret_cast<const uint16_t*>(src)[order[j]];
    else reinterpret_cast<float*>(dst)[j] = reinterpret_cast<const float*>(src)[order[j]];
  }
}

OptTensor bias_of(const OptTensor& b, int64_t e) {
  if (!b.has_value() || !b->defined()) return c10::nullopt;
  return b->select(0, e);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       int64_t expert_start, const at::Tensor& w_gate, const at::Tensor& w_up,
                       const at::Tensor& w_down, const std::vector<int64_t>& fmts,
                       const std::vector<int64_t>& gemm_rows, const OptTensor& b_gate,
                       const OptTensor& b_up, const OptTensor& b_down, const OptTensor& perm_x,
                       const OptTensor& perm_h, int64_t act, double alpha,
                       double limit, int64_t isa) {
  ps_isa::check_isa("moe_experts", isa);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_experts: x must be a contiguous bf16 or float32 [T, H] CPU tensor");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_ids.is_contiguous() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous(),
              "moe_experts: topk_ids (int64) and topk_weights (float32) must be contiguous [T, k]");
  TORCH_CHECK(fmts.size() == 3 && gemm_rows.size() == 3, "moe_experts: 3 formats and 3 gemm_rows (gate, up, down)");
  TORCH_CHECK(act >= 0 && act <= 2, "moe_experts: act must be 0 (silu), 1 (gelu tanh) or 2 (clamped SwiGLU)");
  const int64_t E = w_gate.size(0), I = w_gate.size(1);
  check_stack("w_gate", w_gate, fmts[0], E, I, H);
  check_stack("w_up", w_up, fmts[1], E, I, H);
  check_stack("w_down", w_down, fmts[2], E, H, I);
  check_bias("b_gate", b_gate, E, I);
  check_bias("b_up", b_up, E, I);
  check_bias("b_down", b_down, E, H);
  check_perm("perm_x", perm_x, E, H);
  check_perm("perm_h", perm_h, E, I);

  at::Tensor out = at::zeros({T, H}, x.options().dtype(at::kFloat));
  const int64_t k = topk_ids.size(1);
  // The routed slots grouped by local expert, tokens ascending within each (a counting sort).
  std::vector<int64_t> count(size_t(E) + 1, 0);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* tw = topk_weights.data_ptr<float>();
  for (int64_t s = 0; s < T * k; ++s) {
    const int64_t e = ids[s] - expert_start;
    if (0 <= e && e < E) ++count[size_t(e) + 1];
  }
  std::vector<int64_t> active;  // local experts with tokens, ascending
  for (int64_t e = 0; e < E; ++e)
    if (count[size_t(e) + 1]) active.push_back(e);
  for (int64_t e = 0; e < E; ++e) count[size_t(e) + 1] += count[size_t(e)];
  const int64_t S = count[size_t(E)];
  if (S == 0) return out;
  std::vector<int64_t> tok(size_t(S), 0);
  std::vector<float> wt(size_t(S), 0.0f);
  {
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t s = 0; s < T * k; ++s) {
      const int64_t e = ids[s] - expert_start;
      if (0 <= e && e < E) {
        const int64_t pos = fill[size_t(e)]++;
        tok[size_t(pos)] = s / k;
        wt[size_t(pos)] = tw[s];
      }
    }
  }
  const int64_t A = int64_t(active.size());
  int64_t max_n = 0;
  for (int64_t e : active) max_n = std::max(max_n, count[size_t(e) + 1] - count[size_t(e)]);

  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t es = bf16 ? 2 : 4;  // bytes per element of x, gate / up / h, and down's result
  at::Tensor xs = at::empty({S, H}, x.options());    // x's rows by expert
  at::Tensor gate = at::empty({S, I}, x.options());  // gate / up results (x's dtype, as qlinear)
  at::Tensor up = at::empty({S, I}, x.options());
  at::Tensor h = at::empty({S, I}, x.options());     // act(gate) * up
  const bool h_perm = perm_h.has_value() && perm_h->defined();
  at::Tensor hp = h_perm ? at::empty({S, I}, x.options()) : h;  // h's features in down's orders
  auto* xs_p = static_cast<char*>(xs.data_ptr());
  auto* gate_p = static_cast<char*>(gate.data_ptr());
  auto* up_p = static_cast<char*>(up.data_ptr());
  auto* h_p = static_cast<char*>(h.data_ptr());
  const auto* x_p = static_cast<const char*>(x.data_ptr());
  float* out_p = out.data_ptr<float>();

  const size_t na = static_cast<size_t>(A);
  std::vector<std::shared_ptr<ps_qlinear::XShare>> x_share(na), h_share(na);
  std::vector<ps_qlinear::Prepared> p_gate(na), p_up(na), p_down(na);
  const int64_t i_tiles = (I + kTile - 1) / kTile, h_tiles = (H + kTile - 1) / kTile;
  const bool wide = ps_isa::use_avx512(isa);

  ps_omp::Region region;

#pragma omp parallel num_threads(region.threads)
  {
    at::ThreadLocalStateGuard tls_guard(region.tls);
    std::vector<char> buf(size_t(max_n * kTile * es));  // a tile of down's result
    // 1. gather, set up gate / up
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < A; ++i) {
      if (region.failed) continue;
      try {
        const int64_t e = active[size_t(i)], lo = count[size_t(e)], n = count[size_t(e) + 1] - lo;
        const int64_t* order = order_of(perm_x, e, H);
        for (int64_t r = 0; r < n; ++r)
          gather_row(xs_p + (lo + r) * H * es, x_p + tok[size_t(lo + r)] * H * es, order, H, es);
        const at::Tensor xe = xs.narrow(0, lo, n);
        x_share[size_t(i)] = ps_qlinear::new_x_share();
        p_gate[size_t(i)] = ps_qlinear::prepare(*x_share[size_t(i)], xe, w_gate.select(0, e), fmts[0], H,
                                                bias_of(b_gate, e), false, isa, gemm_rows[0]);
        p_up[size_t(i)] = ps_qlinear::prepare(*x_share[size_t(i)], xe, w_up.select(0, e), fmts[1], H,
                                              bias_of(b_up, e), false, isa, gemm_rows[1]);
      } catch (...) {
        region.capture();
      }
    }
    // 2. gate / up tiles and the activation
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < A * i_tiles; ++item) {
      if (region.failed) continue;
      const int64_t i = item / i_tiles, nb = item % i_tiles * kTile, ne = std::min(I, nb + kTile);
      const int64_t e = active[size_t(i)], lo = count[size_t(e)], n = count[size_t(e) + 1] - lo;
      p_gate[size_t(i)].run(gate_p + lo * I * es, I, 0, nb, ne);
      p_up[size_t(i)].run(up_p + lo * I * es, I, 0, nb, ne);
      if (wide)
        isa_avx512bf16::moe_act_mul(gate_p + lo * I * es, up_p + lo * I * es, h_p + lo * I * es, n, I, nb, ne, bf16, act,
                                     float(alpha), float(limit));
      else
        isa_avx2::moe_act_mul(gate_p + lo * I * es, up_p + lo * I * es, h_p + lo * I * es, n, I, nb, ne, bf16, act,
                              float(alpha), float(limit));
    }
    // 3. set up down
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < A; ++i) {
      if (region.failed) continue;
      try {
        const int64_t e = active[size_t(i)], lo = count[size_t(e)], n = count[size_t(e) + 1] - lo;
        if (h_perm) {
          const int64_t* order = order_of(perm_h, e, I);
          auto* hp_p = static_cast<char*>(hp.data_ptr());
          for (int64_t r = lo; r < lo + n; ++r) gather_row(hp_p + r * I * es, h_p + r * I * es, order, I, es);
        }
        h_share[size_t(i)] = ps_qlinear::new_x_share();
        p_down[size_t(i)] = ps_qlinear::prepare(*h_share[size_t(i)], hp.narrow(0, lo, n), w_down.select(0, e),
                                                fmts[2], I, bias_of(b_down, e), false, isa, gemm_rows[2]);
      } catch (...) {
        region.capture();
      }
    }
    // 4. down tiles, each expert's added into its tokens' rows in ascending expert order
#pragma omp for schedule(dynamic, 1)
    for (int64_t tile = 0; tile < h_tiles; ++tile) {
      if (region.failed) continue;
      const int64_t nb = tile * kTile, ne = std::min(H, nb + kTile), w = ne - nb;
      for (int64_t i = 0; i < A; ++i) {
        const int64_t e = active[size_t(i)], lo = count[size_t(e)], n = count[size_t(e) + 1] - lo;
        p_down[size_t(i)].run(buf.data(), w, nb, nb, ne);
        for (int64_t r = 0; r < n; ++r) {
          float* o = out_p + tok[size_t(lo + r)] * H + nb;
          const char* y = buf.data() + r * w * es;
          if (wide) isa_avx512bf16::moe_weighted_add(o, y, bf16, wt[size_t(lo + r)], w);
          else isa_avx2::moe_weighted_add(o, y, bf16, wt[size_t(lo + r)], w);
        }
      }
    }
  }
  region.rethrow();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, int expert_start, Tensor w_gate, "
        "Tensor w_up, Tensor w_down, int[] fmts, int[] gemm_rows, Tensor? b_gate, Tensor? b_up, "
        "Tensor? b_down, Tensor? perm_x, Tensor? perm_h, int act, float alpha, float limit, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("moe_experts", &moe_experts); }
