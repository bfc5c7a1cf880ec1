// Final normalisation and stores (sage8 spec step 6):
//   out = acc * sv[d] / (448 * l)  (0 when l == 0),  lse = m ln2 + ln l + scale q.k_mean;
// (FwdOptions::pv_16bit: P~ = p and V unscaled, so out = acc / l);
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
// kStaged (FwdOptions::epilogue_staged): the same values, stored in two steps. The direct stores
// above write 4 bytes per thread (a warp store covers 8 rows x 16 B, half of each 32-byte sector)
// and, interleaved with them, load sv (and v_first) again per row, each load one L2 round trip
// behind the stores it may alias. Staged, a thread loads every sv value it needs first, packs its
// whole share of O in registers, writes it to a per-warp shared-memory tile with stmatrix
// (StagedOut below), and the warp then copies its 16 rows out with 16-byte loads and coalesced
// 16-byte stores (a half warp per 256-byte row at hd128). Rows >= Sq are still never written.
// Those stores need 16-byte aligned output rows: the binding allocates out like q, whose rows it
// checks to be 16-byte aligned (binding.cpp check_qkv); a caller-provided output must be as well.
#pragma once

#include <cstdint>

#include "../common/smem.cuh"
#include "mainloop.hpp"
#include "numerics.hpp"
#include "softmax.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

// epilogue_staged's shared-memory tile: per consumer warp its 16 output rows x D 16-bit values,
// in 16-byte chunks (8 values). The region is smem_o_sum's place (after the barriers): with
// smem_o_every it is O's fp32 sum itself, which the warp has read back into registers by then,
// else the launch adds kBytes there (kernel_fwd.cuh fwd_smem_bytes). The warp's chunks are the
// slots smem_o_sum gives its own 32 threads: piece i (i < kPieces) holds 32 consecutive chunks at
// float4 index i * kConsumerThreads + 32 * warp, so no warp touches another's bytes (only
// __syncwarp between the steps) and the fp32 sum needs only its own threads' reads done.
// Within a piece row r takes kChunks consecutive chunks, chunk c stored at position c ^ (r & 7):
// the eight rows of one stmatrix 8x8 matrix (same c, r = 0..7) land in eight different bank
// groups, and the copy-out reads each piece as 512 contiguous bytes (both conflict-free).
template <int D, int kWGs>
struct StagedOut {
  static constexpr int kConsumerThreads = CtaShape<kWGs>::kConsumerThreads;
  static constexpr int kChunks = D / 8;               // 16-byte chunks of one output row
  static constexpr int kWarpRows = kRowsPerWG / 4;    // rows of one consumer warp (wgmma m64)
  static constexpr int kRowsPerPiece = 32 / kChunks;  // a piece is one chunk per lane of the warp
  static constexpr int kPieces = kWarpRows / kRowsPerPiece;
  static constexpr int kBytes = kPieces * kConsumerThreads * 16 + kSmemOSumAlign;  // + alignment pad
  static_assert(kChunks >= 8 && 32 % kChunks == 0 && kWarpRows % kRowsPerPiece == 0, "D in {64, 128}");
  static_assert(kBytes <= kSmemOSumBytes<D, kWGs>, "the staged tile fits in smem_o_every's fp32 sum");
  static_assert((kRowsPerPiece & (kRowsPerPiece - 1)) == 0 && kRowsPerPiece <= 8, "a power of 2 up to 8");

  // float4 index of chunk c of warp row r, relative to the warp's first chunk (32 * warp), given
  // r & 7 as `r7`: c ^ r7, spelled so that a compile-time c keeps its bits above 3 an immediate.
  __device__ __forceinline__ static int slot(int r, int c, int r7) {
    return r / kRowsPerPiece * kConsumerThreads + r % kRowsPerPiece * kChunks + (c & ~7) + ((c & 7) ^ r7);
  }
};
// A 16-bit V (pv_16bit: no smem_o_every) has no O sum: TileConfig leaves this tile's room instead.
static_assert(StagedOut<128, 2>::kBytes == TileConfig<128, 2, 0, kBlockKV, cute::bfloat16_t>::kSmemAfterBarriers &&
                  StagedOut<64, 3>::kBytes == TileConfig<64, 3, 0, kBlockKV, cute::half_t>::kSmemAfterBarriers &&
                  StagedOut<128, 3>::kBytes == TileConfig<128, 3, 0, kBlockKV, cute::bfloat16_t>::kSmemAfterBarriers,
              "TileConfig sizes a 16-bit V's ring to leave the staged epilogue's room");

