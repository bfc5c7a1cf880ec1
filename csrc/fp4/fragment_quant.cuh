// NVFP4 / MXFP4 quantization of an MMA A-operand fragment held in registers (Q rows in the
// prologue, P~ rows in the main loop), producing the packed codes and the per-row scale words.
#pragma once

#include <cstdint>

#include "fp4_api.h"
#include "fp4_format.cuh"

namespace sage_fp4 {

// How a block's values are divided by its scale. kExact: fp32 true division, bit-exact with the
// reference quantizers (used for Q). kReciprocal: one reciprocal per block and multiplies (used
// for P~ in the main loop; a code can differ from the reference only when x/scale lands within
// an ulp of a rounding boundary). MXFP4 scales are powers of two, so both modes are exact there.
enum class Division { kExact, kReciprocal };

// Quantize one 64-wide k chunk of a 16-row A fragment.
//
// vals[r][i]: this lane's values of row g (r = 0) or g + 8 (r = 1) at k = 8t + i (i < 8) and
// k = 32 + 8t + (i - 8) (i >= 8), with t = lane % 4. NVFP4: a 16-element scale block along k is
// shared by lanes t and t ^ 1; the four blocks of a row live in lanes t, t^1, t^2, t^3. MXFP4: the
// 32-element block h (k = 32h..32h+31) is values 8h..8h+7 of all four lanes of the quad.
// Out: codes[4] in the mma.m16n8k64 A register order (row g / g+8, k half 0 / 1), and the scale
// word of row g (sf_lo) and row g + 8 (sf_hi), byte j = block j (4 E4M3 or 2 E8M0 bytes),
// identical on all four lanes.
template <Fp4Format F, Division kDiv, bool kNonNegative>
__device__ __forceinline__ void quantize_a_chunk(const float (&vals)[2][16], uint32_t (&codes)[4],
                                                 uint32_t& sf_lo, uint32_t& sf_hi) {
  if constexpr (F == Fp4Format::kMxfp4) {
    uint32_t sf_word[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sf_word[r] = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(vals[r][8 * h + i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const Fp4Scale<F> s = Fp4Scale<F>::of(amax);
        const float inv = s.reciprocal();  // exact 2^(127 - byte); 0 for a zero block (codes +0)
        uint32_t packed = 0;
        if constexpr (kNonNegative) {
          float x[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) x[i] = vals[r][8 * h + i] * inv;
          packed = e2m1_pack8_nonneg(x);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            packed |= (s.nonzero() ? e2m1_code(vals[r][8 * h + i] * inv) : 0u) << (4 * i);
          }
        }
        codes[2 * h + r] = packed;
        sf_word[r] |= s.byte << (8 * h);
      }
    }
    sf_lo = sf_word[0];
    sf_hi = sf_word[1];
    return;
  }
  const int t = static_cast<int>(threadIdx.x & 3);
  uint32_t sf_word[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sf_word[r] = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(vals[r][8 * h + i]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      const BlockScale s = nvfp4_scale(amax);
      uint32_t packed = 0;
      if (kDiv == Division::kExact) {
#pragma unroll
        for (int i = 0; i < 8; ++i) packed |= nvfp4_code(vals[r][8 * h + i], s.value) << (4 * i);
      } else {
        const float inv = s.value > 0.0f ? __frcp_rn(s.value) : 0.0f;  // scale 0 -> codes 0
        if constexpr (kNonNegative) {
          float x[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) x[i] = vals[r][8 * h + i] * inv;
          packed = e2m1_pack8_nonneg(x);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) packed |= e2m1_code(vals[r][8 * h + i] * inv) << (4 * i);
        }
      }
      codes[2 * h + r] = packed;
      sf_word[r] |= s.byte << (8 * (2 * h + (t >> 1)));
    }
    sf_word[r] |= __shfl_xor_sync(0xffffffffu, sf_word[r], 2);  // the other pair's blocks
  }
  sf_lo = sf_word[0];
  sf_hi = sf_word[1];
}

}  // namespace sage_fp4
