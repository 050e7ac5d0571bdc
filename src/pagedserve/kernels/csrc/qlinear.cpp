// Linear layers over bf16 or quantized weights on x86-64 CPUs, one kernel for every batch size:
//     y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias[N]),  fp32 accumulation.
//
// Weight formats: the rows of the table in qformats.h (W's rows as raw bytes, `row_bytes`): bf16,
// the ggml blocks Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4 (as in GGUF files), our INT8
// (per row: fp32 scale, then K int8), and Q4_Z / Q8_F (HF checkpoints' AWQ / GPTQ /
// compressed-tensors weights repacked losslessly). Every dispatch over formats below is
// generated from that table.
//
// The DOT8 formats, at every ISA level: each row of x quantized to 8-bit blocks of 32, integer
// dot products with the weight blocks as they are stored (AVX2 maddubs/madd, one fp32 FMA per
// block), as llama.cpp computes them: qlinear_q8.h, compiled once, for AVX2; on the AVX512-BF16
// and AMX levels the same kernel on AVX512-VNNI (qlinear_q8_vnni.h: two blocks per vpdpbusd, the
// same integer sums and fp32 operations, so the same bits).
//
// bf16 and INT8 weights: ISA levels, compiled side by side (qlinear_impl.h included once per level
// under `#pragma GCC target`) and picked at run time from cpuid (capped by the caller, so each is
// testable on one machine):
//   4 AMX          W rows dequantized to bf16, AMX tiles (K % 32 == 0; else level 3's code)
//   3 AVX512-BF16  W rows dequantized to bf16, vdpbf16ps dot products
//   2 AVX512F      W rows dequantized to fp32, fp32 FMA (16 lanes); x converted to fp32
//   1 AVX2+FMA     the same with 8 lanes
// From gemm_rows rows on (bf16 x), the DOT8 formats whose row names a GEMM take a blocked GEMM
// instead: on AVX2 the 8-bit one (qlinear_q8_gemm.h: 16 weight rows unpacked once into
// column-interleaved bytes, maddubs on the 8-bit x); on AVX512-BF16 the 8-bit one for the VNNI
// rows (qlinear_vnni.h: vpdpbusd on the 8-bit x; every ggml format with a GEMM, Q6_K included),
// the bf16 one (qlinear_bcast.h) for a row naming the Q8 GEMM; AMX tiles on level 4; dequantized
// fp32 on AVX512F.
// qlinear_argmax: the greedy LM head, the product scanned chunk by chunk (no logits in memory).
// A level-3/4 call with fp32 x runs level 2. Within a level, results do not depend on M (see the
// NOTEs in qlinear_impl.h and qlinear_q8.h). Registered as
// torch.ops.pagedserve_cpu.{qlinear, qlinear_fused, qlinear_argmax, qrows, cpu_isa}; Python side: kernels/cpu_qlinear.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "qformats.h"
#include "qlinear_api.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>

using namespace ps_fmt;  // the format codes (kFmt*) and their table, in every ISA namespace

namespace {

using namespace ps_isa;

// Where results go: y[m, n] = v + bias[n], rounded once to y's dtype (`put_out` in
// qlinear_impl.h), at y + m * ldy + (n - n0): n0 is the first column y holds (0 for the result
// tensor; a staging buffer's first column, see `run` in qlinear_impl.h).
struct Out {
  void* y;
  int64_t ldy;
  bool fp32;
  const float* bias;
  int64_t n0 = 0;
};

}  // namespace

#include "argmax_best.h"

