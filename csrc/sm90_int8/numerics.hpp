// Scalar numerics shared by the pre-pass and the attention kernel: exp2 variants, FP8/INT8
// rounding exactly as the sage8 spec states, and 16-bit input/output conversions.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch.h"

namespace sage_sm90 {

// exp2 on the MUFU unit (16 results/clk/SM on sm_90); ex2.approx(-inf) = +0.
__device__ __forceinline__ float exp2_mufu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp2 on the FMA pipes for x <= 0 (as FlashAttention-4 does to relieve MUFU at hd64):
// Cody-Waite split x = j + f with j = floor(x), f in [0, 1); 2^f from a degree-3 polynomial
// (relative error < 1e-4, far below the 2^-4 step of the E4M3 code P~ is rounded to next);
// 2^j added to the exponent field. floor comes from adding 1.5*2^23 with rounding toward -inf,
// which keeps everything off the conversion units. Results below 2^-126 flush to 0 like ftz.
__device__ __forceinline__ float exp2_poly(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  constexpr float kC1 = 0.69507056f, kC2 = 0.22765099f, kC3 = 0.07714326f;
  const float xc = fmaxf(x, -127.f);  // also maps -inf to a finite value
  const float tm = __fadd_rd(xc, kMagic);
  const float j = tm - kMagic;         // floor(xc), exact
  const float f = xc - j;              // exact, in [0, 1)
  const float p = fmaf(fmaf(fmaf(kC3, f, kC2), f, kC1), f, 1.f);
  const int e = __float_as_int(tm) - __float_as_int(kMagic);  // floor(xc) as int
  const float r = __int_as_float(__float_as_int(p) + static_cast<int>(static_cast<unsigned>(e) << 23));
  return xc < -126.f ? 0.f : r;
}

// |x| for finite x, 0 for NaN and +-Inf: every absmax of the pre-pass looks only at finite values
// (numerics contract), so one NaN / Inf cannot change the scale of the finite values beside it.
__device__ __forceinline__ float finite_abs(float x) {
  const float a = fabsf(x);
  return a < INFINITY ? a : 0.f;  // NaN compares false
}

// Non-finite values of V cannot pass through FP8 (no Inf; P~ x NaN would reach masked rows too):
// the pre-pass quantizes them as 0 and records, per (b, kv head) and channel, the first attended
// key holding +Inf, -Inf and NaN (atomicMin: the same result in any order); the epilogue writes
// them over the output rows that see that key, as exact attention would.
enum class NonFinite : int { kPosInf = 0, kNegInf = 1, kNaN = 2, kCount = 3 };
constexpr int kNoKey = 0x7f7f7f7f;  // "no such key": the byte pattern of the workspace memset

// v_first: the (kCount, D) slice of one (b, kv head); records key `key` for element value x.
__device__ __forceinline__ void record_nonfinite(int* v_first, int D, int c, int key, float x) {
  const NonFinite kind = x != x ? NonFinite::kNaN : (x > 0.f ? NonFinite::kPosInf : NonFinite::kNegInf);
  atomicMin(v_first + static_cast<int>(kind) * D + c, key);
}

// Output value of channel c for a row that sees keys <= `last_key` (x when no non-finite V element
// reaches it): NaN where a NaN or both infinities meet, else the infinity.
__device__ __forceinline__ float apply_nonfinite(const int* v_first, int D, int c, int last_key, float x) {
  const bool pos = v_first[static_cast<int>(NonFinite::kPosInf) * D + c] <= last_key;
  const bool neg = v_first[static_cast<int>(NonFinite::kNegInf) * D + c] <= last_key;
  const bool nan = v_first[static_cast<int>(NonFinite::kNaN) * D + c] <= last_key;
  if (nan || (pos && neg)) return __int_as_float(0x7fffffff);
  return pos ? INFINITY : (neg ? -INFINITY : x);
}

// Two fp32 -> two E4M3 (RNE, saturate to +-448), `lo` in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  // cvt packs its first source into the upper byte and its second into the lower one.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// INT8 code of x / s: fp32 true division (IEEE, no fast-math), round half to even, clamp to
// +-127; scale 0 (all-zero row/block) gives 0.
__device__ __forceinline__ int quant_int8(float x, float s) {
  if (s == 0.f) return 0;
  const int q = __float2int_rn(x / s);
  return max(-127, min(127, q));
}

// E4M3 codes of x0 / s, x1 / s (fp32 true division, RNE, satfinite), x0 in the low byte.
__device__ __forceinline__ uint32_t quant_e4m3x2(float x0, float x1, float s0, float s1) {
  const float a = s0 == 0.f ? 0.f : x0 / s0;
  const float b = s1 == 0.f ? 0.f : x1 / s1;
  return pack_e4m3x2(a, b);
}

// 16-bit input/output element types.
template <DType kDType>
struct IO;
template <>
struct IO<DType::kF16> {
  using T = __half;
  using T2 = __half2;
  __device__ __forceinline__ static float2 to_float2(uint32_t bits) {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = bits;
    return __half22float2(h);
  }
  __device__ __forceinline__ static uint32_t from_float2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct IO<DType::kBF16> {
  using T = __nv_bfloat16;
  using T2 = __nv_bfloat162;
  __device__ __forceinline__ static float2 to_float2(uint32_t bits) {
    __nv_bfloat162 h;
    *reinterpret_cast<uint32_t*>(&h) = bits;
    return __bfloat1622float2(h);
  }
  __device__ __forceinline__ static uint32_t from_float2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Eight 16-bit elements (one 16-byte word) as fp32.
template <DType kDType>
__device__ __forceinline__ void raw_to_float8(const uint4& raw, float (&x)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = IO<kDType>::to_float2(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Eight consecutive 16-bit elements (one 16-byte load) as fp32.
template <DType kDType>
__device__ __forceinline__ void load8(const void* ptr, float (&x)[8]) {
  raw_to_float8<kDType>(__ldg(reinterpret_cast<const uint4*>(ptr)), x);
}

}  // namespace sage_sm90
