// Element formats of the FP4 path: E2M1 codes, E4M3 (NVFP4) and E8M0 (MXFP4) block scales, and
// their decodes.
//
// Rounding must agree bit for bit with sage_diffusers/reference/formats.py, so the encoders are
// written with explicit comparisons rather than hardware conversions whose tie and sign rules
// differ between architectures (sm_90 has no e2m1 conversion at all).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fp4_api.h"

namespace sage_fp4 {

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kTwoLevelRange = kE4M3Max * kE2M1Max;  // P~ / s1 spans [0, 2688]
// Smallest two-level factor s1 a tile keeps (reference: sage3.TWO_LEVEL_MIN_S1). Below it the
// tile's largest P~ is under 2688 * 2^-64 = 2^-52.6 of the row's running max: it cannot change the
// fp32 row sum (>= 1) and moves O by < 2^-45 of V's range, so it contributes 0. Above it 1 / s1 and
// the sm_90 wgmma path's O' = O / s1 stay far inside fp32 (an s1 near FLT_MIN made O' overflow
// there: NaN rows on sharp heads).
constexpr float kMinTwoLevelS1 = 0x1p-64f;

// E2M1 code of x: round to nearest, ties to the even code, saturate at +-6, sign from signbit
// (so -0.1 encodes as 0x8). Each comparison crosses one boundary between neighbouring codes:
// '>' where the tie rounds down to an even code, '>=' where it rounds up to one.
__device__ __forceinline__ uint32_t e2m1_code(float x) {
  const float a = fabsf(x);
  uint32_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
               (a >= 3.5f) + (a > 5.0f);
  return c | (__float_as_uint(x) >> 31 << 3);
}

// Same for x >= 0 (softmax probabilities): no sign bit to carry.
__device__ __forceinline__ uint32_t e2m1_code_nonneg(float a) {
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
         (a > 5.0f);
}

// Same rounding for 0 <= a (finite), in ~9 integer/FMA operations instead of 7 compare-selects
// (the main loop encodes 64 P~ values per thread per tile).
//   a <  1: code = rint(2a), via the 1.5 * 2^23 magic addend (ulp 1, ties to even: 0.25 -> 0,
//           0.75 -> 2 = value 1.0);
//   a >= 1: round the fp32 bits to one mantissa bit, ties to even (+0x1FFFFF + the kept lsb),
//           then code = (biased exponent << 1 | mantissa bit) - 252, saturated at 7.
__device__ __forceinline__ uint32_t e2m1_code_nonneg_fast(float a) {
  const uint32_t small = __float_as_uint(fmaf(a, 2.0f, 12582912.0f)) & 3u;
  const uint32_t u = __float_as_uint(a);
  const uint32_t big = min(((u + 0x1FFFFFu + ((u >> 22) & 1u)) >> 22) - 252u, 7u);
  return a < 1.0f ? small : big;
}

// cvt.rn.satfinite.e2m1x2.f32 exists on sm_120a/121a (ptxas rejects it for sm_90a). Build with
// -DSAGE_FP4_NO_HW_E2M1 (env SAGE_DIFFUSERS_FP4_NO_HW_E2M1=1) to use the integer path instead.
#if (defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)) && !defined(SAGE_FP4_NO_HW_E2M1)
#define SAGE_FP4_HW_E2M1 1
#endif

// 8 values >= 0 -> 8 packed E2M1 codes (element i in nibble i), same rounding as e2m1_code.
__device__ __forceinline__ uint32_t e2m1_pack8_nonneg(const float (&x)[8]) {
#ifdef SAGE_FP4_HW_E2M1
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t byte;
    // d = {cvt(a) in the high nibble, cvt(b) in the low nibble}: element 2i goes in as b.
    asm("{\n .reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n cvt.u32.u8 %0, t;\n}"
        : "=r"(byte) : "f"(x[2 * i + 1]), "f"(x[2 * i]));
    w |= byte << (8 * i);
  }
  return w;
#else
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= e2m1_code_nonneg_fast(x[i]) << (4 * i);
  return w;
#endif
}

