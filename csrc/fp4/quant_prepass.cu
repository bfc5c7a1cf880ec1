// Quantization pre-pass of the FP4 forward: K (smoothed, permuted, along D) and V (transposed,
// along tokens). Reads the caller's tensors, never writes them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4_api.h"
#include "fp4_format.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// Quantize 16 floats into 8 packed bytes (element 2j in the low nibble of byte j) + a scale byte.
__device__ __forceinline__ void quantize16(const float (&x)[16], uint2& packed, uint8_t& scale_byte) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const BlockScale s = nvfp4_scale(amax);
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i / 8] |= nvfp4_code(x[i], s.value) << (4 * (i % 8));
  packed = make_uint2(w[0], w[1]);
  scale_byte = static_cast<uint8_t>(s.byte);
}

// One thread per (kv head, stored token row, 16-element block along D). Consecutive threads take
// consecutive blocks of one row, so the 32-byte reads coalesce.
template <typename T>
__global__ void quantize_k_kernel(const T* __restrict__ k, int64_t sb, int64_t sh, int64_t ss,
                                  const float* __restrict__ k_mean, uint8_t* __restrict__ kq,
                                  uint8_t* __restrict__ ksf, int H, int skv, int skv_pad, int D,
                                  int64_t total) {
  const int blocks_per_row = D / 16;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int blk = static_cast<int>(idx % blocks_per_row);
    const int64_t row = idx / blocks_per_row;  // (b * H + h) * skv_pad + pos
    const int pos = static_cast<int>(row % skv_pad);
    const int64_t bh = row / skv_pad;
    const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
    const int token = (pos / kBlockN) * kBlockN + tile_key(pos % kBlockN);
    float x[16];
    if (token < skv) {
      const T* src = k + b * sb + h * sh + token * ss + blk * 16;
      const uint4 raw0 = reinterpret_cast<const uint4*>(src)[0];
      const uint4 raw1 = reinterpret_cast<const uint4*>(src)[1];
      const T* e0 = reinterpret_cast<const T*>(&raw0);
      const T* e1 = reinterpret_cast<const T*>(&raw1);
      const float* mean = k_mean + bh * D + blk * 16;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[i] = to_float(e0[i]) - mean[i];
        x[8 + i] = to_float(e1[i]) - mean[8 + i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = 0.0f;  // padding tokens: masked by the kernel anyway
    }
    uint2 packed;
    uint8_t s;
    quantize16(x, packed, s);
    reinterpret_cast<uint2*>(kq + row * (D / 2))[blk] = packed;
    ksf[row * blocks_per_row + blk] = s;
  }
}

// One thread per (kv head, channel, 16-token block). Consecutive threads take consecutive
// channels of the same tokens, so the 2-byte reads coalesce across the warp.
template <typename T>
__global__ void quantize_v_kernel(const T* __restrict__ v, int64_t sb, int64_t sh, int64_t ss,
                                  uint8_t* __restrict__ vq, uint8_t* __restrict__ vsf, int H, int skv,
                                  int skv_pad, int D, int64_t total) {
  const int tblocks = skv_pad / 16;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(idx % D);
    const int64_t rest = idx / D;
    const int tb = static_cast<int>(rest % tblocks);
    const int64_t bh = rest / tblocks;
    const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
    const T* src = v + b * sb + h * sh + d;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int token = tb * 16 + i;
      x[i] = token < skv ? to_float(src[token * ss]) : 0.0f;  // spec: Skv zero-padded
    }
    uint2 packed;
    uint8_t s;
    quantize16(x, packed, s);
    const int64_t out_row = bh * D + d;
    reinterpret_cast<uint2*>(vq + out_row * (skv_pad / 2))[tb] = packed;
    vsf[out_row * tblocks + tb] = s;
  }
}

int grid_for(int64_t total, int threads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return static_cast<int>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

}  // namespace

cudaError_t launch_quantize_k(const void* k, ElemType dtype, int64_t sb, int64_t sh, int64_t ss,
                              const float* k_mean, uint8_t* kq, uint8_t* ksf, int B, int H, int skv,
                              int skv_pad, int D, cudaStream_t stream) {
  const int64_t total = int64_t(B) * H * skv_pad * (D / 16);
  if (total == 0) return cudaSuccess;
  constexpr int kThreadsPre = 256;
  const int grid = grid_for(total, kThreadsPre);
  if (dtype == ElemType::kFloat16) {
    quantize_k_kernel<__half><<<grid, kThreadsPre, 0, stream>>>(
        static_cast<const __half*>(k), sb, sh, ss, k_mean, kq, ksf, H, skv, skv_pad, D, total);
  } else {
    quantize_k_kernel<__nv_bfloat16><<<grid, kThreadsPre, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(k), sb, sh, ss, k_mean, kq, ksf, H, skv, skv_pad, D, total);
  }
  return cudaGetLastError();
}

cudaError_t launch_quantize_v(const void* v, ElemType dtype, int64_t sb, int64_t sh, int64_t ss,
                              uint8_t* vq, uint8_t* vsf, int B, int H, int skv, int skv_pad, int D,
                              cudaStream_t stream) {
  const int64_t total = int64_t(B) * H * (skv_pad / 16) * D;
  if (total == 0) return cudaSuccess;
  constexpr int kThreadsPre = 256;
  const int grid = grid_for(total, kThreadsPre);
  if (dtype == ElemType::kFloat16) {
    quantize_v_kernel<__half><<<grid, kThreadsPre, 0, stream>>>(
        static_cast<const __half*>(v), sb, sh, ss, vq, vsf, H, skv, skv_pad, D, total);
  } else {
    quantize_v_kernel<__nv_bfloat16><<<grid, kThreadsPre, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(v), sb, sh, ss, vq, vsf, H, skv, skv_pad, D, total);
  }
  return cudaGetLastError();
}

}  // namespace sage_fp4
