// The block routines of the DOT8 formats of qformats.h: one struct per format, named as its table
// row, that every kernel reads the format through (the 8-bit kernel of qlinear_q8.h, the GEMMs of
// qlinear_q8_gemm.h / qlinear_vnni.h / qlinear_bcast.h / AMX, the row dequantizers). Included
// once by qlinear_impl.h in its AVX2 build (PS_ISA == 1, namespace isa_avx2), after `load_u16`,
// `put` and `half_to_float`; the other ISA levels use these through `::isa_avx2::`.
//
// A unit is what a row is made of (one block of 32 values, or a K-quant super-block of 8 x 32).
// A format struct F has:
//   kUnit, kBytes     values and bytes per unit (the table's block and bytes; checked below);
//   kBlocks           blocks of 32 per unit (kUnit / 32);
//   kOffset           values are stored as q + kOffset unsigned (Q4_0: 8, Q5_0: 16), else 0;
//   kUnsigned         block() returns unsigned bytes (multiplied as stored), else signed int8;
//   kMins             value = d * q - mins[t] (the K-quants, Q4_1: `Head::mins`, 8 lanes);
//   kMul16            Q6_K: one int16 multiplier per 16 values (block()'s `mul`);
//   kMaxQ             the largest |value| block() returns (less the offset): it sizes the GEMM's
//                     int16 sums (qlinear_q8_gemm.h);
//   Head head(u)      a unit's scales, read once per tile;
//   block(h, u, t, &dw, &mul)  the 32 values of block t of the unit as int8 / uint8, their fp32
//                     scale dw, and (kMul16) the int16 multipliers of its two halves.
// value = dw * (q - kOffset) [* mul] [- mins[t]], exactly what `dq_blocks` writes.

#if PS_ISA != 1
#error "qlinear_blocks.h is the AVX2 build only"
#endif

// 32 bits -> 32 bytes: 0xFF where the bit is set (llama.cpp's bytes_from_bits_32).
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

// 16 bytes of nibble pairs -> 32 bytes: the low nibbles, then the high nibbles (ggml's order).
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0xF));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0xF));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// fp16 block scale -> fp32 (F16C; exact, as half_to_float).
inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// ---------------------------------------------------------------------------------------------
// ggml's blocks (ggml-common.h layouts)
// ---------------------------------------------------------------------------------------------

struct Q8_0 {
  static constexpr int kUnit = 32, kBytes = 34, kBlocks = 1, kOffset = 0, kMaxQ = 128;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = false;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 2));
  }
};

struct Q4_0 {  // value = d * (q - 8): block() returns q, the kernel subtracts 8 * sum(qx)
  static constexpr int kUnit = 32, kBytes = 18, kBlocks = 1, kOffset = 8, kMaxQ = 15;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = true;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    return nibbles(u + 2);
  }
};

struct Q5_0 {  // value = d * (q - 16): block() returns q, the kernel subtracts 16 * sum(qx)
  static constexpr int kUnit = 32, kBytes = 22, kBlocks = 1, kOffset = 16, kMaxQ = 31;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = true;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    uint32_t qh;
    std::memcpy(&qh, u + 2, 4);
    const __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles(u + 6), hb);
  }
};

// Q4_1: value = d * q + m, q the unsigned nibble: Q4_0's layout with a per-block min m (an fp16
// after d). The min is carried as the K-quants' mins are (kMins: value = d * q - mins[t]), with
// mins = -m in lane 0 (one block per unit; the other lanes zero).
struct Q4_1 {
  static constexpr int kUnit = 32, kBytes = 20, kBlocks = 1, kOffset = 0, kMaxQ = 15;
  static constexpr bool kMins = true, kMul16 = false, kUnsigned = true;
  struct Head {
    __m256 mins;
  };
  static Head head(const uint8_t* u) { return {_mm256_setr_ps(-h2f(u + 2), 0, 0, 0, 0, 0, 0, 0)}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = h2f(u);
    return nibbles(u + 4);
  }
};

// Q4_K / Q5_K: value = d * sc[t] * q - dmin * mn[t] for the 8 blocks t of a super-block.
struct KHead {
  float dsc[8];  // d * sc[t]
  __m256 mins;   // dmin * mn[t]
};