// Four 8x8 16-bit matrices from registers to shared memory: lane 8m + i gives the address of row i
// of matrix m; register m of lane 4i + t holds row i, columns 2t and 2t + 1 of matrix m (the low
// half the lower column), the accumulator layout of the wgmma fragments.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// 16 bytes from shared memory; volatile with a memory clobber, so it stays after the stmatrix.
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// stage: kStaged's tile region (smem_o_sum's place), unused without kStaged. o: the PV accumulator
// (TileConfig kPVRegs); with Softmax::kTcSum (tc_row_sum) its values D/2 + 2x hold row half x's
// whole sum of P~ (the ones columns), else the softmax's partial sums are quad-reduced here.
template <int D, DType kOut, bool kCausal, bool kSummary, bool kStaged, int kWGs, class Softmax>
__device__ __forceinline__ void epilogue_store(const FwdParams& p, const Softmax& sm,
                                               const float (&o)[D / 2 + (Softmax::kTcSum ? 4 : 0)],
                                               const int (&row)[2], int b, int h, int hk, const float4* stage) {
  // l holds 448 * sum(p): the lean softmax sums P~ = 448 p, and so do the ones columns (pv_16bit:
  // P~ = p, l = sum(p) in every loop). kVScaled: V's channel scales (a 16-bit V has none)
  constexpr bool kL448 = !Softmax::kP16 && (Softmax::kLean || Softmax::kTcSum);
  constexpr bool kVScaled = !Softmax::kP16;
  const int t = threadIdx.x & 3;
  const int64_t bh = static_cast<int64_t>(b) * p.Hq + h;
  float l[2], inv[2];
  bool bad[2];
  int last_key[2];  // the last key each row may see (v_first holds attended keys only)
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    l[x] = Softmax::kTcSum ? o[D / 2 + 2 * x] : quad_sum(sm.l[x]);
    bad[x] = l[x] > 0.f && isnan(sm.rowf[x]);  // rowf = sq * scale * log2(e): NaN exactly when sq is
    inv[x] = l[x] > 0.f ? 1.f / (kL448 ? l[x] : Softmax::kPScale * l[x]) : 0.f;
    inv[x] = bad[x] ? __int_as_float(0x7fffffff) : inv[x];  // NaN * anything = NaN
    last_key[x] = kCausal ? min(row[x], p.Skv - 1) : p.Skv - 1;
  }
  const int* v_first = p.v_first + static_cast<int64_t>(b * p.Hkv + hk) * static_cast<int>(NonFinite::kCount) * D;
  const float* sv = p.sv + static_cast<int64_t>(b * p.Hkv + hk) * D;
  // V's scales of channels col, col + 1 (1 without: the multiplies fold away)
  auto v_scale = [&](int col) {
    return kVScaled ? *reinterpret_cast<const float2*>(sv + col) : make_float2(1.f, 1.f);
  };
  char* ob = static_cast<char*>(p.out) + 2 * (b * p.o_sb + h * p.o_sh);
  // fix(c, x, k): the output value of channel c for a row that sees keys <= k
  auto store = [&](auto&& fix) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int col = 8 * j + 2 * t;
      const float2 s = v_scale(col);
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
  // kSummary: whether no row of this warp reaches V's first non-finite element (p.v_summary), so no
  // lookup can find one; warp-uniform (last_key differs per row only when causal)
  auto warp_clean = [&] {
    const int first_bad = p.v_summary[b * p.Hkv + hk];
    return __all_sync(0xffffffffu, first_bad > max(last_key[0], last_key[1]));
  };
  if constexpr (kStaged) {
    // Every sv value this thread needs first (nothing stored yet, so nothing for them to wait on).
    float2 s[D / 8];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) s[j] = v_scale(8 * j + 2 * t);
    // packed[j][x]: columns 8j + 2t + {0, 1} of row x, the same expressions as store()'s (the
    // padding rows >= Sq are computed too, and never stored)
    uint32_t packed[D / 8][2];
    auto pack_all = [&](auto&& fix) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const int col = 8 * j + 2 * t;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float o0 = fix(col, o[4 * j + 2 * x] * s[j].x * inv[x], last_key[x]);
          const float o1 = fix(col + 1, o[4 * j + 2 * x + 1] * s[j].y * inv[x], last_key[x]);
          packed[j][x] = IO<kOut>::pack2(o0, o1);
        }
      }
    };
    bool lookup_needed = true;
    if constexpr (kSummary) lookup_needed = !warp_clean();
    if (lookup_needed) {
      pack_all(lookup);
    } else {
      pack_all([](int, float x, int) { return x; });
    }
    using SO = StagedOut<D, kWGs>;
    const int lane = threadIdx.x & 31;
    const uint32_t warp_tile = sage_common::smem_addr(stage + 32 * (threadIdx.x / 32));
    // smem_o_every: every lane of the warp has read its fp32 sum (its slots are the tile's)
    __syncwarp();
    {
      // stmatrix j / 2: matrices (rows 0-7, chunk j), (rows 8-15, chunk j), (0-7, j + 1), (8-15, j + 1);
      // this lane addresses row i of matrix m
      const int m = lane >> 3, i = lane & 7;
      // chunk j + (m >> 1) of row r = i + 8 (m & 1) (j even): slot(r, 0, 0) + (j & ~7) + ((j & 7) ^ w),
      // four lane addresses (j & 7 in {0, 2, 4, 6}) and immediate offsets for the rest
      const int w = (m >> 1) ^ i;
      const uint32_t row_base = warp_tile + 16 * SO::slot(i + 8 * (m & 1), 0, 0);
#pragma unroll
      for (int j = 0; j < D / 8; j += 2) {
        const uint32_t addr = row_base + 16 * ((j & 7) ^ w) + 16 * (j & ~7);
        stmatrix_x4(addr, packed[j][0], packed[j][1], packed[j + 1][0], packed[j + 1][1]);
      }
    }
    __syncwarp();
    {
      // piece i: chunk q = lane % kChunks of warp row i * kRowsPerPiece + lane / kChunks, read all
      // first (one shared-memory round trip), then stored where the row is real
      const int q = lane % SO::kChunks, r_lane = lane / SO::kChunks;
      uint4 v[SO::kPieces];
#pragma unroll
      for (int i = 0; i < SO::kPieces; ++i) {
        // (i * kRowsPerPiece + r_lane) & 7 without the add: r_lane < kRowsPerPiece, a power of 2
        const int r7 = ((i * SO::kRowsPerPiece) & 7) | r_lane;
        v[i] = lds128(warp_tile + 16 * SO::slot(i * SO::kRowsPerPiece + r_lane, q, r7));
      }
      const int row_lane = row[0] - (lane >> 2) + r_lane;  // the warp's first row + r_lane
      const int rows_left = p.Sq - row_lane;                // piece i is real while i * kRowsPerPiece < this
      char* dst = ob + 2 * (row_lane * p.o_ss + 8 * q);
      const int64_t piece_bytes = 2 * SO::kRowsPerPiece * p.o_ss;
#pragma unroll
      for (int i = 0; i < SO::kPieces; ++i) {
        if (i * SO::kRowsPerPiece < rows_left) *reinterpret_cast<uint4*>(dst) = v[i];
        dst += piece_bytes;
      }
    }
    // the region is read by other lanes above: no later write of it may overtake them (none follows
    // since `persistent`, whose next work tile wrote it, was deleted; kept, as the shipped SASS has it)
    __syncwarp();
  } else if constexpr (kSummary) {
    // warp-uniform, so each warp runs one of the two loops
    if (warp_clean()) {
      // no lookup, and each row's address computed once: the stores take immediate offsets
      // (store()'s per-store 64-bit address arithmetic and branch go; same values and bytes)
      uint32_t* orow[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) orow[x] = reinterpret_cast<uint32_t*>(ob + 2 * (row[x] * p.o_ss + 2 * t));
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float2 s = v_scale(8 * j + 2 * t);
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
                                           (kL448 ? 6.1047932324f : 0.f)  // ln 448
                                     : -INFINITY;
        p.lse[bh * p.Sq + row[x]] = bad[x] ? __int_as_float(0x7fffffff) : lse;
      }
    }
  }
}

}  // namespace sage_sm90
