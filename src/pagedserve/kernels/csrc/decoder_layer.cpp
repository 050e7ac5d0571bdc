// One decoder layer of a Llama-family or Gemma 3 model for a decode-only step on CPU (bf16),
// as a single call: the same kernels and ATen ops, in the same order, as the layer's modules
// run them from Python (models/llama.py, models/gemma3.py), so the result is bit-identical --
// without the ~60 Python-level calls a layer otherwise costs at batch 1 (module dispatch, wrapper
// checks, views), which at 18 layers were as much time as the layer's small ops themselves.
//
//   h = norm_in(x)
//   q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)
//   q, k = rope(q_norm(q), k_norm(k))         (q/k norms optional)
//   write k, v at slot_mapping; a = paged decode attention(q)
//   o = a Wo^T (+bo)
//   Llama:  x = x + o;               h = norm_post_attn(x)
//   Gemma:  x = x + norm_post_attn(o); h = norm_pre_ff(x)
//   m = down(act(gate(h)) * up(h))
//   Llama:  x = x + m                Gemma: x = x + norm_post_ff(m)
//
// Weights are bf16 or quantized (csrc/qlinear.cpp formats, one code per weight in `formats`).
// The kernels are called through the dispatcher (torch.ops.pagedserve_cpu.*, registered by the
// other files of this extension). Registered as torch.ops.pagedserve_cpu.decoder_layer; the Python
// side (kernels/cpu_decoder_layer.py) decides when it applies and checks every precondition the
// kernels do not (decode-only batch, M within the GEMV limit, single rank, bf16 everywhere but
// the KV caches: bf16 or fp8, see write_kv).
// decoder_layer_lora is the same layer with a step's LoRA adapters added after each projection
// (see Lora below).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// x @ W^T (+ b) on the format-generic kernel (csrc/qlinear.cpp), as the modules' linear layers
// call it (kernels/cpu_gemm.py): fmt is W's format code, isa the ISA level.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptTensor& b, int64_t fmt,
                   int64_t isa, int64_t gemm_rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedserve_cpu::qlinear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                         const OptTensor&, bool, int64_t, int64_t)>();
  return op.call(x, w, fmt, x.size(1), b, false, isa, gemm_rows);
}

// x @ W_i^T (+ b_i) for several weights of one x in one parallel region (qlinear_fused): each
// result bit-identical to `project`'s.
std::vector<at::Tensor> project_fused(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                      const std::vector<OptTensor>& bs, const std::vector<int64_t>& fmts,
                                      int64_t isa, const std::vector<int64_t>& gemm_rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedserve_cpu::qlinear_fused", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const std::vector<at::Tensor>&,
                                                      const std::vector<int64_t>&, int64_t,
                                                      const std::vector<OptTensor>&, int64_t,
                                                      const std::vector<int64_t>&)>();
  return op.call(x, ws, fmts, x.size(1), bs, isa, gemm_rows);
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps, bool llama, int64_t isa) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedserve_cpu::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool, int64_t)>();
  return op.call(x, w, eps, llama, isa);
}

void qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                  const at::Tensor& sin, const OptTensor& qw, const OptTensor& kw, double eps,
                  int64_t mode, int64_t isa) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedserve_cpu::qk_norm_rope_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const OptTensor&, const OptTensor&, double,
                                   int64_t, int64_t)>();
  op.call(q, k, cos, sin, qw, kw, eps, mode, isa);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                     const at::Tensor& tables, const at::Tensor& lens, double scale,
                     int64_t window, int64_t isa, const std::optional<at::Tensor>& sinks) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedserve_cpu::decode_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double, int64_t,
                                         int64_t, const c10::optional<at::Tensor>&)>();
  return op.call(q, kc, vc, tables, lens, scale, window, isa, sinks);
}

enum Weight { kQ, kK, kV, kO, kGate, kUp, kDown, kNumWeights };
enum Bias { kBq, kBk, kBv, kBo, kNumBiases };
enum Norm { kInput, kPostAttn, kPreFf, kPostFf, kQNorm, kKNorm, kNumNorms };

