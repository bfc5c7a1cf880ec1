// Online softmax of one score tile fused with the quantization of P~ into FP4 A fragments
// (two-level: per-row FP32 factor s1 = tile rowmax / (448 * 6), then NVFP4 / MXFP4 of P~ / s1; or
// direct). MXFP4 keeps the reference's s1 = rowmax / 2688: its power-of-two block scales do not
// use the E4M3 range the factor was chosen for, but the kernel mirrors sage3_reference exactly.
#pragma once

#include <cstdint>
#include <math_constants.h>

#include "../common/softmax_utils.cuh"
#include "fp4_api.h"
#include "fragment_quant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

using sage_common::chains_max;
using sage_common::chains_sum;
using sage_common::exp2_mufu;
using sage_common::quad_max;

// Per-thread softmax state of its two rows (g and g + 8 of the warp's 16).
struct RowState {
  float m[2];  // running max, log2 domain; -inf until a visible key is seen
  float l[2];  // this lane's partial row sum of unquantized P~ (quad-reduced in the epilogue)
  __device__ __forceinline__ static RowState start() { return {{-CUDART_INF_F, -CUDART_INF_F}, {0.0f, 0.0f}}; }
};

// An m16n8-tiled fp32 accumulator (the O of a warp's 16 rows) set to zero.
template <int N>
__device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  }
}

// Scores of the tile -> log2 domain with the smoothing correction and masks applied in place.
// Column `pos` = 8j + 2t + e holds real key tile * 128 + tile_key(pos), which is what masks see.
struct TileMask {
  const float* corr;          // [kBlockN] qbar . deq(K) per column
  const uint32_t* valid_bits; // [kBlockN / 32]
  int key0;                   // tile * kBlockN
  int row[2];                 // query index of rows g, g + 8
  bool causal;
  bool needed;                // false when every key of the tile is visible to every row of the warp
};

// The scores x = deq(Qq) . deq(Kq) of the tensor-scaled operands: the real score is
// s_k * (s_q * x + qbar . deq(Kq)) (qbar is not divided by s_q). Not prescaled: scale_log2 =
// scale * log2(e) * s_k and x_scale = s_q, one FMA and one multiply per score (x + c when
// x_scale = 1). kPrescaled: corr already holds qbar . deq(Kq) * scale * log2(e) * s_k (the wgmma
// variant's producer writes it so) and scale_log2 = scale * log2(e) * s_q * s_k, one FMA per score.
template <bool kPrescaled = false>
__device__ __forceinline__ void scores_to_log2(float (&s)[kBlockN / 8][4], const TileMask& mk,
                                               float scale_log2, float x_scale = 1.0f) {
  auto log2_score = [&](float x, float c) {
    return kPrescaled ? fmaf(x, scale_log2, c) : fmaf(x, x_scale, c) * scale_log2;
  };
  const int t = static_cast<int>(threadIdx.x & 3);
  if constexpr (kOptHoistMask) {
    // One uniform branch per tile instead of one per element: the common unmasked tile runs
    // two FP32 ops per score and no branch bookkeeping.
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const float2 c2 = *reinterpret_cast<const float2*>(mk.corr + 8 * j + 2 * t);
      s[j][0] = log2_score(s[j][0], c2.x);
      s[j][1] = log2_score(s[j][1], c2.y);
      s[j][2] = log2_score(s[j][2], c2.x);
      s[j][3] = log2_score(s[j][3], c2.y);
    }
    if (mk.needed) {
      const uint32_t bits[4] = {mk.valid_bits[0], mk.valid_bits[1], mk.valid_bits[2], mk.valid_bits[3]};
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = 8 * j + 2 * t + e;
          const int key = mk.key0 + tile_key(pos);
          const bool ok = (bits[pos >> 5] >> (pos & 31)) & 1u;
          if (!ok || (mk.causal && key > mk.row[0])) s[j][e] = -CUDART_INF_F;
          if (!ok || (mk.causal && key > mk.row[1])) s[j][2 + e] = -CUDART_INF_F;
        }
      }
    }
  } else {  // kept for the variant benchmark (SAGE_FP4_OPT without bit 1)
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const float2 c2 = *reinterpret_cast<const float2*>(mk.corr + 8 * j + 2 * t);  // columns 8j+2t, +1
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = 8 * j + 2 * t + e;
        const float c = e == 0 ? c2.x : c2.y;
        s[j][e] = log2_score(s[j][e], c);
        s[j][2 + e] = log2_score(s[j][2 + e], c);
        if (mk.needed) {
          const int key = mk.key0 + tile_key(pos);
          const bool ok = (mk.valid_bits[pos >> 5] >> (pos & 31)) & 1u;
          if (!ok || (mk.causal && key > mk.row[0])) s[j][e] = -CUDART_INF_F;
          if (!ok || (mk.causal && key > mk.row[1])) s[j][2 + e] = -CUDART_INF_F;
        }
      }
    }
  }
}

