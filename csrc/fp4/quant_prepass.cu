// Quantization pre-pass of the FP4 forward: the K mean and V absmax (kv_stats_kernel), then K
// (smoothed, permuted, along D) and V (transposed, along tokens), in NVFP4 (16-element blocks,
// E4M3 scales) or MXFP4 (32-element blocks, E8M0 scales), bit-exact with
// reference.quantize_nvfp4 / quantize_mxfp4 of the operands divided by their per-(batch, head)
// tensor scale. Masked keys are zero rows (selected, so NaN / Inf there vanish). Reads the
// caller's tensors, never writes them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/nonfinite.cuh"
#include "../common/numeric_conversion.cuh"
#include "../common/token_stats.cuh"
#include "fp4_api.h"
#include "fp4_format.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {
namespace {

// K mean and V finite absmax: the 8-bit pre-pass's reduction (common/token_stats.cuh) with
// batched loads (its default mode), alone in its launch.
template <int D, typename T>
__global__ void __launch_bounds__(sage_common::kStatsThreads) kv_stats_kernel(const __grid_constant__ KvStatsParams p) {
  sage_common::token_stats_block<D, T, /*kBatch=*/true>(p, [&](int bh, int d, float mean, float amax) {
    p.k_mean[bh * D + d] = mean;
    p.v_amax[bh * D + d] = amax;
  });
}

// Quantize one block of kBlock floats (16 or 32) into kBlock / 8 packed words (element 2j in the
// low nibble of byte j) + a scale byte; a zero block gets scale byte 0 and +0 codes.
template <Fp4Format F, int kBlock = fp4_block(F)>
__device__ __forceinline__ void quantize_block(const float (&x)[kBlock], uint32_t (&w)[kBlock / 8],
                                               uint8_t& scale_byte) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const Fp4Scale<F> s = Fp4Scale<F>::of(amax);
#pragma unroll
  for (int i = 0; i < kBlock / 8; ++i) w[i] = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    w[i / 8] |= (s.nonzero() ? e2m1_code(s.exact_code_input(x[i])) : 0u) << (4 * (i % 8));
  }
  scale_byte = static_cast<uint8_t>(s.byte);
}

template <int kWords>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kWords]) {
  if constexpr (kWords == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// One thread per (kv head, stored token row, block along D). Consecutive threads take consecutive
// blocks of one row, so the reads coalesce.
__device__ __forceinline__ bool attended(const uint8_t* key_mask, int b, int skv, int token) {
  return token < skv && (key_mask == nullptr || key_mask[int64_t(b) * skv + token] != 0);
}

// Non-finite scaled values are quantized as 0 (the reference's fp4_tensor_roundtrip): a NaN of an
// attended K row, say, leaves its block's other values and scale as they were.
using sage_common::finite_or_zero;

template <typename T, Fp4Format F>
__global__ void quantize_k_kernel(const T* __restrict__ k, int64_t sb, int64_t sh, int64_t ss,
                                  const float* __restrict__ k_mean, const float* __restrict__ k_scale,
                                  const uint8_t* __restrict__ key_mask, uint8_t* __restrict__ kq,
                                  uint8_t* __restrict__ ksf, int H, int skv, int skv_pad, int D,
                                  int64_t total) {
  constexpr int kBlock = fp4_block(F);
  const int blocks_per_row = D / kBlock;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int blk = static_cast<int>(idx % blocks_per_row);
    const int64_t row = idx / blocks_per_row;  // (b * H + h) * skv_pad + pos
    const int pos = static_cast<int>(row % skv_pad);
    const int64_t bh = row / skv_pad;
    const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
    const int token = (pos / kBlockN) * kBlockN + tile_key(pos % kBlockN);
    float x[kBlock];
    if (attended(key_mask, b, skv, token)) {
      const T* src = k + b * sb + h * sh + token * ss + blk * kBlock;
      const float* mean = k_mean + bh * D + blk * kBlock;
      const float tensor_scale = k_scale[bh];
#pragma unroll
      for (int v8 = 0; v8 < kBlock / 8; ++v8) {
        const uint4 raw = reinterpret_cast<const uint4*>(src)[v8];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[8 * v8 + i] = finite_or_zero(__fdiv_rn(sage_common::Elem16<T>::to_float(e[i]) - mean[8 * v8 + i], tensor_scale));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBlock; ++i) x[i] = 0.0f;  // padding and masked tokens: zero rows
    }
    uint32_t w[kBlock / 8];
    uint8_t s;
    quantize_block<F>(x, w, s);
    store_words(kq + row * (D / 2) + blk * (kBlock / 2), w);
    ksf[row * blocks_per_row + blk] = s;
  }
}

// One thread per (kv head, channel, token block). Consecutive threads take consecutive channels of
// the same tokens, so the 2-byte reads coalesce across the warp.
template <typename T, Fp4Format F>
__global__ void quantize_v_kernel(const T* __restrict__ v, int64_t sb, int64_t sh, int64_t ss,
                                  const float* __restrict__ v_scale, const uint8_t* __restrict__ key_mask,
                                  uint8_t* __restrict__ vq, uint8_t* __restrict__ vsf, int* __restrict__ v_first,
                                  int H, int skv, int skv_pad, int D, int64_t total) {
  constexpr int kBlock = fp4_block(F);
  const int tblocks = skv_pad / kBlock;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(idx % D);
    const int64_t rest = idx / D;
    const int tb = static_cast<int>(rest % tblocks);
    const int64_t bh = rest / tblocks;
    const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
    const T* src = v + b * sb + h * sh + d;
    const float tensor_scale = v_scale[bh];
    float x[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      const int token = tb * kBlock + i;
      // Skv zero-padded; masked keys and non-finite values are zeros (the latter reach the
      // output exactly through v_first instead of saturating the block's scale).
      const float e = attended(key_mask, b, skv, token) ? sage_common::Elem16<T>::to_float(src[token * ss]) : 0.0f;
      if (!(fabsf(e) < INFINITY)) {  // rare
        // The record of common/nonfinite.cuh (record_nonfinite on this (b, head)'s slice) written
        // out: the same address and value, but the call compiled this pre-pass to other SASS.
        const NonFinite kind = e != e ? NonFinite::kNaN : (e > 0.0f ? NonFinite::kPosInf : NonFinite::kNegInf);
        atomicMin(v_first + (bh * static_cast<int>(NonFinite::kCount) + static_cast<int>(kind)) * D + d, token);
      }
      x[i] = finite_or_zero(__fdiv_rn(e, tensor_scale));
    }
    uint32_t w[kBlock / 8];
    uint8_t s;
    quantize_block<F>(x, w, s);
    const int64_t out_row = bh * D + d;
    store_words(vq + out_row * (skv_pad / 2) + tb * (kBlock / 2), w);
    vsf[out_row * tblocks + tb] = s;
  }
}