inline KHead k4_head(const uint8_t* u) {
  // The 8 (scale, min) pairs of 6 bits packed in 12 bytes (ggml's get_scale_min_k4: sc[j] = q[j] & 63,
  // mn[j] = q[j + 4] & 63 for j < 4; sc[j] = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4, mn[j] =
  // (q[j + 4] >> 4) | (q[j] >> 6) << 4 above), four bytes at a time in 32-bit words
  uint32_t q[3];
  std::memcpy(q, u + 4, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const uint64_t sc = uint64_t(q[0] & m6) | uint64_t((q[2] & m4) | (((q[0] >> 6) & m2) << 4)) << 32;
  const uint64_t mn = uint64_t(q[1] & m6) | uint64_t(((q[2] >> 4) & m4) | (((q[1] >> 6) & m2) << 4)) << 32;
  KHead h;
  const __m256 d = _mm256_set1_ps(h2f(u)), dmin = _mm256_set1_ps(h2f(u + 2));
  _mm256_storeu_ps(h.dsc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc)))), d));
  h.mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn)))), dmin);
  return h;
}

// Block t of 32 nibbles: qs[32 (t / 2) + l], low nibbles for even t, high for odd.
inline __m256i k4_nibbles(const uint8_t* qs, int t) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (t / 2)));
  return _mm256_and_si256(t & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
}

struct Q4_K {
  static constexpr int kUnit = 256, kBytes = 144, kBlocks = 8, kOffset = 0, kMaxQ = 15;
  static constexpr bool kMins = true, kMul16 = false, kUnsigned = true;
  using Head = KHead;
  static Head head(const uint8_t* u) { return k4_head(u); }
  static __m256i block(const Head& h, const uint8_t* u, int t, float* dw, __m256i*) {
    *dw = h.dsc[t];
    return k4_nibbles(u + 16, t);
  }
};

struct Q5_K {
  static constexpr int kUnit = 256, kBytes = 176, kBlocks = 8, kOffset = 0, kMaxQ = 31;
  static constexpr bool kMins = true, kMul16 = false, kUnsigned = true;
  using Head = KHead;
  static Head head(const uint8_t* u) { return k4_head(u); }
  static __m256i block(const Head& h, const uint8_t* u, int t, float* dw, __m256i*) {
    *dw = h.dsc[t];
    // the fifth bit of value l is bit t of qh[l]
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, t), _mm256_set1_epi8(1));
    return _mm256_or_si256(k4_nibbles(u + 48, t), _mm256_slli_epi16(bit, 4));
  }
};

// Q6_K: value = d * sc[i] * (q - 32), one int8 scale sc per 16 values. Block t = 4 h + j of the
// super-block: ql[64 h + 32 (j & 1) + l] (low nibble for j < 2, high otherwise) and bits
// 2 j, 2 j + 1 of qh[32 h + l]; its scales are sc[2 t] (l < 16) and sc[2 t + 1].
struct Q6_K {
  static constexpr int kUnit = 256, kBytes = 210, kBlocks = 8, kOffset = 0, kMaxQ = 32;
  static constexpr bool kMins = false, kMul16 = true, kUnsigned = false;
  struct Head {
    float d;
  };
  static Head head(const uint8_t* u) { return {h2f(u + 208)}; }
  static __m256i block(const Head& h, const uint8_t* u, int t, float* dw, __m256i* mul) {
    *dw = h.d;
    const int hh = t / 4, j = t % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * hh + 32 * (j & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 128 + 32 * hh));
    const __m256i lo = _mm256_and_si256(j < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), _mm256_set1_epi8(3));
    const int8_t* sc = reinterpret_cast<const int8_t*>(u + 192);
    if (mul)
      *mul = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(sc[2 * t])),
                                     _mm_set1_epi16(sc[2 * t + 1]), 1);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
};