// Row max, row sum and largest P~ of a tile are kept in kRowChains independent partials (4 with
// kOptTreeReduce: the serial 32-deep FADD / FMNMX chains dominated the loop's latency), combined
// by chains_max / chains_sum (common/softmax_utils.cuh).
constexpr int kRowChains = kOptTreeReduce ? 4 : 1;

// Online softmax of one tile in place: s (log2-domain scores) -> P~; returns alpha (rescale of
// the old accumulator), s1 (two-level factor of the new P.V product, 1 for direct) and 1 / s1 per
// row, and updates the running max and row sums.
__device__ __forceinline__ void softmax_rows(float (&s)[kBlockN / 8][4], RowState& st, PQuantMode mode,
                                             float (&alpha)[2], float (&s1)[2], float (&inv_s1)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx[kRowChains];
#pragma unroll
    for (int c = 0; c < kRowChains; ++c) mx[c] = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      mx[j % kRowChains] = fmaxf(mx[j % kRowChains], fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    }
    const float tmax = quad_max(chains_max(mx));
    const float m_new = fmaxf(st.m[r], tmax);
    // Rows without a visible key so far keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
    const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;
    alpha[r] = exp2_mufu(st.m[r] - m_use);
    st.m[r] = m_new;
    float ps[kRowChains], pm[kRowChains];
#pragma unroll
    for (int c = 0; c < kRowChains; ++c) ps[c] = pm[c] = 0.0f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2_mufu(s[j][2 * r + e] - m_use);
        s[j][2 * r + e] = p;
        ps[j % kRowChains] += p;
        pm[j % kRowChains] = fmaxf(pm[j % kRowChains], p);
      }
    }
    const float sum = chains_sum(ps);
    float pmax = chains_max(pm);
    st.l[r] = st.l[r] * alpha[r] + sum;  // unquantized P~: the two-level factor cancels exactly
    if (mode == PQuantMode::kTwoLevel) {
      pmax = quad_max(pmax);
      s1[r] = pmax * (1.0f / kTwoLevelRange);
      if (!(s1[r] >= kMinTwoLevelS1)) s1[r] = 0.0f;  // negligible tile (fp4_format.cuh)
      inv_s1[r] = s1[r] > 0.0f ? __frcp_rn(s1[r]) : 0.0f;  // s1 == 0: the row's P~ of this tile is 0
    } else {
      s1[r] = 1.0f;
      inv_s1[r] = 1.0f;
    }
  }
}