// The adapters' low-rank products of a decode step with LoRA (lora/layers.py with the per-token
// kernels of csrc/lora_bgmv.cpp, Punica's BGMV): each token's slot (-1: the base model), per input
// group (q/k/v, o, gate/up, down) A^T stacked over the slot table [slots, in, members * r_max],
// per projection B^T [slots, r_max, out] (zero beyond each adapter's rank), None where nothing is
// added this step. After a group's base products: one shrink of its input, one expand into each
// adapted member's product -- the kernels LoRAStacks.apply calls from the projections' hooks, in
// the same order, so the result is bit-identical to the unfused layer's.
enum LoraGroup { kGroupQkv, kGroupO, kGroupGateUp, kGroupDown, kNumGroups };

struct Lora {
  const at::Tensor& slots;           // [T] int64
  const std::vector<OptTensor>& a;   // per group, or None: no member adapted this step
  const std::vector<OptTensor>& b;   // per projection (Weight order), or None: not adapted
  int64_t r_max;
};

// ys[i] += x A^T B_i^T per token, for the adapted members of `group` (x: the group's input).
void add_lora(const Lora* lora, int group, const at::Tensor& x, const std::vector<int>& members,
              const std::vector<at::Tensor*>& ys, int64_t isa) {
  if (lora == nullptr || !lora->a[group].has_value()) return;
  static auto shrink = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("pagedserve_cpu::lora_shrink", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  static auto expand = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("pagedserve_cpu::lora_expand_", "")
                           .typed<void(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                       const at::Tensor&, int64_t)>();
  const at::Tensor h = shrink.call(x, *lora->a[group], lora->slots, isa);
  for (size_t i = 0; i < members.size(); ++i) {
    const OptTensor& b = lora->b[members[i]];
    if (b.has_value()) expand.call(*ys[i], h, int64_t(i) * lora->r_max, *b, lora->slots, isa);
  }
}

// The gated MLP's activation: act 0 silu, 1 gelu (tanh approximation) by torch's ops; 2 / 3 the
// same by pagedserve_fp32::fp32_activation (kernels/cpu_fp32.py), which the layers' Activation
// modules use whenever that extension is loaded (the Python wrapper picks the code to match).
at::Tensor activate(const at::Tensor& x, int64_t act) {
  if (act < 2) return act == 1 ? at::gelu(x, "tanh") : at::silu(x);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedserve_fp32::fp32_activation", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(x, act - 2, 0);
}

// The step's K/V written at their slots in the caches' dtype: bf16 as they are, or fp8
// (kv_cache_dtype) rounded and saturated to the format's largest finite value as
// attention/kv_dtype.py's to_cache does, through byte views (index_copy_ takes no float8).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_kv_heads,
              int64_t head_dim) {
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const auto type = k_cache.scalar_type();
  if (type == at::kBFloat16) {
    k_cache.view({slots, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k);
    v_cache.view({slots, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v);
    return;
  }
  const double limit = type == at::ScalarType::Float8_e4m3fn ? 448.0 : 57344.0;
  for (const auto& [src, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}})
    cache->view({slots, num_kv_heads, head_dim}).view(at::kByte).index_copy_(
        0, slot_mapping, src->clamp(-limit, limit).to(type).view(at::kByte));
}

// The attention half of a layer: h = norm_in(x), q/k/v, q/k norm + RoPE, K/V write, paged decode
// attention, o; then the residual r and the feed-forward's input h:
//   Llama:  r = x + o;                h = norm_post_attn(r)
//   Gemma:  r = x + norm_post_attn(o); h = norm_pre_ff(r)
// (norm_mode 3: Llama's structure with Gemma's norm numerics -- the fp32 weight multiplied before
// one rounding, gpt-oss's norms; `sinks`, gpt-oss: a logit per query head in the attention's
// softmax denominators; `whole_qk`, OLMoE: the q/k norms span the whole projections -- one norm
// of [T, Hq * D] / [T, Hkv * D] before the heads are split and rotated -- and `clip` > 0 clamps
// q, k, v to [-clip, clip] after them.)
struct AttnHalf {
  at::Tensor r, h;
};

// Checks of the arguments both ops share (weights: q, k, v, o first).
void check_layer_args(const std::vector<at::Tensor>& w, const std::vector<OptTensor>& b,
                      const std::vector<OptTensor>& n, int64_t norm_mode,
                      const std::vector<int64_t>& fmts, const std::vector<int64_t>& gemm_rows,
                      const at::Tensor& x, size_t num_weights) {
  TORCH_CHECK(fmts.size() == num_weights && w.size() == num_weights && gemm_rows.size() == num_weights,
              "decoder_layer: ", num_weights, " weights, formats and gemm_rows expected");
  TORCH_CHECK(b.size() == kNumBiases && n.size() == kNumNorms,
              "decoder_layer: 4 biases and 6 norm weights expected");
  TORCH_CHECK(norm_mode >= 1 && norm_mode <= 3,
              "decoder_layer: norm_mode 1 (Gemma), 2 (Llama) or 3 (Llama, fp32-weight norms)");
  for (int i : {kInput, kPostAttn}) TORCH_CHECK(n[i].has_value(), "decoder_layer: norm ", i);
  if (norm_mode == 1)
    for (int i : {kPreFf, kPostFf}) TORCH_CHECK(n[i].has_value(), "decoder_layer: norm ", i);
  TORCH_CHECK(n[kQNorm].has_value() == n[kKNorm].has_value(), "decoder_layer: q/k norms: both or neither");
  TORCH_CHECK(x.dim() == 2, "decoder_layer: x must be [T, H]");
}

AttnHalf attention_half(const at::Tensor& x, const std::vector<at::Tensor>& w,
                        const std::vector<OptTensor>& b, const std::vector<OptTensor>& n,
                        int64_t norm_mode, double eps, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                        int64_t window, const std::vector<int64_t>& fmts, int64_t isa,
                        const std::vector<int64_t>& gemm_rows, const Lora* lora, const OptTensor& sinks,
                        bool whole_qk, double clip) {
  // gemma: the sandwich structure; llama: Llama's norm numerics (bf16 weight product)
  const bool gemma = norm_mode == 1, llama = norm_mode == 2;
  const int64_t T = x.size(0);
  at::Tensor h = rmsnorm(x, *n[kInput], eps, llama, isa);
  // q, k, v share h: one parallel region, h quantized once
  std::vector<at::Tensor> qkv = project_fused(h, {w[kQ], w[kK], w[kV]}, {b[kBq], b[kBk], b[kBv]},
                                              {fmts[kQ], fmts[kK], fmts[kV]}, isa,
                                              {gemm_rows[kQ], gemm_rows[kK], gemm_rows[kV]});
  add_lora(lora, kGroupQkv, h, {kQ, kK, kV}, {&qkv[0], &qkv[1], &qkv[2]}, isa);
  OptTensor qn = n[kQNorm], kn = n[kKNorm];  // per-head norms, in the RoPE kernel
  if (whole_qk) {
    qkv[0] = rmsnorm(qkv[0], *qn, eps, llama, isa);
    qkv[1] = rmsnorm(qkv[1], *kn, eps, llama, isa);
    qn = kn = std::nullopt;
  }
  if (clip > 0)
    for (auto& t : qkv) t = at::clamp(t, -clip, clip);
  at::Tensor q = qkv[0].view({T, num_heads, head_dim});
  at::Tensor k = qkv[1].view({T, num_kv_heads, head_dim});
  at::Tensor v = qkv[2].view({T, num_kv_heads, head_dim});
  qk_norm_rope(q, k, cos, sin, qn, kn, eps, qn.has_value() ? (llama ? 2 : 1) : 0, isa);
  write_kv(k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim);
  at::Tensor a = attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, isa, sinks);
  const at::Tensor attn = a.view({T, num_heads * head_dim});
  at::Tensor o = project(attn, w[kO], b[kBo], fmts[kO], isa, gemm_rows[kO]);
  add_lora(lora, kGroupO, attn, {kO}, {&o}, isa);
  AttnHalf out;
  if (gemma) {
    out.r = at::add(x, rmsnorm(o, *n[kPostAttn], eps, false, isa));
    out.h = rmsnorm(out.r, *n[kPreFf], eps, false, isa);
  } else {
    out.r = at::add(x, o);
    out.h = rmsnorm(out.r, *n[kPostAttn], eps, llama, isa);
  }
  return out;
}

