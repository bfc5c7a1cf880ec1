// Device side of the non-finite record (nonfinite.h): absmaxes that ignore non-finite values,
// the pre-pass's record and the epilogue's write-back.
#pragma once

#include <cmath>

#include <math_constants.h>

#include "nonfinite.h"

namespace sage_common {

// |x| for finite x, 0 for NaN and +-Inf: every absmax looks only at finite values (numerics
// contract), so one NaN / Inf cannot change the scale of the finite values beside it.
__device__ __forceinline__ float finite_abs(float x) {
  const float a = fabsf(x);
  return a < INFINITY ? a : 0.f;  // NaN compares false
}

// x for finite x, 0 for NaN and +-Inf: quantization inputs whose non-finite values are recorded
// (or, for Q, flagged per row) elsewhere.
__device__ __forceinline__ float finite_or_zero(float x) { return fabsf(x) < INFINITY ? x : 0.0f; }

// v_first: the (kCount, D) slice of one (b, kv head); records key `key` for element value x.
__device__ __forceinline__ void record_nonfinite(int* v_first, int D, int c, int key, float x) {
  const NonFinite kind = x != x ? NonFinite::kNaN : (x > 0.f ? NonFinite::kPosInf : NonFinite::kNegInf);
  atomicMin(v_first + static_cast<int>(kind) * D + c, key);
}

// Output value of channel c for a row that sees keys <= `last_key` (x when no non-finite V element
// reaches it): NaN where a NaN or both infinities meet, else the infinity.
// kInfFromBits: +inf written as its bit pattern (CUDART_INF_F) instead of the INFINITY literal.
// The value is the same; the spelling steers where NVVM folds the constant, and each kernel keeps
// the one its measured SASS was built with (8-bit: literal, FP4: bits). Using one spelling for
// both reschedules the other kernel's whole epilogue and main loop (same registers, different
// SASS), which would need re-timing.
template <bool kInfFromBits = false>
__device__ __forceinline__ float apply_nonfinite(const int* v_first, int D, int c, int last_key, float x) {
  const bool pos = v_first[static_cast<int>(NonFinite::kPosInf) * D + c] <= last_key;
  const bool neg = v_first[static_cast<int>(NonFinite::kNegInf) * D + c] <= last_key;
  const bool nan = v_first[static_cast<int>(NonFinite::kNaN) * D + c] <= last_key;
  if (nan || (pos && neg)) return __int_as_float(0x7fffffff);
  if constexpr (kInfFromBits) {
    return pos ? CUDART_INF_F : (neg ? -CUDART_INF_F : x);
  } else {
    return pos ? INFINITY : (neg ? -INFINITY : x);
  }
}

}  // namespace sage_common