// s (log2-domain scores) -> P fragments of the atom (codes and scales, decoded by Atom::make_a
// for the emulated one); alpha, s1 as softmax_rows.
template <class Atom>
__device__ __forceinline__ void softmax_quantize_p(float (&s)[kBlockN / 8][4], RowState& st,
                                                   PQuantMode mode, float (&alpha)[2], float (&s1)[2],
                                                   typename Atom::FragA (&pf)[kBlockN / kKeyChunk]) {
  float inv_s1[2];
  softmax_rows(s, st, mode, alpha, s1, inv_s1);
  // Fragment slot i of chunk c (k = 8t + i, or 32 + 8t + i - 8) is score column 8(8c + i/2) + 2t + i%2
  // thanks to the key permutation, i.e. n-tile j = 8c + i/2, element e = i % 2.
#pragma unroll
  for (int c = 0; c < kBlockN / kKeyChunk; ++c) {
    float vals[2][16];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int i = 0; i < 16; ++i) vals[r][i] = s[8 * c + i / 2][2 * r + (i & 1)] * inv_s1[r];
    }
    uint32_t codes[4], sf_lo, sf_hi;
    quantize_a_chunk<Atom::kFormat, Division::kReciprocal, true>(vals, codes, sf_lo, sf_hi);
    pf[c] = Atom::make_a(codes, sf_lo, sf_hi);
  }
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // lg2(0) = -inf
  return y;
}

// Online softmax of one tile fused with NVFP4 P~ quantization straight to the fp16 A fragments of
// the P.V wgmma (the emulated sm_90a path, which only needs P~ decoded). s: log2-domain scores
// (masked = -inf). Per 16-key block b of a row: E4M3 scale sb = E4M3(amax_b / (6 s1)), values
// E2M1(P~ / (s1 sb)) times sb (exact in fp16). Reordered so each score costs ~9 instructions:
//  - block maxima of the scores first; the row max is their max (no separate pass), amax_b =
//    exp2(block max - m) and s1 = exp2(row max - m) / 2688 need one exp2 each;
//  - P~ / (s1 sb) comes out of the exp2 directly: exp2(x - (m + log2 s1 + log2 sb)); the row
//    sum of unquantized P~ adds each block's sum times s1 sb;
//  - the E2M1 rounding runs on fp16 pairs (e2m1_round_half2).
// The same quantizer as the codes path up to the order of its fp32 roundings (log2 / exp2 instead
// of a division, the fp16 step before the E2M1 rounding): a value within ~2^-11 of an E2M1 tie
// can take the neighbouring code. A block whose scale rounds to 0 gets P~ = 0 (x 0); its values
// still enter the row sum (through sb_eff = max(sb, 2^-9), the smallest nonzero E4M3). A row
// whose s1 is below kMinTwoLevelS1 (its P~ in this tile < 2^-52.6) contributes 0 and reports s1 = 0.
// pf[ks] is the A fragment of k16 step ks: registers (row g, n-tile 2ks), (g + 8, 2ks),
// (g, 2ks + 1), (g + 8, 2ks + 1), columns 2t, 2t + 1 of each.
__device__ __forceinline__ void softmax_p_nvfp4_half(float (&s)[kBlockN / 8][4], RowState& st, PQuantMode mode,
                                                     float (&alpha)[2], float (&s1)[2],
                                                     uint32_t (&pf)[kBlockN / 16][4]) {
  constexpr float kMinE4m3 = 1.0f / 512.0f;  // 2^-9
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // Block (c, h): n-tiles 8c + 4h .. + 3 of this lane, the other half in lane t ^ 1.
    float bmax[kBlockN / 64][2];
#pragma unroll
    for (int c = 0; c < kBlockN / 64; ++c) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 8 * c + 4 * h;
        const float m01 = fmaxf(fmaxf(s[j][2 * r], s[j][2 * r + 1]), fmaxf(s[j + 1][2 * r], s[j + 1][2 * r + 1]));
        const float m23 =
            fmaxf(fmaxf(s[j + 2][2 * r], s[j + 2][2 * r + 1]), fmaxf(s[j + 3][2 * r], s[j + 3][2 * r + 1]));
        const float m = fmaxf(m01, m23);
        bmax[c][h] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      }
    }
    float tmax = fmaxf(fmaxf(bmax[0][0], bmax[0][1]), fmaxf(bmax[1][0], bmax[1][1]));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float m_new = fmaxf(st.m[r], tmax);
    // Rows without a visible key so far keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
    const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;
    alpha[r] = exp2_mufu(st.m[r] - m_use);
    st.m[r] = m_new;
    float ls1, inv_s1;
    if (mode == PQuantMode::kTwoLevel) {
      s1[r] = exp2_mufu(tmax - m_use) * (1.0f / kTwoLevelRange);
      if (!(s1[r] >= kMinTwoLevelS1)) s1[r] = 0.0f;  // negligible tile (fp4_format.cuh)
      ls1 = s1[r] > 0.0f ? fast_log2(s1[r]) : CUDART_INF_F;  // +inf: every P~' of the row is 0
      inv_s1 = s1[r] > 0.0f ? fast_rcp(s1[r]) : 0.0f;
    } else {
      s1[r] = 1.0f;
      ls1 = 0.0f;
      inv_s1 = 1.0f;
    }
    const float k6 = inv_s1 * (1.0f / kE2M1Max);
    float lsum = 0.0f;
