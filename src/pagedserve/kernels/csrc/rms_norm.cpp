// Fused RMSNorm for bf16 activations on x86-64 CPUs with AVX512_BF16: one pass over each row for
// the sum of squares and one for the output, instead of the ~9 torch ops (and temporaries) of the
// eager formula. Matches HF's numerics (statistics in fp32, one rounding to bf16 where HF rounds):
//   mode 0, Gemma:  y = bf16( (x * r) * w1 )              with w1 = 1 + weight, in fp32
//   mode 1, Llama:  y = bf16( bf16(x * r) * w )          with w = the bf16 weight (as fp32)
// where r = 1 / sqrt(mean(x^2) + eps), all in fp32. The sum of squares is accumulated in 16 fp32
// lanes (torch sums in a different order: the last bit of r may differ, rarely a bf16 rounding).
//
// Registered as torch.ops.pagedserve_cpu.rms_norm (a fragment of the library the GEMV file
// defines); the Python wrapper is pagedserve/kernels/cpu_norm.py. As there: no -m flags, the SIMD
// code carries target attributes; callers check kernels.cpu_gemm.kernel_available() first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_bf16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_bf16_tail(const uint16_t* p,
                                                                                 __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512 round_bf16(__m512 v) {
  // fp32 -> bf16 (round to nearest even, as c10::BFloat16) -> fp32
  __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void norm_rows(
    const uint16_t* x, const float* w, uint16_t* y, int64_t H, int64_t r0, int64_t r1, float eps,
    bool llama) {
  const int64_t full = H / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (H - full)) - 1u);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* xr = x + r * H;
    uint16_t* yr = y + r * H;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16) {
      __m512 v = load_bf16(xr + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));  // x^2 rounded, then summed (as pow + sum)
    }
    if (tail) {
      __m512 v = load_bf16_tail(xr + full, tail);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(H);
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = i < full ? static_cast<__mmask16>(0xFFFF) : tail;
      __m512 v = i < full ? load_bf16(xr + i) : load_bf16_tail(xr + i, m);
      __m512 wv = _mm512_maskz_loadu_ps(m, w + i);
      __m512 n = _mm512_mul_ps(v, inv);
      if (llama) n = round_bf16(n);
      __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(n, wv));
      _mm256_mask_storeu_epi16(yr + i, m, out);
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight_f32, double eps, bool llama) {
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
    norm_rows(xp, wp, yp, H, r0, r1, static_cast<float>(eps), llama);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight_f32, float eps, bool llama) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