// Two non-negative fp16 values (x in the low half) rounded to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3,
// 4, 6} as values, not codes: saturate at 6, then round to nearest even at the grid spacing of
// x's binade, 2^floor(log2(max(x, 1))) / 2, by adding and subtracting M = that spacing * 1024
// (fp16's ulp at M is the spacing; ties go to the even fp16 mantissa, i.e. the even E2M1 code).
// Equals decode(e2m1_code(x)) for every fp16 x >= 0; 6 ops per pair instead of two encodes and a
// decode. A NaN (0 * inf from a zero block scale) saturates to 6, which that zero scale cancels.
__device__ __forceinline__ uint32_t e2m1_round_half2(uint32_t x) {
  uint32_t r;
  asm("{\n .reg .b32 c, m;\n"
      " min.f16x2 c, %1, %2;\n"
      " max.f16x2 m, c, %3;\n"
      " and.b32 m, m, 0x7C007C00;\n"
      " add.u32 m, m, 0x24002400;\n"  // exponent + 9: spacing * 1024
      " add.rn.f16x2 c, c, m;\n"
      " sub.rn.f16x2 %0, c, m;\n}"
      : "=r"(r)
      : "r"(x), "r"(0x46004600u), "r"(0x3C003C00u));
  return r;
}

// Two fp32 values -> E4M3 bytes (b in the low byte, a in the high), round to nearest even,
// saturating (e4m3_byte for two), and those bytes -> fp16x2 (exact).
__device__ __forceinline__ uint32_t e4m3x2_half2(float a, float b) {
  uint32_t r;
  asm("{\n .reg .b16 e;\n"
      " cvt.rn.satfinite.e4m3x2.f32 e, %1, %2;\n"
      " cvt.rn.f16x2.e4m3x2 %0, e;\n}"
      : "=r"(r)
      : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// E4M3 byte of x, round to nearest even, saturating at +-448 (the reference clamps, then casts).
__device__ __forceinline__ uint32_t e4m3_byte(float x) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ __half e4m3_to_half(uint32_t byte) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte & 0xFF), __NV_E4M3);
  return __half(h);
}

__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
  return __half2float(e4m3_to_half(byte));  // every E4M3 value is exact in fp16
}

// Block scale of 16 values with absolute maximum `amax`: E4M3(amax / 6), as a byte and as the
// float the values are divided by.
struct BlockScale {
  uint32_t byte;
  float value;
};

__device__ __forceinline__ BlockScale nvfp4_scale(float amax) {
  const uint32_t b = e4m3_byte(__fdiv_rn(amax, kE2M1Max));
  return {b, e4m3_to_float(b)};
}

// E2M1 code of x / scale (true fp32 division, as the reference); a zero scale gives code 0.
__device__ __forceinline__ uint32_t nvfp4_code(float x, float scale) {
  return scale > 0.0f ? e2m1_code(__fdiv_rn(x, scale)) : 0u;
}

// fp16 bit patterns of the 8 E2M1 magnitudes have a zero low byte, so the high bytes
// {00, 38, 3C, 3E, 40, 42, 44, 46} form an 8-entry byte table that one PRMT indexes.
constexpr uint32_t kHalfLutLo = 0x3E3C3800u;
constexpr uint32_t kHalfLutHi = 0x46444240u;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Decode 8 packed E2M1 codes (element 2i in the low nibble of byte i... i.e. nibble j = element j)
// into 4 fp16x2 words (word i = elements 2i, 2i+1, low half first), each multiplied by `scale`.
// Exact: |code| * E4M3 needs at most 6 significant bits and lies in [2^-10, 2688].
// decode8_half_codes: the same without the scale (the E2M1 values themselves, exact).
__device__ __forceinline__ void decode8_half_codes(uint32_t x, uint32_t out[4]) {
  const uint32_t even_mag = (x << 4) & 0x70707070u;  // element 2i magnitude in bits 4-6 of byte i
  const uint32_t odd_mag = x & 0x70707070u;          // element 2i+1 magnitude, same place
  const uint32_t even_sign = (x << 4) & 0x80808080u;
  const uint32_t odd_sign = x & 0x80808080u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Selector nibbles {0, mag(2i), 0, mag(2i+1)}: table byte 0 (= 0x00) for the low bytes.
    const uint32_t sel = prmt(even_mag, odd_mag, static_cast<uint32_t>(i | ((4 + i) << 4)));
    const uint32_t mag = prmt(kHalfLutLo, kHalfLutHi, sel);
    const uint32_t sgn = prmt(even_sign, odd_sign, static_cast<uint32_t>((i << 4) | ((4 + i) << 12)));
    out[i] = mag | (sgn & 0x80008000u);
  }
}
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, __half2 scale) {
  __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&a), scale);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ void decode8_half(uint32_t x, __half2 scale, uint32_t out[4]) {
  decode8_half_codes(x, out);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = hmul2_bits(out[i], scale);
}

