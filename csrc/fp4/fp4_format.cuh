// Element formats of the FP4 path: E2M1 codes, E4M3 block scales, and their decodes.
//
// Rounding must agree bit for bit with sage_diffusers/reference/formats.py, so the encoders are
// written with explicit comparisons rather than hardware conversions whose tie and sign rules
// differ between architectures (sm_90 has no e2m1 conversion at all).
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace sage_fp4 {

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kTwoLevelRange = kE4M3Max * kE2M1Max;  // P~ / s1 spans [0, 2688]

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
__device__ __forceinline__ void decode8_half(uint32_t x, __half2 scale, uint32_t out[4]) {
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
    const uint32_t bits = mag | (sgn & 0x80008000u);
    __half2 h = *reinterpret_cast<const __half2*>(&bits);
    h = __hmul2(h, scale);
    out[i] = *reinterpret_cast<uint32_t*>(&h);
  }
}

// One E2M1 code as float (for the CUDA-core smoothing correction).
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t mag = code & 7u;
  const float v = mag < 2u ? 0.5f * static_cast<float>(mag) : __uint_as_float((mag + 252u) << 22);
  return (code & 8u) ? -v : v;
}

}  // namespace sage_fp4