#define PS_VEC_KERNEL "argmax_impl.h"
#include "vec16_build.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace isa_avx2 {
#define PS_ISA 1
#include "qlinear_impl.h"
#include "qlinear_q8.h"
#include "qlinear_q8_gemm.h"
#undef PS_ISA
}  // namespace isa_avx2
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
namespace {
namespace isa_avx512 {
#define PS_ISA 2
#include "qlinear_impl.h"
#undef PS_ISA
}  // namespace isa_avx512
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")
namespace {
namespace isa_avx512bf16 {
#define PS_ISA 3
#include "qlinear_impl.h"
#include "qlinear_q8_vnni.h"
#undef PS_ISA
}  // namespace isa_avx512bf16
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace {
namespace isa_amx {
#define PS_ISA 4
#include "qlinear_impl.h"
#undef PS_ISA
}  // namespace isa_amx
}  // namespace
#pragma GCC pop_options

namespace {

#include "argmax_rows.h"

const uint8_t* check_weight(const char* op, const at::Tensor& w, int64_t fmt, int64_t K, int64_t* rb) {
  *rb = row_bytes(fmt, K);
  TORCH_CHECK(*rb > 0, op, ": K = ", K, " does not fit format ", fmt);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), op,
              ": weight must be a contiguous 2-D CPU tensor");
  const bool bf = fmt == kFmtBf16;
  TORCH_CHECK(w.scalar_type() == (bf ? at::kBFloat16 : at::kByte), op,
              ": weight dtype must be ", bf ? "bfloat16" : "uint8", " for format ", fmt);
  TORCH_CHECK(w.size(1) * int64_t(w.element_size()) == *rb, op, ": weight rows hold ",
              w.size(1) * w.element_size(), " bytes, format ", fmt, " with K = ", K, " needs ", *rb);
  return reinterpret_cast<const uint8_t*>(w.data_ptr());
}

// What the products of one call share: x in the forms their kernels read, made once.
struct SharedX {
  std::map<int, std::unique_ptr<isa_avx2::QuantizedX>> q8;  // by the formats' offset
  at::Tensor f32;                                           // fp32 x (AVX2 / AVX512F GEMM)
  isa_amx::RunPrep amx;                                     // x packed into AMX tiles
  bool amx_ready = false;
  isa_avx512bf16::RunPrep pairs;                            // x packed for bcast_block
  bool pairs_ready = false;
  isa_avx512bf16::VnniX vnni;                               // 8-bit x packed for vnni_range
  bool vnni_ready = false;
  std::vector<uint8_t> xu;                                  // 8-bit x + 128 (the AVX2 GEMM)
  std::vector<int32_t> xsum;                                // its blocks' sum(qx)
  bool xu_ready = false;
};

// x quantized to 8-bit blocks for formats of `offset` (once per call and offset).
const isa_avx2::XQ& quantized_x(SharedX& sx, const at::Tensor& x, int64_t M, int64_t K, int offset) {
  auto& xq = sx.q8[offset];
  if (!xq) {
    xq = std::make_unique<isa_avx2::QuantizedX>();
    if (x.scalar_type() == at::kBFloat16)
      isa_avx2::quantize_x(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, offset, *xq);
    else
      isa_avx2::quantize_x(x.data_ptr<float>(), M, K, offset, *xq);
  }
  return xq->xq;
}

// One product set up to run over any range of its output columns (`range(out, nb, ne)`, whole
// 16-row blocks, into `out`: its result y, or a buffer holding those columns): its kernel chosen,
// its result allocated (unless not wanted).
struct Product {
  at::Tensor y;
  at::Tensor bias_f32;
  Out out{};
  int64_t M = 0, N = 0;
  std::function<void(const Out&, int64_t, int64_t)> range;
};

std::unique_ptr<Product> make_product(const char* op, const at::Tensor& x, const at::Tensor& w,
                                      int64_t fmt, int64_t K, const c10::optional<at::Tensor>& bias,
                                      bool out_fp32, int64_t isa, int64_t gemm_rows, SharedX& sx,
                                      bool alloc_y = true) {
  int64_t rb;
  const uint8_t* wp = check_weight(op, w, fmt, K, &rb);
  const int64_t M = x.size(0), N = w.size(0);
  auto p = std::make_unique<Product>();
  p->M = M;
  p->N = N;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, op,
                ": bias must be a CPU tensor of shape [N]");
    p->bias_f32 = bias->to(at::kFloat).contiguous();
    bias_ptr = p->bias_f32.data_ptr<float>();
  }
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const bool y_fp32 = out_fp32 || x.scalar_type() == at::kFloat;
  if (alloc_y) p->y = at::empty({M, N}, x.options().dtype(y_fp32 ? at::kFloat : x.scalar_type()));
  p->out = Out{alloc_y ? p->y.data_ptr() : nullptr, N, y_fp32, bias_ptr};
  if (M == 0 || N == 0) {
    p->range = [](const Out&, int64_t, int64_t) {};
    return p;
  }
  if (dot8_format(fmt) && !gemm_format(fmt) && gemm_rows > 0) gemm_rows = 0;  // its row takes no GEMM (MXFP4)
  // ggml formats below gemm_rows rows (or always, gemm_rows == 0): 8-bit x, integer block
  // products on the stored blocks (qlinear_q8.h), at every level. From gemm_rows rows on, the
  // blocked GEMM below: 16 weight rows dequantized once into L1/L2, every row of x over them.
  // gemm_rows < 0: no 8-bit x at all -- the blocks dequantized 16 rows at a time (to bf16 on the
  // bf16 levels, fp32 below) and multiplied with x as it is, by dot_block (batch-invariant at
  // every M), as bf16 / INT8 weights are: what the dequantized checkpoint computes.
  const bool x8 = gemm_rows >= 0;
  if (dot8_format(fmt) && x8 && (gemm_rows == 0 || M < gemm_rows) && isa >= kIsaAvx512Bf16) {
    // the same kernel on AVX512-VNNI, bit for bit (qlinear_q8_vnni.h)
    const isa_avx2::XQ* q = &quantized_x(sx, x, M, K, isa_avx512bf16::q8v_offset);
    p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_avx512bf16::q8v_range_fmt(fmt, *q, M, wp, rb, out, nb, ne); };
    return p;
  }
  if (dot8_format(fmt) && x8 && (gemm_rows == 0 || M < gemm_rows)) {
    const isa_avx2::XQ* q = &quantized_x(sx, x, M, K, isa_avx2::q8_offset(fmt));
    p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_avx2::q8_range_fmt(fmt, *q, M, wp, rb, out, nb, ne); };
    return p;
  }
  if (isa == kIsaAvx2 && dot8_format(fmt) && x8) {  // the AVX2 8-bit GEMM (qlinear_q8_gemm.h)
    // NOTE: offset 0 -- the quantization (q, d, s) is the same for every offset
    const isa_avx2::XQ* q = &quantized_x(sx, x, M, K, 0);
    if (!sx.xu_ready) isa_avx2::gemm_x(*q, M, sx.xu, sx.xsum);
    sx.xu_ready = true;
    const uint8_t* xu = sx.xu.data();
    const int32_t* xsum = sx.xsum.data();
    p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_avx2::g_range_fmt(fmt, *q, xu, xsum, M, wp, rb, out, nb, ne); };
    return p;
  }
  if (isa >= kIsaAvx512Bf16 && !x_bf16) isa = kIsaAvx512;
  if (isa >= kIsaAvx512Bf16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (isa == kIsaAmx) {
      if (!sx.amx_ready) isa_amx::run_prepare(xp, M, K, sx.amx, true);
      sx.amx_ready = true;
      const isa_amx::RunPrep* prep = &sx.amx;
      p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_amx::run_range(fmt, xp, M, K, wp, rb, N, out, *prep, nb, ne); };
    } else if (vnni_format(fmt) && x8) {  // the 8-bit GEMM: vnni_range
      if (!sx.vnni_ready) isa_avx512bf16::vnni_quantize_pack(xp, M, K, sx.vnni);  // bf16 x (fp32 x: level 2)
      sx.vnni_ready = true;
      const isa_avx512bf16::VnniX* vx = &sx.vnni;
      p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_avx512bf16::vnni_range(fmt, *vx, M, K, wp, rb, out, nb, ne); };
    } else if (dot8_format(fmt) && x8) {  // the GEMM over ggml blocks: bcast_block
      if (!sx.pairs_ready) isa_avx512bf16::run_prepare(xp, M, K, sx.pairs, true);
      sx.pairs_ready = true;
      const isa_avx512bf16::RunPrep* prep = &sx.pairs;
      p->range = [=](const Out& out, int64_t nb, int64_t ne) {
        isa_avx512bf16::run_range(fmt, xp, M, K, wp, rb, N, out, *prep, nb, ne);
      };
    } else {  // bf16 / INT8 weights (and ggml blocks with gemm_rows < 0): dot_block, batch-invariant at every M
      p->range = [=](const Out& out, int64_t nb, int64_t ne) {
        isa_avx512bf16::run_range(fmt, xp, M, K, wp, rb, N, out, isa_avx512bf16::RunPrep{}, nb, ne);
      };
    }
    return p;
  }
  if (!sx.f32.defined()) sx.f32 = x_bf16 ? x.to(at::kFloat) : x;
  const float* xp = sx.f32.data_ptr<float>();
  if (isa == kIsaAvx512)
    p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_avx512::run_range(fmt, xp, M, K, wp, rb, N, out, isa_avx512::RunPrep{}, nb, ne); };
  else
    p->range = [=](const Out& out, int64_t nb, int64_t ne) { isa_avx2::run_range(fmt, xp, M, K, wp, rb, N, out, isa_avx2::RunPrep{}, nb, ne); };
  return p;
}

