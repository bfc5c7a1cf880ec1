// Scalar numerics of the 8-bit kernel shared by its pre-pass and attention kernel: FP8/INT8
// rounding exactly as the sage8 spec states and the 16-bit element types per DType. exp2, the
// non-finite record and the fp16/bf16 conversions themselves are the shared ones (csrc/common/).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/nonfinite.cuh"
#include "../common/numeric_conversion.cuh"
#include "../common/softmax_utils.cuh"
#include "launch.h"
#include "tile_config.hpp"

namespace sage_sm90 {

using sage_common::apply_nonfinite;
using sage_common::exp2_mufu;
using sage_common::exp2_poly;
using sage_common::finite_abs;
using sage_common::kNoKey;
using sage_common::NonFinite;
using sage_common::record_nonfinite;

// Two fp32 -> two E4M3 (RNE, saturate to +-448), `lo` in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  // cvt packs its first source into the upper byte and its second into the lower one.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// INT8 code of a quotient x / s: round half to even, clamp to +-127 (NaN -> 0).
__device__ __forceinline__ int int8_code(float quotient) {
  const int q = __float2int_rn(quotient);
  return max(-127, min(127, q));
}

// INT8 code of x / s: fp32 true division (IEEE, no fast-math), round half to even, clamp to
// +-127; scale 0 (all-zero row/block) gives 0.
__device__ __forceinline__ int quant_int8(float x, float s) {
  if (s == 0.f) return 0;
  return int8_code(x / s);
}

// x / s for many x and one scale s >= 0, bit for bit the IEEE quotient of `x / s` (pre-pass mode
// kPrepassFastDiv). nvcc's div.rn.f32 is, per element, a reciprocal approximation (MUFU.RCP), one
// Newton step of it, then q0 = x r, e = fma(-s, q0, x), q = fma(r, e, q0), with FCHK choosing a
// slow path for operands near the exponent range's ends. The reciprocal and its Newton step depend
// on s alone, so they are computed once here; approx() runs the same three roundings per element.
// exact_for(x) says approx(x) is the IEEE quotient: s and |x| in [2^-60, 2^60), far inside the
// fast path's range (no step overflows or goes subnormal), or x = +-0 (quotient +-0: the sign is
// x's). Elsewhere (subnormals, Inf, NaN) the caller divides. s == 0 counts as exact: every caller
// replaces the quotients of a zero scale by code 0 (quant_int8, quant_e4m3x2).
struct ScaleDivider {
  float s;
  float r;    // the Newton-refined reciprocal of s, as div.rn.f32 computes it
  bool fast;  // s inside the safe range, or 0

  ScaleDivider() = default;  // (arrays: every element is assigned a divider before use)
  __device__ __forceinline__ explicit ScaleDivider(float scale) : s(scale) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(scale));
    r = __fmaf_rn(r0, __fmaf_rn(-scale, r0, 1.f), r0);
    fast = in_range(scale) || scale == 0.f;
  }
  // |v| in [2^-60, 2^60): finite, nonzero, normal (NaN fails both compares).
  static __device__ __forceinline__ bool in_range(float v) {
    const float a = fabsf(v);
    return a >= 0x1p-60f && a < 0x1p60f;
  }
  __device__ __forceinline__ bool exact_for(float x) const { return fast && (in_range(x) || x == 0.f); }
  __device__ __forceinline__ float approx(float x) const {
    const float q0 = __fmul_rn(x, r);
    return copysignf(__fmaf_rn(r, __fmaf_rn(-s, q0, x), q0), x);  // copysign: -0 / s = -0
  }
};

// Codes of eight elements x[i] / s (s: one float, or its ScaleDivider: pre-pass mode
// kPrepassFastDiv, the forward kernel's in-kernel Q). Per element as quant_int8 / quant_e4m3x2;
// with a ScaleDivider the same quotients from the reciprocal, and the real division only when one
// of the eight operands is outside its exact range (one rarely taken branch per eight elements
// instead of a division each).
// INT8 codes of x[i] / s, 0 where !keep (quant_int8).
__device__ __forceinline__ void int8_codes8(const float (&x)[8], float s, bool keep, int (&qi)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) qi[i] = keep ? quant_int8(x[i], s) : 0;
}
__device__ __forceinline__ void int8_codes8(const float (&x)[8], const ScaleDivider& d, bool keep, int (&qi)[8]) {
  float q[8];
  bool exact = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = d.approx(x[i]);
    exact &= d.exact_for(x[i]);
  }
  if (!exact) {
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = x[i] / d.s;
  }
  keep = keep && d.s != 0.f;  // scale 0: code 0 (quant_int8)