// ---- MXFP4: E8M0 block scales ----------------------------------------------------------------
// Biased exponent of the block scale for absolute maximum `amax` (reference.quantize_mxfp4):
// floor(log2(amax)) - 2 (E2M1's largest exponent), clamped to >= -127, biased by 127; 0 for a zero
// block. For normal amax floor(log2) is the biased fp32 exponent - 127, so the byte is that
// exponent - 2; a subnormal amax (exponent field 0) clamps to 0 like the reference. Range [0, 252].
__device__ __forceinline__ uint32_t e8m0_byte(float amax) {
  const int e = static_cast<int>(__float_as_uint(amax) >> 23) & 0xFF;  // amax >= 0
  return static_cast<uint32_t>(max(e - 2, 0));
}

// 1 / 2^(byte - 127) = 2^(127 - byte) as fp32, exact and normal for every byte in [0, 252]; x / scale
// and x * this reciprocal round the same exact quotient, so the codes match the reference's
// true division bit for bit.
__device__ __forceinline__ float e8m0_inverse(uint32_t byte) { return __uint_as_float((254u - byte) << 23); }

// 2^(byte - 127) as fp32 (byte 0 is the subnormal 2^-127), exact.
__device__ __forceinline__ float e8m0_to_float(uint32_t byte) {
  return byte ? __uint_as_float(byte << 23) : __uint_as_float(0x00400000u);
}

// The same scale as a bf16 pair for decode8_bf16. BF16 has fp32's exponent range, so 2^(byte - 127)
// is a normal bf16 for bytes 1..254. Byte 0 (2^-127, a bf16 subnormal) is encoded as 0: blocks with
// that scale have absmax < 2^-124 and are flushed to zero by the emulated atom (see mma_atoms.cuh).
__device__ __forceinline__ __nv_bfloat162 e8m0_bf16_pair(uint32_t byte) {
  const uint32_t b = (byte & 0xFFu) << 7;
  const uint32_t bits = b | (b << 16);
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}

// bf16 bit patterns of the 8 E2M1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} = {0000, 3F00, 3F80,
// 3FC0, 4000, 4040, 4080, 40C0}: unlike fp16 the low bytes are not all zero, so one PRMT table
// gives the high bytes and a second the low bytes (entry 0 is 00 in both).
constexpr uint32_t kBf16HiLutLo = 0x3F3F3F00u;
constexpr uint32_t kBf16HiLutHi = 0x40404040u;
constexpr uint32_t kBf16LoLutLo = 0xC0800000u;
constexpr uint32_t kBf16LoLutHi = 0xC0804000u;