// MXFP4 (OCP microscaling FP4; gpt-oss's experts, GGUF type MXFP4). A block of 32 values takes
// 17 bytes, as ggml's block_mxfp4: one E8M0 scale byte e, then 16 bytes of 4-bit E2M1 codes,
// qs[j]'s low nibble value j and its high nibble value j + 16 (ggml's order, as Q4_0). value =
// fp4(code) * 2^(e - 127), fp4 = 0, .5, 1, 1.5, 2, 3, 4, 6 (code & 7), negative for code & 8. The
// codes are held doubled as int8 (0, 1, 2, 3, 4, 6, 8, 12: exact, |q| <= 12, signed like Q8_0's
// values) and the scale halved: 2^(e - 128), exact for every e (subnormal for e < 2, as ggml's
// GGML_E8M0_TO_FP32_HALF). So the 8-bit kernel's integer block products are exact, and the
// block's product is one fp32 FMA with dw * dx, as for Q8_0. Its table row takes no GEMM (the
// 8-bit kernel at every row count).
alignas(16) inline constexpr int8_t kMxfp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128): half the block's E8M0 scale, exactly.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Mxfp4 {
  static constexpr int kUnit = 32, kBytes = 17, kBlocks = 1, kOffset = 0, kMaxQ = 12;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = false;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = e8m0_half(u[0]);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Doubled)));
    return _mm256_shuffle_epi8(lut, nibbles(u + 1));
  }
};

// ---------------------------------------------------------------------------------------------
// HF checkpoints' group-wise integer weights (AWQ, GPTQ, compressed-tensors: layers/hf_quant.py
// repacks them losslessly into these blocks of 32 along K; a block never straddles two groups)
// ---------------------------------------------------------------------------------------------

// Q4_Z: 4-bit codes with an integer zero point, value = d * (q - z): d fp32 (bytes 0-3: holds the
// checkpoints' fp16 and bf16 scales exactly), z (byte 4, 0..16: GPTQ's old checkpoints store
// z - 1), then 16 bytes of nibbles in ggml's order (low nibbles values 0-15, high 16-31). block()
// returns q - z as signed int8 (|q - z| <= 16), multiplied as Q8_0's values are.
struct Q4_Z {
  static constexpr int kUnit = 32, kBytes = 21, kBlocks = 1, kOffset = 0, kMaxQ = 16;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = false;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = load_f32(u);
    return _mm256_sub_epi8(nibbles(u + 5), _mm256_set1_epi8(char(u[4])));
  }
};

// Q8_F: int8 values with an fp32 scale per 32 (Q8_0 with an fp32 d: bf16 and fp16 scales kept
// exactly): d (bytes 0-3), then 32 int8.
struct Q8_F {
  static constexpr int kUnit = 32, kBytes = 36, kBlocks = 1, kOffset = 0, kMaxQ = 128;
  static constexpr bool kMins = false, kMul16 = false, kUnsigned = false;
  struct Head {};
  static Head head(const uint8_t*) { return {}; }
  static __m256i block(const Head&, const uint8_t* u, int, float* dw, __m256i*) {
    *dw = load_f32(u);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 4));
  }
};

// ---------------------------------------------------------------------------------------------
// DENSE formats' row loops (`dq_<Name>`: a row of K values -> dst, fp32 or bf16 via `put`)
// ---------------------------------------------------------------------------------------------

// OCP FP8 E4M3 (float8_e4m3fn) -> fp32, exactly: (8 + m) * 2^(e - 10) for e >= 1, m * 2^-9 for
// e == 0, NaN for S.1111.111 (no infinities).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xF, m = b & 7;
  uint32_t bits;
  if (e == 15 && m == 7) {
    bits = 0x7FC00000u;
  } else if (e) {  // fp32 exponent e - 7 + 127, the 3 mantissa bits on top
    bits = ((e + 120) << 23) | (m << 20);
  } else {  // subnormal: m / 512, exact
    const float v = float(m) * 0.001953125f;
    std::memcpy(&bits, &v, 4);
  }
  bits |= uint32_t(b & 0x80) << 24;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// F8_E4M3: FP8 checkpoints' block-scaled weights (DeepSeek V3's, Qwen3's: a float32
