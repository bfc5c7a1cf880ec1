// Final normalisation and stores (sage8 spec step 6):
//   out = acc * sv[d] / (448 * l)  (0 when l == 0),  lse = m ln2 + ln l + scale q.k_mean.
// Each thread owns two rows and columns 8j + 2t + {0, 1}: it writes 4-byte pairs straight to the
// strided output (rows >= Sq are padding and are skipped).
#pragma once

#include <cstdint>

#include "numerics.hpp"
#include "softmax.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

template <int D, DType kOut, class Softmax>
__device__ __forceinline__ void epilogue_store(const FwdParams& p, const Softmax& sm,
                                               const float (&o)[D / 2], const int (&row)[2], int b,
                                               int h, int hk) {
  const int t = threadIdx.x & 3;
  float l[2], inv[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    l[x] = quad_sum(sm.l[x]);
    // the lean softmax sums 448 * p already
    inv[x] = l[x] > 0.f ? 1.f / (Softmax::kLean ? l[x] : kFp8Max * l[x]) : 0.f;
  }
  const float* sv = p.sv + static_cast<int64_t>(b * p.Hkv + hk) * D;
  char* ob = static_cast<char*>(p.out) + 2 * (b * p.o_sb + h * p.o_sh);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int col = 8 * j + 2 * t;
    const float2 s = *reinterpret_cast<const float2*>(sv + col);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      if (row[x] < p.Sq) {
        const uint32_t packed = IO<kOut>::from_float2(o[4 * j + 2 * x] * s.x * inv[x],
                                                      o[4 * j + 2 * x + 1] * s.y * inv[x]);
        *reinterpret_cast<uint32_t*>(ob + 2 * (row[x] * p.o_ss + col)) = packed;
      }
    }
  }
  if (p.lse != nullptr && t == 0) {
    const int64_t bh = static_cast<int64_t>(b) * p.Hq + h;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      if (row[x] < p.Sq) {
        const float corr = p.qkm[bh * p.n_q_tiles * kRowsPerWG + row[x]];
        p.lse[bh * p.Sq + row[x]] =
            l[x] > 0.f ? sm.m[x] * 0.69314718055994531f + logf(l[x]) + corr -
                             (Softmax::kLean ? 6.1047932324f : 0.f)  // ln 448
                       : -INFINITY;
      }
    }
  }
}

}  // namespace sage_sm90
