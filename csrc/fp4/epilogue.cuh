// Epilogue of the FP4 forward: finish the row sums, normalise, store O in the input dtype and
// the natural-log LSE of the unsmoothed scores.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "fp4_api.h"
#include "softmax_pquant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <int kHeadDim, typename T>
__device__ __forceinline__ void store_output(const FwdParams& p, const float (&acc)[kHeadDim / 8][4],
                                             RowState st, const float* qk_mean, int b, int h, int q0) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int g = lane >> 2, t = lane & 3;
  T* og = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int local = 16 * warp + g + 8 * r;
    const int row = q0 + local;
    if (row >= p.Sq) continue;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // rows with no visible key return 0
    T* orow = og + int64_t(row) * p.o_ss;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      *reinterpret_cast<uint32_t*>(orow + 8 * n + 2 * t) = pack2<T>(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
    }
    if (p.lse != nullptr && t == 0) {
      constexpr float kLn2 = 0.6931471805599453f;
      p.lse[(int64_t(b) * p.Hq + h) * p.Sq + row] =
          l > 0.0f ? st.m[r] * kLn2 + logf(l) + p.scale * qk_mean[local] : -CUDART_INF_F;
    }
  }
}

}  // namespace sage_fp4