// weight_scale_inv per 128 x 128 tile, layers.hf_quant): per block of 32 values an fp32 scale d
// (bytes 0-3: the tile's), then 32 E4M3 bytes; value = d * e4m3. DENSE: x multiplied as it is
// with the rows dequantized (the values are not integers times one scale: no 8-bit product).
// NOTE: why not the DOT8 kernels: a block's values are (8 + m) * 2^(e - 10) with 16 exponents;
// as int8 times one block scale they fit only when the block's exponents span at most 3
// (15 * 2^3 = 120 <= 127), and real FP8 tiles span more, so an int8 form would round weights the
// checkpoint stores exactly. E4M3 -> bf16 is exact (3 mantissa bits in 7), so the bf16 kernels
// (vdpbf16ps, AMX tiles) multiply the stored values themselves.
template <typename T>
void dq_F8_E4M3(const uint8_t* row, int64_t K, T* dst) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * 36;
    const float d = load_f32(blk);
    for (int l = 0; l < 32; ++l) put(dst, b * 32 + l, d * e4m3_to_float(blk[4 + l]));
  }
}

// ---------------------------------------------------------------------------------------------
// Generated from the table: the checks of each struct against its row, and the dispatch.
// ---------------------------------------------------------------------------------------------

#define PS_FMT_CHECK_DENSE(Name, block, bytes)
#define PS_FMT_CHECK_DOT8(Name, block, bytes)                                                     \
  static_assert(Name::kUnit == block && Name::kBytes == bytes && Name::kBlocks * 32 == block, \
                #Name ": the block struct disagrees with its row of qformats.h");
#define PS_FMT_CHECK(Name, code, block, bytes, head, kernel, gemm, ggml) PS_FMT_CHECK_##kernel(Name, block, bytes)
PS_QFORMATS(PS_FMT_CHECK)
#undef PS_FMT_CHECK
#undef PS_FMT_CHECK_DOT8
#undef PS_FMT_CHECK_DENSE

template <class F>
struct FmtTag {
  using type = F;
};

// fn(FmtTag<F>{}) for the block struct F of DOT8 format fmt; false (fn not called) for any other
// format. Callers at other ISA levels pass their own lambdas (a call, not inlined across the
// target change: once per row or range, never per block).
template <class Fn>
inline bool visit_dot8(int64_t fmt, Fn&& fn) {
#define PS_FMT_CALL_DENSE(Name) break
#define PS_FMT_CALL_DOT8(Name) \
  fn(FmtTag<Name>{});          \
  return true
  switch (fmt) { PS_QFORMATS(PS_FMT_CASE) }
#undef PS_FMT_CALL_DOT8
#undef PS_FMT_CALL_DENSE
  return false;
}

// The offset a format stores its values with (Q4_0: q + 8, Q5_0: q + 16), which the quantized x
// carries sums for; 0 for the others.
inline int q8_offset(int64_t fmt) {
  int offset = 0;
  visit_dot8(fmt, [&](auto f) { offset = decltype(f)::type::kOffset; });
  return offset;
}

// One row (K values) of DOT8 blocks F -> dst (fp32 or bf16 via `put`): dw * (q - kOffset) (Q6_K:
// (dw * sc) * q), less mins[t] (the K-quants, Q4_1). NOTE: exactly ggml's dequantize_row_*
// operations, in fp32: the embedding lookups' rows are the checkpoint's values.
template <class F, typename T>
void dq_blocks(const uint8_t* row, int64_t K, T* dst) {
  alignas(32) int8_t q[32];
  for (int64_t u = 0; u < K / F::kUnit; ++u) {
    const uint8_t* wu = row + u * F::kBytes;
    const typename F::Head h = F::head(wu);
    alignas(32) float mins[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if constexpr (F::kMins) _mm256_store_ps(mins, h.mins);
    for (int t = 0; t < F::kBlocks; ++t) {
      float d;
      __m256i mul = _mm256_setzero_si256();
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), F::block(h, wu, t, &d, &mul));
      T* y = dst + u * F::kUnit + t * 32;
      if constexpr (F::kMul16) {
        const float d0 = d * float(int16_t(_mm256_extract_epi16(mul, 0)));
        const float d1 = d * float(int16_t(_mm256_extract_epi16(mul, 8)));
        for (int l = 0; l < 32; ++l) put(y, l, (l < 16 ? d0 : d1) * float(q[l]));
      } else {
        for (int l = 0; l < 32; ++l) {
          const int v = F::kUnsigned ? int(uint8_t(q[l])) : int(q[l]);
          float f = d * float(v - F::kOffset);
          if constexpr (F::kMins) f = f - mins[t];
          put(y, l, f);
        }
      }
    }
  }
}