#pragma unroll
    for (int c = 0; c < kBlockN / 64; ++c) {
      const uint32_t sb2 = e4m3x2_half2(exp2_mufu(bmax[c][1] - m_use) * k6, exp2_mufu(bmax[c][0] - m_use) * k6);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t sb = prmt(sb2, 0u, h ? 0x3232u : 0x1010u);  // broadcast to both halves
        const float sb_eff = fmaxf(__half2float(__ushort_as_half(static_cast<uint16_t>(h ? sb2 >> 16 : sb2))), kMinE4m3);
        const float shift = m_use + ls1 + fast_log2(sb_eff);  // P~' = exp2(x - shift) = P~ / (s1 sb)
        float bsum = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = 8 * c + 4 * h + q;
          const float p0 = exp2_mufu(s[j][2 * r] - shift), p1 = exp2_mufu(s[j][2 * r + 1] - shift);
          bsum += p0 + p1;
          const __half2 x = __floats2half2_rn(p0, p1);
          const uint32_t v = e2m1_round_half2(*reinterpret_cast<const uint32_t*>(&x));
          pf[4 * c + 2 * h + q / 2][r + 2 * (q & 1)] = hmul2_bits(v, *reinterpret_cast<const __half2*>(&sb));
        }
        lsum = fmaf(bsum, s1[r] * sb_eff, lsum);  // back to unquantized P~
      }
    }
    st.l[r] = st.l[r] * alpha[r] + lsum;
  }
}

// One warp, one score tile: masks and the smoothing correction (scores_to_log2), online softmax
// and P~ quantization (softmax_quantize_p). `s` holds Q.K^T of the warp's 16 rows (query rows
// warp_row0 + g, + 8) in the m16n8 accumulator layout; `corr` / `valid` are the tile's columns.
template <class Atom>
__device__ __forceinline__ void scores_to_p_tile(float (&s)[kBlockN / 8][4], const FwdParams& p, int tile,
                                                 int warp_row0, const float* corr, const uint32_t* valid,
                                                 float scale_log2, float q_scale, RowState& rs,
                                                 float (&alpha)[2], float (&s1)[2],
                                                 typename Atom::FragA (&pf)[kBlockN / kKeyChunk]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  TileMask mk;
  mk.corr = corr;
  mk.valid_bits = valid;
  mk.key0 = tile * kBlockN;
  mk.row[0] = warp_row0 + (lane >> 2);
  mk.row[1] = mk.row[0] + 8;
  mk.causal = p.causal;
  const int key_end = (tile + 1) * kBlockN;  // one past the tile's last key
  mk.needed = p.key_mask != nullptr || key_end > p.Skv || (p.causal && key_end - 1 > warp_row0);
  scores_to_log2(s, mk, scale_log2, q_scale);
  softmax_quantize_p<Atom>(s, rs, p.p_quant, alpha, s1, pf);
}

}  // namespace sage_fp4
