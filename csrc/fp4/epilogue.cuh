// Epilogue of the FP4 forward: finish the row sums, normalise, apply V's tensor scale, store O in
// the input dtype (finite results saturate at its range, as exact attention never exceeds max |V|)
// and the natural-log LSE of the unsmoothed scores. Non-finite values reach the
// output where exact attention puts them: a query row whose Q held a NaN / Inf (qk_mean NaN,
// q_prologue) and that sees a key is NaN, and V's non-finite elements (FwdParams::v_first) are
// written over the channels of the rows that see their key (NaN where a NaN or both infinities
// meet), as reference.online_softmax.nonfinite_v.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "../common/nonfinite.cuh"
#include "../common/numeric_conversion.cuh"
#include "../common/softmax_utils.cuh"
#include "fp4_api.h"
#include "q_prologue.cuh"
#include "softmax_pquant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {


template <int kHeadDim, typename T>
__device__ __forceinline__ void store_output(const FwdParams& p, const float (&acc)[kHeadDim / 8][4],
                                             RowState st, const float* qk_mean, int b, int h, int q0) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int g = lane >> 2, t = lane & 3;
  T* og = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
  const int64_t bhk = int64_t(b) * p.Hkv + h / (p.Hq / p.Hkv);
  const float s_v = p.v_scale[bhk];
  const int* v_first = p.v_first + bhk * static_cast<int>(NonFinite::kCount) * kHeadDim;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = sage_common::quad_sum(st.l[r]);
    const int local = 16 * warp + g + 8 * r;
    const int row = q0 + local;
    if (row >= p.Sq) continue;
    const bool seen = l > 0.0f;  // rows with no visible key return 0
    const float qkm = qk_mean[local];  // kBadRowBits: the row's Q held a NaN / Inf
    const float inv = seen ? (is_bad_row(qkm) ? qkm : __fdiv_rn(s_v, l)) : 0.0f;
    const int last_key = p.causal ? min(row, p.Skv - 1) : p.Skv - 1;  // v_first holds attended keys only
    T* orow = og + int64_t(row) * p.o_ss;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      const int c = 8 * n + 2 * t;
      // Saturated first: V's own non-finite values are then written where they belong.
      const float o0 = sage_common::apply_nonfinite</*kInfFromBits=*/true>(
          v_first, kHeadDim, c, last_key, sage_common::saturate_finite<T>(acc[n][2 * r] * inv));
      const float o1 = sage_common::apply_nonfinite</*kInfFromBits=*/true>(
          v_first, kHeadDim, c + 1, last_key, sage_common::saturate_finite<T>(acc[n][2 * r + 1] * inv));
      *reinterpret_cast<uint32_t*>(orow + 8 * n + 2 * t) = sage_common::Elem16<T>::pack2(o0, o1);
    }
    if (p.lse != nullptr && t == 0) {
      p.lse[(int64_t(b) * p.Hq + h) * p.Sq + row] =
          l > 0.0f ? sage_common::lse_from_log2(st.m[r], l) + p.scale * qk_mean[local] : -CUDART_INF_F;
    }
  }
}

}  // namespace sage_fp4