// Every product's columns in chunks of whole 16-row blocks, in ONE parallel region of torch's
// threads (chunks handed out dynamically: a preempted thread delays one chunk, not a fixed
// share). Which thread computes a block, and which chunk holds it, never changes its result.
// NOTE: chunks of >= 64 rows of W, ~8 per thread; for prompt-sized x (kBigM rows) ~4 per thread:
// a GEMM streams all of x once per group of columns it dequantizes (amx_range's kBlocks, at
// most one chunk), so bigger chunks read x fewer times (2,048 x 640 times Gemma 3's 2,048-row
// gate: 1.33 -> 1.72 TFLOP/s on AMX), and a chunk's work is long enough to balance 4 a thread.
void run_products(const std::vector<Product*>& ps) {
  constexpr int64_t kBigM = 256;
  int64_t blocks = 0;
  bool big = true;
  for (const Product* p : ps) blocks += (p->N + 15) / 16, big = big && p->M >= kBigM;
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>({1, 4, blocks / (max_threads * (big ? 4 : 8))});
  struct Chunk {
    const Product* p;
    int64_t nb, ne;
  };
  std::vector<Chunk> chunks;
  for (const Product* p : ps)
    for (int64_t b = 0; b * 16 < p->N; b += chunk) chunks.push_back({p, b * 16, std::min(p->N, (b + chunk) * 16)});
  const int64_t threads = std::min<int64_t>(max_threads, int64_t(chunks.size()));
  if (threads <= 1) {
    for (const Chunk& c : chunks) c.p->range(c.p->out, c.nb, c.ne);
    return;
  }
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (size_t c = next.fetch_add(1); c < chunks.size(); c = next.fetch_add(1))
      chunks[c].p->range(chunks[c].p->out, chunks[c].nb, chunks[c].ne);
  });
}

