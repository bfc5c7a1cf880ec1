// Final normalisation and stores (sage8 spec step 6):
//   out = acc * sv[d] / (448 * l)  (0 when l == 0),  lse = m ln2 + ln l + scale q.k_mean;
// a query row whose Q held a NaN or Inf (pre-pass scale sq = NaN) and that sees a key is NaN in
// out and lse, like exact attention, and only that row (its scores touch nothing else); V's
// non-finite elements (p.v_first) are written over the channels of the rows that see them.
// Each thread owns two rows and columns 8j + 2t + {0, 1}: it writes 4-byte pairs straight to the
// strided output (rows >= Sq are padding and are skipped).
// kSummary (FwdOptions::epilogue_summary): the v_first lookup costs 3 loads per output value
// (re-loaded per row: the output stores may alias them), although V almost never holds a NaN or
// Inf. p.v_summary holds, per (b, kv head), the first attended key with any non-finite V element
// (the minimum of v_first); where every row of the warp ends before it, no lookup can find one
// and the values are stored as they are: the same results, without the loads.
#pragma once

#include <cstdint>

#include "numerics.hpp"
#include "softmax.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

template <int D, DType kOut, bool kCausal, bool kSummary, class Softmax>
__device__ __forceinline__ void epilogue_store(const FwdParams& p, const Softmax& sm,
                                               const float (&o)[D / 2], const int (&row)[2], int b,
                                               int h, int hk) {
  const int t = threadIdx.x & 3;
  const int64_t bh = static_cast<int64_t>(b) * p.Hq + h;
  float l[2], inv[2];
  bool bad[2];
  int last_key[2];  // the last key each row may see (v_first holds attended keys only)
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    l[x] = quad_sum(sm.l[x]);
    bad[x] = l[x] > 0.f && isnan(sm.rowf[x]);  // rowf = sq * scale * log2(e): NaN exactly when sq is
    // the lean softmax sums 448 * p already
    inv[x] = l[x] > 0.f ? 1.f / (Softmax::kLean ? l[x] : kFp8Max * l[x]) : 0.f;
    inv[x] = bad[x] ? __int_as_float(0x7fffffff) : inv[x];  // NaN * anything = NaN
    last_key[x] = kCausal ? min(row[x], p.Skv - 1) : p.Skv - 1;
  }
  const int* v_first = p.v_first + static_cast<int64_t>(b * p.Hkv + hk) * static_cast<int>(NonFinite::kCount) * D;
  const float* sv = p.sv + static_cast<int64_t>(b * p.Hkv + hk) * D;
  char* ob = static_cast<char*>(p.out) + 2 * (b * p.o_sb + h * p.o_sh);
  // fix(c, x, k): the output value of channel c for a row that sees keys <= k
  auto store = [&](auto&& fix) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int col = 8 * j + 2 * t;
      const float2 s = *reinterpret_cast<const float2*>(sv + col);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        if (row[x] < p.Sq) {
          const float o0 = fix(col, o[4 * j + 2 * x] * s.x * inv[x], last_key[x]);
          const float o1 = fix(col + 1, o[4 * j + 2 * x + 1] * s.y * inv[x], last_key[x]);
          const uint32_t packed = IO<kOut>::pack2(o0, o1);
          *reinterpret_cast<uint32_t*>(ob + 2 * (row[x] * p.o_ss + col)) = packed;
        }
      }
    }
  };
  auto lookup = [&](int c, float x, int k) { return apply_nonfinite(v_first, D, c, k, x); };
  if constexpr (kSummary) {
    // warp-uniform, so each warp runs one of the two loops (last_key differs per row only when causal)
    const int first_bad = p.v_summary[b * p.Hkv + hk];
    if (__all_sync(0xffffffffu, first_bad > max(last_key[0], last_key[1]))) {
      // no lookup, and each row's address computed once: the stores take immediate offsets
      // (store()'s per-store 64-bit address arithmetic and branch go; same values and bytes)
      uint32_t* orow[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) orow[x] = reinterpret_cast<uint32_t*>(ob + 2 * (row[x] * p.o_ss + 2 * t));
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float2 s = *reinterpret_cast<const float2*>(sv + 8 * j + 2 * t);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          if (row[x] < p.Sq) {
            orow[x][4 * j] = IO<kOut>::pack2(o[4 * j + 2 * x] * s.x * inv[x], o[4 * j + 2 * x + 1] * s.y * inv[x]);
          }
        }
      }
    } else {
      store(lookup);
    }
  } else {
    store(lookup);
  }
  if (p.lse != nullptr && t == 0) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      if (row[x] < p.Sq) {
        const float corr = p.qkm[bh * p.n_q_tiles * kRowsPerWG + row[x]];
        const float lse = l[x] > 0.f ? sage_common::lse_from_log2(sm.m[x], l[x]) + corr -
                                           (Softmax::kLean ? 6.1047932324f : 0.f)  // ln 448
                                     : -INFINITY;
        p.lse[bh * p.Sq + row[x]] = bad[x] ? __int_as_float(0x7fffffff) : lse;
      }
    }
  }
}

}  // namespace sage_sm90