// Decode 8 packed E2M1 codes into 4 bf16x2 words (word i = elements 2i, 2i+1, low half first),
// each multiplied by `scale` (an E8M0 power of two). Exact for every result in bf16's normal range,
// i.e. unless the block scale is 2^-127 (byte 0, encoded as 0 by e8m0_bf16_pair) or 2^-126 with
// code 0.5 (2^-127, a bf16 subnormal: exact if the multiply keeps subnormals, else 0).
// decode8_bf16_codes: the same without the scale (the E2M1 values themselves, exact).
__device__ __forceinline__ void decode8_bf16_codes(uint32_t x, uint32_t out[4]) {
  const uint32_t even_mag = (x << 4) & 0x70707070u;
  const uint32_t odd_mag = x & 0x70707070u;
  const uint32_t even_sign = (x << 4) & 0x80808080u;
  const uint32_t odd_sign = x & 0x80808080u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // sel nibbles {0, mag(2i), 0, mag(2i+1), 0...}: the high-byte table fills bytes 1 and 3;
    // sel >> 4 = {mag(2i), 0, mag(2i+1), 0}: the low-byte table fills bytes 0 and 2.
    const uint32_t sel = prmt(even_mag, odd_mag, static_cast<uint32_t>(i | ((4 + i) << 4)));
    const uint32_t hi = prmt(kBf16HiLutLo, kBf16HiLutHi, sel);
    const uint32_t lo = prmt(kBf16LoLutLo, kBf16LoLutHi, (sel >> 4) & 0xFFFFu);
    const uint32_t sgn = prmt(even_sign, odd_sign, static_cast<uint32_t>((i << 4) | ((4 + i) << 12)));
    out[i] = (hi & 0xFF00FF00u) | (lo & 0x00FF00FFu) | (sgn & 0x80008000u);
  }
}
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, __nv_bfloat162 scale) {
  __nv_bfloat162 h = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), scale);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ void decode8_bf16(uint32_t x, __nv_bfloat162 scale, uint32_t out[4]) {
  decode8_bf16_codes(x, out);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = hmul2_bits(out[i], scale);
}

// ---- one interface over both formats ----------------------------------------------------------
// Block scale of a block with absolute maximum `amax`: the stored byte and how values are divided
// by it. NVFP4 keeps the E4M3 value (true division or a rounded reciprocal, see fragment_quant.cuh);
// MXFP4 keeps the exact power-of-two reciprocal (so every division mode is exact).
template <Fp4Format F>
struct Fp4Scale;

template <>
struct Fp4Scale<Fp4Format::kNvfp4> {
  uint32_t byte;
  float value;
  __device__ __forceinline__ static Fp4Scale of(float amax) {
    const BlockScale s = nvfp4_scale(amax);
    return {s.byte, s.value};
  }
  __device__ __forceinline__ bool nonzero() const { return value > 0.0f; }
  __device__ __forceinline__ float exact_code_input(float x) const { return __fdiv_rn(x, value); }
  __device__ __forceinline__ float reciprocal() const { return value > 0.0f ? __frcp_rn(value) : 0.0f; }
};

template <>
struct Fp4Scale<Fp4Format::kMxfp4> {
  uint32_t byte;
  float inv;   // 2^(127 - byte)
  bool any;    // amax > 0: a zero block keeps byte 0 and all-zero codes (never -0)
  __device__ __forceinline__ static Fp4Scale of(float amax) {
    const uint32_t b = e8m0_byte(amax);
    return {b, e8m0_inverse(b), amax > 0.0f};
  }
  __device__ __forceinline__ bool nonzero() const { return any; }
  __device__ __forceinline__ float exact_code_input(float x) const { return x * inv; }  // exact
  __device__ __forceinline__ float reciprocal() const { return any ? inv : 0.0f; }
};

// Scale byte -> float (the CUDA-core smoothing correction).
template <Fp4Format F>
__device__ __forceinline__ float scale_byte_to_float(uint32_t byte) {
  if constexpr (F == Fp4Format::kNvfp4) {
    return e4m3_to_float(byte);
  } else {
    return e8m0_to_float(byte);
  }
}

// One E2M1 code as float (for the CUDA-core smoothing correction).
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t mag = code & 7u;
  const float v = mag < 2u ? 0.5f * static_cast<float>(mag) : __uint_as_float((mag + 252u) << 22);
  return (code & 8u) ? -v : v;
}

}  // namespace sage_fp4