void check_x(const char* op, const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) == K, op,
              ": x must be a contiguous [M, K] CPU tensor with K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32");
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                   const c10::optional<at::Tensor>& bias, bool out_fp32, int64_t isa,
                   int64_t gemm_rows) {
  check_isa("qlinear", isa);
  check_x("qlinear", x, K);
  SharedX sx;
  auto p = make_product("qlinear", x, w, fmt, K, bias, out_fp32, isa, gemm_rows, sx);
  run_products({p.get()});
  return p->y;
}

// Several products of one x (q / k / v, gate / up) in one parallel region, x quantized or
// converted once: each result equals qlinear's for that weight, bit for bit.
std::vector<at::Tensor> qlinear_fused(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                      const std::vector<int64_t>& fmts, int64_t K,
                                      const std::vector<c10::optional<at::Tensor>>& biases,
                                      int64_t isa, const std::vector<int64_t>& gemm_rows) {
  check_isa("qlinear_fused", isa);
  check_x("qlinear_fused", x, K);
  TORCH_CHECK(ws.size() == fmts.size() && ws.size() == biases.size() && ws.size() == gemm_rows.size() &&
                  !ws.empty(),
              "qlinear_fused: one format, one bias (or None) and one gemm_rows per weight");
  SharedX sx;
  std::vector<std::unique_ptr<Product>> owned;
  std::vector<Product*> ps;
  for (size_t i = 0; i < ws.size(); ++i) {
    owned.push_back(make_product("qlinear_fused", x, ws[i], fmts[i], K, biases[i], false, isa, gemm_rows[i], sx));
    ps.push_back(owned.back().get());
  }
  run_products(ps);
  std::vector<at::Tensor> ys;
  for (auto& p : owned) ys.push_back(p->y);
  return ys;
}

