// Pre-pass of the EmuGemm::kWgmma variant: the quantized K and V^T (quant_prepass.cu outputs)
// decoded exactly, once per head, into 16-bit images of the GMMA shared-memory tiles, so the
// attention kernel moves each tile with one bulk copy and decodes nothing.
//
// Decoded values: E2M1 x block scale, exact in fp16 for NVFP4 (E4M3 scales) and in bf16 for
// MXFP4 (E8M0 scales overflow fp16): the same decode the emulated MMA atom applies to its
// register fragments (mma_atoms.cuh), so both GEMM variants multiply identical operands.
//
// Image of one 128-key tile (K-major, 128-byte swizzle, the layout CuTe's GMMA::Layout_K_SW128
// atoms give; wgmma_layout_check.cu proves the formula equal to the CuTe layout):
//   K:   row n = stored key position n (permuted within 64-key chunks, tile_config.cuh), col = d;
//   V^T: row d, col kk = stored position of real key vt_position_key(kk), the order in which the
//        P~ accumulator registers are the A fragments of the P.V wgmma with no shuffles.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../common/sm90/gmma_swizzle.cuh"
#include "fp4_api.h"
#include "fp4_format.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

// Stored V^T column kk of a kBlockN tile -> real key. The A fragment of the k16 step 4c + j is
// the score accumulator of n-tiles 2(4c + j) and 2(4c + j) + 1, i.e. columns 16(4c + j) + 2t + e
// and + 8; with K permuted (chunk_key) these columns are real keys 64c + 32h + 8t + 4q + 2u + e
// (j = 2h + q), so within each 32-key group position kk = 32q' + 8p + 2t + e holds key
// 32q' + 8t + 2p + e (proven in layout_model.py).
__host__ __device__ __forceinline__ constexpr int vt_position_key(int kk) {
  return (kk & ~31) + ((kk >> 1) & 3) * 8 + ((kk >> 3) & 3) * 2 + (kk & 1);
}

// Element offsets in the GMMA K-major SW128 tiles of 16-bit elements: sw128_elem16_offset
// (common/sm90/gmma_swizzle.cuh).
using sage_common::sm90::sw128_elem16_offset;

// The same element as CuTe addresses it (the wgmma descriptors' view): the GMMA::Layout_*_Atom
// swizzle acts on the byte address, so the layout is evaluated on a smem pointer. Host reference
// for wgmma_layout_check.cu.
template <class Layout, class Elem, class... Coord>
__host__ __device__ __forceinline__ Elem* tile_elem(Elem* base, Coord... coord) {
  auto tile = cute::make_tensor(cute::make_smem_ptr(base), Layout{});
  return &tile(coord...);
}

