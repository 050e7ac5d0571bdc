// Linear layers over bf16 or quantized weights on x86-64 CPUs, one kernel for every batch size:
//     y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias[N]),  fp32 accumulation.
//
// Weight formats (W's rows as raw bytes, see `row_bytes`): bf16, and the ggml blocks Q8_0, Q4_0,
// Q5_0, Q4_K, Q5_K, Q6_K (as in GGUF files), and our INT8 (per row: fp32 scale, then K int8).
//
// The ggml formats, at every ISA level: each row of x quantized to 8-bit blocks of 32, integer
// dot products with the weight blocks as they are stored (AVX2 maddubs/madd, one fp32 FMA per
// block), as llama.cpp computes them: qlinear_q8.h, compiled once, for AVX2.
//
// bf16 and INT8 weights: ISA levels, compiled side by side (qlinear_impl.h included once per level
// under `#pragma GCC target`) and picked at run time from cpuid (capped by the caller, so each is
// testable on one machine):
//   4 AMX          W rows dequantized to bf16, AMX tiles (K % 32 == 0; else level 3's code)
//   3 AVX512-BF16  W rows dequantized to bf16, vdpbf16ps dot products
//   2 AVX512F      W rows dequantized to fp32, fp32 FMA (16 lanes); x converted to fp32
//   1 AVX2+FMA     the same with 8 lanes
// A level-3/4 call with fp32 x runs level 2. Within a level, results do not depend on M (see the
// NOTEs in qlinear_impl.h and qlinear_q8.h). Registered as
// torch.ops.pagedserve_cpu.{qlinear, qrows, cpu_isa}; Python side: kernels/cpu_qlinear.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace ps_isa;

enum Fmt : int64_t {
  kFmtBf16 = 0, kFmtQ8_0 = 1, kFmtQ4_K = 2, kFmtQ5_K = 3, kFmtQ6_K = 4, kFmtInt8 = 5, kFmtQ5_0 = 6,
  kFmtQ4_0 = 7,
};

// Bytes of one row of K values in format fmt; -1 if K does not fit the format's blocks.
int64_t row_bytes(int64_t fmt, int64_t K) {
  switch (fmt) {
    case kFmtBf16: return 2 * K;
    case kFmtInt8: return 4 + K;
    case kFmtQ8_0: return K % 32 ? -1 : K / 32 * 34;
    case kFmtQ4_0: return K % 32 ? -1 : K / 32 * 18;
    case kFmtQ5_0: return K % 32 ? -1 : K / 32 * 22;
    case kFmtQ4_K: return K % 256 ? -1 : K / 256 * 144;
    case kFmtQ5_K: return K % 256 ? -1 : K / 256 * 176;
    case kFmtQ6_K: return K % 256 ? -1 : K / 256 * 210;
  }
  return -1;
}

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

// fn(n_begin, n_end) over [0, N) in chunks of whole 16-row blocks, handed out dynamically to
// torch's threads (a preempted thread delays one chunk, not a fixed share). Which thread computes
// a block never changes its result.
template <typename Fn>
void parallel_blocks(int64_t N, const Fn& fn) {
  const int64_t blocks = (N + 15) / 16;
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>({1, 4, blocks / (max_threads * 8)});  // >= 64 rows
  const int64_t chunks = (blocks + chunk - 1) / chunk;
  const int64_t threads = std::min(max_threads, chunks);
  if (threads <= 1) {
    if (N > 0) fn(0, N);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      fn(c * chunk * 16, std::min(N, (c + 1) * chunk * 16));
  });
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define PS_ISA 1
#include "qlinear_impl.h"
#include "qlinear_q8.h"
#undef PS_ISA
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
namespace isa_avx512 {
#define PS_ISA 2
#include "qlinear_impl.h"
#undef PS_ISA
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace isa_avx512bf16 {
#define PS_ISA 3
#include "qlinear_impl.h"
#undef PS_ISA
}  // namespace isa_avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace isa_amx {
#define PS_ISA 4
#include "qlinear_impl.h"
#undef PS_ISA
}  // namespace isa_amx
#pragma GCC pop_options

namespace {

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

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                   const c10::optional<at::Tensor>& bias, bool out_fp32, int64_t isa,
                   int64_t gemm_rows) {
  check_isa("qlinear", isa);
  int64_t rb;
  const uint8_t* wp = check_weight("qlinear", w, fmt, K, &rb);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) == K,
              "qlinear: x must be a contiguous [M, K] CPU tensor with K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "qlinear: x must be bfloat16 or float32");
  const int64_t M = x.size(0), N = w.size(0);
  const float* bias_ptr = nullptr;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N,
                "qlinear: bias must be a CPU tensor of shape [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f32.data_ptr<float>();
  }
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  if (M == 0 || N == 0) return y;
  const Out out{y.data_ptr(), N, y.scalar_type() == at::kFloat, bias_ptr};
  // ggml formats below gemm_rows rows (or always, gemm_rows <= 0): 8-bit x, integer block
  // products on the stored blocks (qlinear_q8.h), at every level. From gemm_rows rows on, the
  // blocked GEMM below: 16 weight rows dequantized once into L1/L2, every row of x over them.
  if (isa_avx2::q8_format(fmt) && (gemm_rows <= 0 || M < gemm_rows)) {
    if (x_bf16) isa_avx2::run_q8(fmt, reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, wp, rb, N, out);
    else isa_avx2::run_q8(fmt, x.data_ptr<float>(), M, K, wp, rb, N, out);
    return y;
  }
  if (isa >= kIsaAvx512Bf16 && !x_bf16) isa = kIsaAvx512;
  if (isa >= kIsaAvx512Bf16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (isa == kIsaAmx) isa_amx::run(fmt, xp, M, K, wp, rb, N, out);
    else isa_avx512bf16::run(fmt, xp, M, K, wp, rb, N, out);
    return y;
  }
  const at::Tensor xf = x_bf16 ? x.to(at::kFloat) : x;
  const float* xp = xf.data_ptr<float>();
  if (isa == kIsaAvx512) isa_avx512::run(fmt, xp, M, K, wp, rb, N, out);
  else isa_avx2::run(fmt, xp, M, K, wp, rb, N, out);
  return y;
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

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("qlinear(Tensor x, Tensor w, int fmt, int K, Tensor? bias, bool out_fp32, int isa, int gemm_rows) -> Tensor");
  m.def("qrows(Tensor w, int fmt, int K, Tensor ids, int isa) -> Tensor");
  m.def("cpu_isa() -> int", &cpu_isa);
  m.def("qrow_bytes(int fmt, int K) -> int", &qrow_bytes);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qrows", &qrows);
}