// The greedy tokens of x @ W^T (+ b): argmax_bf16(qlinear(x, w, ...)), bit for bit, without the
// [M, N] logits. Each chunk of kCols columns is computed (the same kernels, so the same bf16
// values) into a thread's buffer of M x kCols, which stays in L2, and scanned there at once; the
// chunks' bests merge by argmax's total order. NOTE: why: at 64 rows the 262,144-column LM head
// wrote 33 MB of logits to memory and read them back every step.
at::Tensor qlinear_argmax(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                          const c10::optional<at::Tensor>& bias, int64_t isa, int64_t gemm_rows) {
  check_isa("qlinear_argmax", isa);
  check_x("qlinear_argmax", x, K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "qlinear_argmax: x must be bfloat16");
  SharedX sx;
  auto p = make_product("qlinear_argmax", x, w, fmt, K, bias, false, isa, gemm_rows, sx, false);
  const int64_t M = x.size(0), N = p->N;
  TORCH_CHECK(N > 0 || M == 0, "qlinear_argmax: argmax of an empty row");
  if (M == 0) return at::empty({0}, x.options().dtype(at::kLong));
  constexpr int64_t kCols = 1024;  // a multiple of the 16-column blocks
  const int64_t chunks = (N + kCols - 1) / kCols;
  RowArgmax best(M, ps_isa::use_avx512(isa) ? isa_avx512bf16::scan_bf16 : isa_avx2::scan_bf16);
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), chunks);
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    std::vector<bf16_t> buf(size_t(M * kCols));
    const Out o0{buf.data(), kCols, false, p->out.bias, 0};
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t nb = c * kCols, ne = std::min(N, nb + kCols);
      Out o = o0;
      o.n0 = nb;
      p->range(o, nb, ne);
      best.scan(buf.data(), 0, M, kCols, 0, ne - nb, nb);
    }
  };
  if (threads <= 1) work();
  else at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { work(); });
  return best.result(x.options());
}

// Rows `ids` of W, dequantized: fp32 [T, K].
at::Tensor qrows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids, int64_t isa) {
  check_isa("qrows", isa);
  int64_t rb;
  const uint8_t* wp = check_weight("qrows", w, fmt, K, &rb);
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "qrows: ids must be a 1-D int64 CPU tensor");
  const at::Tensor idc = ids.contiguous();
  const int64_t T = idc.size(0), N = w.size(0);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "qrows: id ", ip[t], " out of range [0, ", N, ")");
  at::Tensor y = at::empty({T, K}, w.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  (void)isa;  // every level dequantizes with the AVX2 build of the format loops
  isa_avx2::rows_f32(fmt, wp, rb, K, ip, T, yp);
  return y;
}

int64_t qrow_bytes(int64_t fmt, int64_t K) { return row_bytes(fmt, K); }

}  // namespace

// qlinear_api.h: make_product for the extension's other sources (csrc/moe.cpp).
namespace ps_qlinear {
struct XShare {
  SharedX sx;
};
std::shared_ptr<XShare> new_x_share() { return std::make_shared<XShare>(); }
Prepared prepare(XShare& share, const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                 const c10::optional<at::Tensor>& bias, bool out_fp32, int64_t isa, int64_t gemm_rows) {
  std::shared_ptr<Product> p(make_product("qlinear", x, w, fmt, K, bias, out_fp32, isa, gemm_rows, share.sx, false));
  Prepared out;
  out.N = p->N;
  out.y_fp32 = p->out.fp32;
  out.run = [p](void* y, int64_t ldy, int64_t n0, int64_t nb, int64_t ne) {
    Out o = p->out;
    o.y = y, o.ldy = ldy, o.n0 = n0;
    p->range(o, nb, ne);
  };
  return out;
}
int64_t row_bytes_of(int64_t fmt, int64_t K) { return row_bytes(fmt, K); }
}  // namespace ps_qlinear

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("qlinear(Tensor x, Tensor w, int fmt, int K, Tensor? bias, bool out_fp32, int isa, int gemm_rows) -> Tensor");
  m.def("qlinear_fused(Tensor x, Tensor[] ws, int[] fmts, int K, Tensor?[] biases, int isa, int[] gemm_rows) -> Tensor[]");
  m.def("qlinear_argmax(Tensor x, Tensor w, int fmt, int K, Tensor? bias, int isa, int gemm_rows) -> Tensor");
  m.def("qrows(Tensor w, int fmt, int K, Tensor ids, int isa) -> Tensor");
  m.def("cpu_isa() -> int", &cpu_isa);
  m.def("qrow_bytes(int fmt, int K) -> int", &qrow_bytes);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qlinear_fused", &qlinear_fused);
  m.impl("qlinear_argmax", &qlinear_argmax);
  m.impl("qrows", &qrows);
}