// norm_mode: 1 Gemma numerics (sandwich norms: post-attention and pre/post-feed-forward),
// 2 Llama numerics (pre-norms only), 3 pre-norms with Gemma numerics. act: see `activate`.
// lora: the step's adapters (nullptr: none).
at::Tensor run_layer(const at::Tensor& x, const std::vector<at::Tensor>& w,
                     const std::vector<OptTensor>& b, const std::vector<OptTensor>& n,
                     int64_t norm_mode, double eps, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                     int64_t window, int64_t act, const std::vector<int64_t>& fmts,
                     int64_t isa, const std::vector<int64_t>& gemm_rows, const Lora* lora) {
  check_layer_args(w, b, n, norm_mode, fmts, gemm_rows, x, kNumWeights);
  TORCH_CHECK(act >= 0 && act <= 3, "decoder_layer: act 0 / 2 (silu), 1 / 3 (gelu tanh)");
  const bool gemma = norm_mode == 1;
  const AttnHalf ah = attention_half(x, w, b, n, norm_mode, eps, cos, sin, k_cache, v_cache,
                                     slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads,
                                     head_dim, scale, window, fmts, isa, gemm_rows, lora, std::nullopt,
                                     false, 0.0);
  const at::Tensor& h = ah.h;
  // gate and up share h: one parallel region
  std::vector<at::Tensor> gu = project_fused(h, {w[kGate], w[kUp]}, {std::nullopt, std::nullopt},
                                             {fmts[kGate], fmts[kUp]}, isa,
                                             {gemm_rows[kGate], gemm_rows[kUp]});
  add_lora(lora, kGroupGateUp, h, {kGate, kUp}, {&gu[0], &gu[1]}, isa);
  const at::Tensor g = activate(gu[0], act);
  const at::Tensor mid = at::mul(g, gu[1]);
  at::Tensor m = project(mid, w[kDown], std::nullopt, fmts[kDown], isa, gemm_rows[kDown]);
  add_lora(lora, kGroupDown, mid, {kDown}, {&m}, isa);
  return at::add(ah.r, gemma ? rmsnorm(m, *n[kPostFf], eps, false, isa) : m);
}