int grid_for(int64_t total, int threads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return static_cast<int>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

template <typename T, Fp4Format F>
void quantize_k_as(const void* k, int64_t sb, int64_t sh, int64_t ss, const float* k_mean, const float* k_scale,
                   const uint8_t* key_mask, uint8_t* kq, uint8_t* ksf, int B, int H, int skv, int skv_pad, int D,
                   cudaStream_t stream) {
  const int64_t total = int64_t(B) * H * skv_pad * (D / fp4_block(F));
  if (total == 0) return;
  constexpr int kThreadsPre = 256;
  quantize_k_kernel<T, F><<<grid_for(total, kThreadsPre), kThreadsPre, 0, stream>>>(
      static_cast<const T*>(k), sb, sh, ss, k_mean, k_scale, key_mask, kq, ksf, H, skv, skv_pad, D, total);
}

template <typename T, Fp4Format F>
void quantize_v_as(const void* v, int64_t sb, int64_t sh, int64_t ss, const float* v_scale, const uint8_t* key_mask,
                   uint8_t* vq, uint8_t* vsf, int* v_first, int B, int H, int skv, int skv_pad, int D,
                   cudaStream_t stream) {
  const int64_t total = int64_t(B) * H * (skv_pad / fp4_block(F)) * D;
  if (total == 0) return;
  constexpr int kThreadsPre = 256;
  quantize_v_kernel<T, F><<<grid_for(total, kThreadsPre), kThreadsPre, 0, stream>>>(
      static_cast<const T*>(v), sb, sh, ss, v_scale, key_mask, vq, vsf, v_first, H, skv, skv_pad, D, total);
}

}  // namespace

cudaError_t launch_kv_stats(const KvStatsParams& p, ElemType dtype, cudaStream_t stream) {
  if (p.B * p.Hkv * p.n_split == 0) return cudaSuccess;
  if (p.D != 64 && p.D != 128) return cudaErrorInvalidValue;
  const bool f16 = dtype == ElemType::kFloat16;
  auto fn = p.D == 64 ? (f16 ? kv_stats_kernel<64, __half> : kv_stats_kernel<64, __nv_bfloat16>)
                      : (f16 ? kv_stats_kernel<128, __half> : kv_stats_kernel<128, __nv_bfloat16>);
  fn<<<p.B * p.Hkv * p.n_split, sage_common::kStatsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_quantize_k(const void* k, ElemType dtype, Fp4Format fmt, int64_t sb, int64_t sh, int64_t ss,
                              const float* k_mean, const float* k_scale, const uint8_t* key_mask, uint8_t* kq,
                              uint8_t* ksf, int B, int H, int skv, int skv_pad, int D, cudaStream_t stream) {
  const bool f16 = dtype == ElemType::kFloat16, nv = fmt == Fp4Format::kNvfp4;
  auto fn = f16 ? (nv ? quantize_k_as<__half, Fp4Format::kNvfp4> : quantize_k_as<__half, Fp4Format::kMxfp4>)
                : (nv ? quantize_k_as<__nv_bfloat16, Fp4Format::kNvfp4> : quantize_k_as<__nv_bfloat16, Fp4Format::kMxfp4>);
  fn(k, sb, sh, ss, k_mean, k_scale, key_mask, kq, ksf, B, H, skv, skv_pad, D, stream);
  return cudaGetLastError();
}

cudaError_t launch_quantize_v(const void* v, ElemType dtype, Fp4Format fmt, int64_t sb, int64_t sh, int64_t ss,
                              const float* v_scale, const uint8_t* key_mask, uint8_t* vq, uint8_t* vsf,
                              int* v_first, int B, int H, int skv, int skv_pad, int D, cudaStream_t stream) {
  const bool f16 = dtype == ElemType::kFloat16, nv = fmt == Fp4Format::kNvfp4;
  auto fn = f16 ? (nv ? quantize_v_as<__half, Fp4Format::kNvfp4> : quantize_v_as<__half, Fp4Format::kMxfp4>)
                : (nv ? quantize_v_as<__nv_bfloat16, Fp4Format::kNvfp4> : quantize_v_as<__nv_bfloat16, Fp4Format::kMxfp4>);
  fn(v, sb, sh, ss, v_scale, key_mask, vq, vsf, v_first, B, H, skv, skv_pad, D, stream);
  return cudaGetLastError();
}

}  // namespace sage_fp4
