// MXFP4 weights (OCP microscaling FP4; gpt-oss's experts, GGUF type MXFP4) for the 8-bit kernel
// of qlinear_q8.h and the row dequantizer. Included by qlinear_impl.h in its AVX2 format loops
// (PS_ISA == 1, namespace isa_avx2), after `nibbles` and `put`.
//
// A block of 32 values takes 17 bytes, as ggml's block_mxfp4: one E8M0 scale byte e, then 16
// bytes of 4-bit E2M1 codes, qs[j]'s low nibble value j and its high nibble value j + 16 (ggml's
// order, as Q4_0). value = fp4(code) * 2^(e - 127), fp4 = 0, .5, 1, 1.5, 2, 3, 4, 6 (code & 7),
// negative for code & 8. The codes are held doubled as int8 (0, 1, 2, 3, 4, 6, 8, 12: exact,
// |q| <= 12, signed like Q8_0's values) and the scale halved: 2^(e - 128), exact for every e
// (subnormal for e < 2, as ggml's GGML_E8M0_TO_FP32_HALF). So the 8-bit kernel's integer block
// products are exact, and the block's product is one fp32 FMA with dw * dx, as for Q8_0.
// NOTE: the blocked GEMMs (qlinear_q8_gemm.h, qlinear_vnni.h, AMX) do not take this format:
// qlinear.cpp's make_product keeps it on the 8-bit kernel at every row count (gemm_rows 0), so
// its products are batch-invariant as Q8_0's are below gemm_rows.

#if PS_ISA != 1
#error "qlinear_mxfp4.h is the AVX2 build only"
#endif

// The E2M1 codes, doubled.
alignas(16) inline constexpr int8_t kMxfp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128): half the block's E8M0 scale, exactly.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
void dq_mxfp4(const uint8_t* row, int64_t K, T* dst) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * 17;
    const float d = e8m0_half(blk[0]);
    for (int l = 0; l < 16; ++l) {
      put(dst, b * 32 + l, d * float(kMxfp4Doubled[blk[1 + l] & 0xF]));
      put(dst, b * 32 + 16 + l, d * float(kMxfp4Doubled[blk[1 + l] >> 4]));
    }
  }
}

// The format struct of qlinear_q8.h's tiles: block() gives the 32 doubled codes and 2^(e - 128).
struct MXFP4 {
  static constexpr int kUnit = 32, kBytes = 17, kBlocks = 1, kOffset = 0;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = false;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = e8m0_half(u[0]);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Doubled)));
    return _mm256_shuffle_epi8(lut, nibbles(u + 1));
  }
};
