// 16-bit input/output element types (fp16, bf16) <-> fp32, shared by every kernel.
// Only the conversion intrinsics are used (no half operators), so this compiles both with torch's
// default -D__CUDA_NO_HALF_OPERATORS__ family (the FP4 build) and without it (the 8-bit build).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sage_common {

template <typename T>
struct Elem16;

template <>
struct Elem16<__half> {
  using T2 = __half2;
  static constexpr float kMaxFinite = 65504.0f;
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  // Two fp32 (round to nearest even) -> one 32-bit word, `a` in the low half.
  __device__ __forceinline__ static uint32_t pack2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 unpack2(uint32_t bits) {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = bits;
    return __half22float2(h);
  }
};

template <>
struct Elem16<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr float kMaxFinite = 3.38953139e38f;  // 0x7f7f
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static uint32_t pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 unpack2(uint32_t bits) {
    __nv_bfloat162 h;
    *reinterpret_cast<uint32_t*>(&h) = bits;
    return __bfloat1622float2(h);
  }
};

// x clamped to T's finite range, NaN kept. Quantized operands can put a weighted average of V a few
// percent beyond V's largest element (a block scale rounded up); near the top of fp16's range that
// would round to infinity where exact attention, bounded by max |V|, stays finite.
template <typename T>
__device__ __forceinline__ float saturate_finite(float x) {
  return fabsf(x) > Elem16<T>::kMaxFinite ? copysignf(Elem16<T>::kMaxFinite, x) : x;
}

// Eight 16-bit elements (one 16-byte word) as fp32; T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void unpack8_float(const uint4& raw, float (&x)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Elem16<T>::unpack2(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
// Eight consecutive 16-bit elements (one 16-byte load) as fp32.
template <typename T>
__device__ __forceinline__ void load8_float(const void* ptr, float (&x)[8]) {
  unpack8_float<T>(__ldg(reinterpret_cast<const uint4*>(ptr)), x);
}

}  // namespace sage_common