// One CTA per (tile, head): threads 0..127 decode K rows (a thread per stored key position, all
// of D), threads 128..255 decode V^T (a thread per channel and D / 32 of the tile's four 32-key
// groups). 16-byte loads of the packed codes, 16-byte stores into the image.
template <Fp4Format F, int kHeadDim>
__global__ void __launch_bounds__(256) decode_kv_images_kernel(const uint8_t* __restrict__ kq,
                                                               const uint8_t* __restrict__ ksf,
                                                               const uint8_t* __restrict__ vq,
                                                               const uint8_t* __restrict__ vsf,
                                                               uint16_t* __restrict__ k_img,
                                                               uint16_t* __restrict__ v_img, int skv_pad) {
  constexpr bool kBf16 = F == Fp4Format::kMxfp4;
  constexpr int kBlk = fp4_block(F);
  const int tile = blockIdx.x, bh = blockIdx.y, n_tiles = gridDim.x;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t img0 = (int64_t(bh) * n_tiles + tile) * kBlockN * kHeadDim;
  auto codes = [](uint32_t x, uint32_t (&out)[4]) {
    if constexpr (kBf16) {
      decode8_bf16_codes(x, out);
    } else {
      decode8_half_codes(x, out);
    }
  };
  auto scale2 = [](uint32_t byte) {
    if constexpr (kBf16) {
      return e8m0_bf16_pair(byte);
    } else {
      return __half2half2(e4m3_to_half(byte));
    }
  };
  if (tid < kBlockN) {
    const int n = tid;
    const int64_t key = int64_t(bh) * skv_pad + int64_t(tile) * kBlockN + n;
    const uint8_t* row = kq + key * (kHeadDim / 2);
    const uint8_t* sf_row = ksf + key * (kHeadDim / kBlk);
    uint16_t* out_tile = k_img + img0;
#pragma unroll
    for (int q = 0; q < kHeadDim / 32; ++q) {  // 32 dims = 16 packed bytes
      const uint4 w4 = *reinterpret_cast<const uint4*>(row + 16 * q);
      const uint32_t words[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {  // dims 32q + 8wi .. + 7
        const uint32_t byte = sf_row[(32 * q + 8 * wi) / kBlk];
        uint32_t c[4];
        codes(words[wi], c);
        const auto s2 = scale2(byte);
        const uint4 out = make_uint4(hmul2_bits(c[0], s2), hmul2_bits(c[1], s2), hmul2_bits(c[2], s2),
                                     hmul2_bits(c[3], s2));
        *reinterpret_cast<uint4*>(out_tile + sw128_elem16_offset<kBlockN, kHeadDim>(n, 32 * q + 8 * wi)) = out;
      }
    }
  } else {
    constexpr int kGroupsPerThread = kHeadDim / 32;  // of the tile's kBlockN / 32 = 4 key groups
    static_assert(kHeadDim * (kBlockN / 32) == 128 * kGroupsPerThread, "128 threads cover V^T");
    const int idx = tid - kBlockN;
    const int d = idx % kHeadDim, g0 = (idx / kHeadDim) * kGroupsPerThread;
    const int64_t ch = int64_t(bh) * kHeadDim + d;
    const uint8_t* row = vq + ch * (skv_pad / 2) + tile * (kBlockN / 2);
    const uint8_t* sf_row = vsf + ch * (skv_pad / kBlk) + tile * (kBlockN / kBlk);
    uint16_t* out_tile = v_img + img0;
#pragma unroll
    for (int gi = 0; gi < kGroupsPerThread; ++gi) {
      const int grp = g0 + gi;  // keys 32 grp .. 32 grp + 31
      const uint4 w4 = *reinterpret_cast<const uint4*>(row + 16 * grp);
      const uint32_t words[4] = {w4.x, w4.y, w4.z, w4.w};
      uint32_t dec[4][4];  // [word t][pair p]: keys 32 grp + 8t + 2p, +1
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint32_t byte = sf_row[(32 * grp + 8 * t) / kBlk];
        uint32_t c[4];
        codes(words[t], c);
        const auto s2 = scale2(byte);
#pragma unroll
        for (int pp = 0; pp < 4; ++pp) dec[t][pp] = hmul2_bits(c[pp], s2);
      }
      // Position 32 grp + 8p + 2t + e holds key 32 grp + 8t + 2p + e: 16-byte chunk p gathers
      // pair p of the four words.
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        *reinterpret_cast<uint4*>(out_tile + sw128_elem16_offset<kHeadDim, kBlockN>(d, 32 * grp + 8 * pp)) =
            make_uint4(dec[0][pp], dec[1][pp], dec[2][pp], dec[3][pp]);
      }
    }
  }
}

template <Fp4Format F>
cudaError_t launch_decode_kv_images_fmt(const uint8_t* kq, const uint8_t* ksf, const uint8_t* vq, const uint8_t* vsf,
                                        void* k_img, void* v_img, int BH, int skv_pad, int D, cudaStream_t stream) {
  if (BH == 0 || skv_pad == 0) return cudaSuccess;
  const dim3 grid(skv_pad / kBlockN, BH);
  auto* ki = static_cast<uint16_t*>(k_img);
  auto* vi = static_cast<uint16_t*>(v_img);
  if (D == 64) {
    decode_kv_images_kernel<F, 64><<<grid, 256, 0, stream>>>(kq, ksf, vq, vsf, ki, vi, skv_pad);
  } else if (D == 128) {
    decode_kv_images_kernel<F, 128><<<grid, 256, 0, stream>>>(kq, ksf, vq, vsf, ki, vi, skv_pad);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace sage_fp4