// The attention half alone (weights q, k, v, o), for layers whose feed-forward the caller runs
// (an MoE block: layers/moe.py, its experts in one call of csrc/moe.cpp): returns [r, h], the
// residual after attention and the feed-forward's normed input (see AttnHalf); the layer's
// output is then r + ff(h) (Llama numerics) -- the modules' ops, so bit-identical to them.
std::vector<at::Tensor> decoder_layer_attn(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                           const std::vector<OptTensor>& b, const std::vector<OptTensor>& n,
                                           int64_t norm_mode, double eps, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                           double scale, int64_t window, const std::vector<int64_t>& fmts,
                                           int64_t isa, const std::vector<int64_t>& gemm_rows, const OptTensor& sinks,
                                           bool whole_qk, double clip) {
  check_layer_args(w, b, n, norm_mode, fmts, gemm_rows, x, kO + 1);
  TORCH_CHECK(!whole_qk || n[kQNorm].has_value(), "decoder_layer_attn: whole_qk needs the q/k norms");
  const AttnHalf ah = attention_half(x, w, b, n, norm_mode, eps, cos, sin, k_cache, v_cache,
                                     slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads,
                                     head_dim, scale, window, fmts, isa, gemm_rows, nullptr, sinks,
                                     whole_qk, clip);
  return {ah.r, ah.h};
}