#pragma unroll
  for (int i = 0; i < 8; ++i) qi[i] = keep ? int8_code(q[i]) : 0;
}
// E4M3 codes of x[i] / d[i].s (per-channel scales), two per word, element 2j in the low byte of
// word j (quant_e4m3x2 of the quotients).
__device__ __forceinline__ void e4m3_codes8(const float (&x)[8], const ScaleDivider (&d)[8], uint32_t (&two)[4]) {
  float q[8];
  bool exact = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = d[i].approx(x[i]);
    exact &= d[i].exact_for(x[i]);
  }
  if (!exact) {
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = x[i] / d[i].s;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    two[j] = pack_e4m3x2(d[2 * j].s == 0.f ? 0.f : q[2 * j], d[2 * j + 1].s == 0.f ? 0.f : q[2 * j + 1]);
  }
}

// Per-token INT8 quantization of one Q row (sage8: scale = max finite |x| / 127), the pre-pass's
// (prepass.cuh quant_q_block; the forward kernel's in-kernel Q of FwdOptions::q_in_kernel, deleted,
// shared it). Each lane adds its
// part of the row, reduce() combines kWidth consecutive lanes; the max is exact in any order and
// `bad` only tells whether the row holds a non-finite element, so the lane split does not matter.
struct QRowQuant {
  float amax = 0.f;
  float bad = 0.f;  // the sum of x * 0: NaN exactly when the row holds a NaN or Inf

  __device__ __forceinline__ void add(float x) {
    amax = fmaxf(amax, finite_abs(x));
    bad += x * 0.f;
  }
  // Butterfly over kWidth consecutive lanes (all 32 lanes take part): every lane gets the row's.
  template <int kWidth>
  __device__ __forceinline__ void reduce() {
#pragma unroll
    for (int o = kWidth / 2; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      bad += __shfl_xor_sync(0xffffffffu, bad, o);
    }
  }
  // The codes' scale: quant_int8(x, scale()) (NaN -> 0, +-Inf -> +-127).
  __device__ __forceinline__ float scale() const { return amax / kInt8Max; }
  // The row's stored scale sq: NaN for a row with a non-finite element (the epilogue's "this row
  // is NaN"; its codes use the finite absmax, as the reference's), else scale().
  __device__ __forceinline__ float stored_scale() const { return isnan(bad) ? bad : scale(); }
};

// E4M3 codes of x0 / s, x1 / s (fp32 true division, RNE, satfinite), x0 in the low byte.
__device__ __forceinline__ uint32_t quant_e4m3x2(float x0, float x1, float s0, float s1) {
  const float a = s0 == 0.f ? 0.f : x0 / s0;
  const float b = s1 == 0.f ? 0.f : x1 / s1;
  return pack_e4m3x2(a, b);
}

// 16-bit input/output element type of a DType: the shared conversions (Elem16) plus the type.
template <DType kDType>
struct IO;
template <>
struct IO<DType::kF16> : sage_common::Elem16<__half> {
  using T = __half;
};
template <>
struct IO<DType::kBF16> : sage_common::Elem16<__nv_bfloat16> {
  using T = __nv_bfloat16;
};

// Eight 16-bit elements as fp32 (common/numeric_conversion.cuh), by the kernel's dtype tag.
template <DType kDType>
__device__ __forceinline__ void raw_to_float8(const uint4& raw, float (&x)[8]) {
  sage_common::unpack8_float<typename IO<kDType>::T>(raw, x);
}
template <DType kDType>
__device__ __forceinline__ void load8(const void* ptr, float (&x)[8]) {
  sage_common::load8_float<typename IO<kDType>::T>(ptr, x);
}

}  // namespace sage_sm90