at::Tensor decoder_layer(const at::Tensor& x, const std::vector<at::Tensor>& w,
                         const std::vector<OptTensor>& b, const std::vector<OptTensor>& n,
                         int64_t norm_mode, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                         int64_t window, int64_t act, const std::vector<int64_t>& fmts,
                         int64_t isa, const std::vector<int64_t>& gemm_rows) {
  return run_layer(x, w, b, n, norm_mode, eps, cos, sin, k_cache, v_cache, slot_mapping,
                   block_tables, seq_lens, num_heads, num_kv_heads, head_dim, scale, window, act,
                   fmts, isa, gemm_rows, nullptr);
}

// decoder_layer with the step's adapters (see Lora): lora_a per group (q/k/v, o, gate/up, down),
// lora_b per projection (q, k, v, o, gate, up, down), None where not adapted this step.
at::Tensor decoder_layer_lora(const at::Tensor& x, const std::vector<at::Tensor>& w,
                              const std::vector<OptTensor>& b, const std::vector<OptTensor>& n,
                              int64_t norm_mode, double eps, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              double scale, int64_t window, int64_t act,
                              const std::vector<int64_t>& fmts, int64_t isa, const std::vector<int64_t>& gemm_rows,
                              const at::Tensor& token_slots, const std::vector<OptTensor>& lora_a,
                              const std::vector<OptTensor>& lora_b, int64_t r_max) {
  TORCH_CHECK(lora_a.size() == kNumGroups && lora_b.size() == kNumWeights,
              "decoder_layer_lora: 4 A stacks (q/k/v, o, gate/up, down) and 7 B stacks expected");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0),
              "decoder_layer_lora: token_slots must be [T]");
  const int64_t members[kNumGroups] = {3, 1, 2, 1};
  const int first[kNumGroups] = {kQ, kO, kGate, kDown};
  for (int g = 0; g < kNumGroups; ++g) {
    bool any_b = false;
    for (int i = first[g]; i < first[g] + members[g]; ++i) {
      if (!lora_b[i].has_value()) continue;
      any_b = true;
      TORCH_CHECK(lora_b[i]->dim() == 3 && lora_b[i]->size(1) == r_max && lora_b[i]->size(2) == w[i].size(0),
                  "decoder_layer_lora: B^T of weight ", i, " must be [slots, r_max, out]");
    }
    TORCH_CHECK(any_b == lora_a[g].has_value(), "decoder_layer_lora: group ", g,
                ": A^T is given exactly when a member's B^T is");
    if (lora_a[g].has_value())
      TORCH_CHECK(lora_a[g]->dim() == 3 && lora_a[g]->size(2) == members[g] * r_max,
                  "decoder_layer_lora: A^T of group ", g, " must be [slots, in, members * r_max]");
  }
  const Lora lora{token_slots, lora_a, lora_b, r_max};
  return run_layer(x, w, b, n, norm_mode, eps, cos, sin, k_cache, v_cache, slot_mapping,
                   block_tables, seq_lens, num_heads, num_kv_heads, head_dim, scale, window, act,
                   fmts, isa, gemm_rows, &lora);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor?[] norms, int norm_mode, "
      "float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float scale, int window, int act, int[] formats, int isa, int[] gemm_rows) -> Tensor");
  m.def(
      "decoder_layer_lora(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor?[] norms, "
      "int norm_mode, float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float scale, int window, int act, int[] formats, int isa, int[] gemm_rows, "
      "Tensor token_slots, Tensor?[] lora_a, Tensor?[] lora_b, int r_max) -> Tensor");
  m.def(
      "decoder_layer_attn(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor?[] norms, "
      "int norm_mode, float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float scale, int window, int[] formats, int isa, int[] gemm_rows, "
      "Tensor? sinks=None, bool whole_qk=False, float clip=0.0) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layer_lora", &decoder_layer_lora);
  m.impl("decoder_layer_attn", &decoder_layer_attn);
}
