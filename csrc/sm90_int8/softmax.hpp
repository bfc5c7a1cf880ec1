// Online softmax of one 64 x 128 score tile held in a warpgroup's wgmma accumulators, and the
// conversion of P~ into the FP8 A-operand registers of the PV wgmma (sage8 spec, step 5), or with
// FwdOptions::pv_16bit into 16-bit ones (P~ = p in the input dtype).
//
// Register convention (checked by host_layout_check.cu): thread lane = 4*g + t of warp w holds
// accumulator value v at row 16*w + g + 8*((v >> 1) & 1) and column 8*(v >> 2) + 2*t + (v & 1).
// Each thread therefore owns two rows ("halves" rr = 0, 1) and 32 key columns of each.
#pragma once

#include <cstdint>
#include <type_traits>

#include "numerics.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

using sage_common::chains_max;
using sage_common::chains_sum;
using sage_common::quad_max;
using sage_common::quad_sum;

// Which keys of the current tile a thread may see. Built once per tile; `active` is uniform per
// warpgroup so the common unmasked tile pays only one branch. kWords: the tile's keys / 32.
template <int kWords>
struct TileMaskOf {
  bool active;
  int key_base;       // first key of the tile
  int kv_len;         // keys >= kv_len are masked (sequence end or last attended key + 1)
  uint32_t words[kWords];  // key-mask bits of the tile's keys (all ones without a mask)
  bool causal;
  int row[2];         // query index of each half (for causal)

  // Scores of hidden keys -> -inf (accumulator value v of this thread is key column
  // 8 (v >> 2) + 2 t + (v & 1) of row half (v >> 1) & 1); nothing to do on unmasked tiles.
  template <int kN>
  __device__ __forceinline__ void apply(float (&s)[kN]) const {
    if (!active) return;
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int v = 0; v < kN; ++v) {
      const int col = 8 * (v >> 2) + 2 * t + (v & 1);
      const int key = key_base + col;
      bool ok = key < kv_len && ((words[col >> 5] >> (col & 31)) & 1u);
      if (causal) ok = ok && key <= row[(v >> 1) & 1];
      s[v] = ok ? s[v] : -INFINITY;
    }
  }
};
using TileMask = TileMaskOf<kBlockKV / 32>;

// A tile's K scales: one per K quantization block (TileConfig kScaleBlocks: 1, or 3 with long_tile).
template <int kBlocks>
struct TileKScales {
  float v[kBlocks];
  __device__ __forceinline__ float max() const {
    float m = v[0];
#pragma unroll
    for (int b = 1; b < kBlocks; ++b) m = fmaxf(m, v[b]);
    return m;
  }
};

// kLean_ (option lean_softmax): fewer instructions per score element, same algorithm.
//  * the int32 score keeps its 1.5*2^23 float bias through the max and goes straight into the
//    FFMA (the bias times c is folded into the per-row offset): no separate FADD;
//  * the 448 scale of P~ is folded into the exponent, exp2(x + log2 448) = 448 exp2(x) up to the
//    ex2.approx error: no FMUL. l then holds 448 * sum(p), which the epilogue divides back.
// The offset carries one fp32 rounding of (bias * c) per row and tile: a shift of the tile's
// exponents of <= ~c (c = sq sk scale log2e, ~1e-4 on N(0, 1) inputs), common to the whole row of
// the tile. That holds only while c is small: a warp's key tile whose c can be larger (large
// |q| |k|) runs the exact exponents, one FADD more per score (lean_scores, kFoldMaxC).
// kSplit_ (option split_reductions, with the lean softmax): the row max (and, in scores_lean,
// the row sum) of a tile as four independent chains of 8 values each (columns 8j.. grouped by
// j mod 4), combined at the end, instead of one dependent chain of 32: same max, sums rounded in
// another order.
// kTcSum_ (option tc_row_sum): the row sums come from the PV wgmma (columns of ones after V^T,
// tile_config.hpp kSumCols), as the sum of the E4M3 codes of P~ that O is weighted with, rescaled
// with O; the steps here add no p and l stays 0 (the epilogue reads the sums from the accumulator).
// kSeeded_ (option seeded_scores): S = Q K^T accumulated onto kScoreBiasBits (kernel_fwd.cuh seeds the
// registers before each QK wgmma), so each int32 value already is the bit pattern of the float
// 1.5 * 2^23 + s (|s| < 2^22: no carry out of the mantissa, no int32 overflow): the same integers as
// the convert add gives, without that add (biased_score).
// kKeys_ (option long_tile: 192): keys per tile; a 192-key tile holds three 64-key K blocks, each
// with its own scale, so c (and the folded offset) is per (K block, row half): value v belongs to K
// block (v >> 2) / kGroupsPerBlock. Lean steps only.
// P16_ (option pv_16bit: __nv_bfloat16 or __half, the input's type; void: FP8): P~ = p in [0, 1]
// packed into that type for a 16-bit PV wgmma, instead of 448 p into E4M3 (no 448 anywhere: l sums p
// in every loop); the row sums stay the softmax's (no kTcSum).
template <int kPolyEvery, bool kLean_ = false, bool kSplit_ = false, bool kTcSum_ = false, bool kSeeded_ = false,
          int kKeys_ = kBlockKV, class P16_ = void>
struct OnlineSoftmax {
  static constexpr bool kP16 = !std::is_void_v<P16_>;
  static_assert(!(kP16 && kTcSum_), "pv_16bit: the row sums from the softmax (FwdOptions::valid)");
  static constexpr float kPScale = kP16 ? 1.f : kFp8Max;  // P~ = kPScale p
  static constexpr bool kLean = kLean_;
  static constexpr bool kTcSum = kTcSum_;
  static constexpr int kChains = kSplit_ ? 4 : 1;
  static constexpr bool kSeeded = kSeeded_;
  static constexpr int kN = kKeys_ / 2;  // accumulator values per thread (64 rows x kKeys / 128 threads)
  static constexpr int kPRegs = kKeys_ / (kP16 ? 4 : 8);  // A-operand registers of P~ (TileConfig kPRegs)
  static constexpr int kSB = kKeys_ / kKBlockKeys<kKeys_>;  // K scales per tile (TileConfig kScaleBlocks)
  static constexpr int kGroupsPerBlock = kN / 4 / kSB;  // 8-column groups (v >> 2) per K block
  static_assert(kSB == 1 || kLean_, "per-block K scales: the lean steps only");
  static_assert(kGroupsPerBlock % kChains == 0, "a K block holds whole chains");
  using KScales = TileKScales<kSB>;
  using Mask = TileMaskOf<kKeys_ / 32>;
  // K block of accumulator value v (its column 8 (v >> 2) + ... over kKBlockKeys).
  __host__ __device__ static constexpr int block_of(int v) { return (v >> 2) / kGroupsPerBlock; }
  float m[2];       // running max of s (log2 domain), -inf before any unmasked key
  float l[2];       // this thread's partial row sums of unquantized p (quad-reduced at the end); with kTcSum
                    // unused, or the whole-row fp32 sums of the ones columns (kernel_fwd.cuh tile_sums)
  float rowf[2];    // sq_i * scale * log2(e) of each half

  // The bits of 1.5 * 2^23: an int32 score s plus these is the float 1.5 * 2^23 + s (|s| < 2^22).
  static constexpr uint32_t kScoreBiasBits = 0x4B400000u;
  // The float 1.5 * 2^23 + s of an accumulator value: its own bits with kSeeded_, else after the add.
  __device__ __forceinline__ static float biased_score(uint32_t acc) {
    if constexpr (kSeeded_) {
      return __uint_as_float(acc);
    } else {
      return __int_as_float(static_cast<int>(acc) + static_cast<int>(kScoreBiasBits));
    }
  }

  __device__ __forceinline__ void init(float rowf0, float rowf1) {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    rowf[0] = rowf0;
    rowf[1] = rowf1;
  }

  // Per-row score scale c = sq_i * scale * log2(e) * sk of each K block of the tile. c > 0 keeps
  // c * (-inf) = -inf; c only underflows to 0 when q or the K block is all zero, and then every int
  // product is 0.
  __device__ __forceinline__ void row_scale(const KScales& sk, float (&c)[kSB][2]) const {
#pragma unroll
    for (int b = 0; b < kSB; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) c[b][h] = fmaxf(rowf[h] * sk.v[b], 1.17549435e-38f);
    }
  }

  // This thread's max of each row half over each K block of the tile, in kChains independent chains.
  __device__ __forceinline__ static void tile_row_max(const float (&s)[kN], float (&mx)[kSB][2]) {
    float part[kSB][2][kChains];
#pragma unroll
    for (int b = 0; b < kSB; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < kChains; ++j) part[b][h][j] = -INFINITY;
      }
    }
#pragma unroll
    for (int v = 0; v < kN; ++v) {
      // value v: row half (v >> 1) & 1, K block block_of(v), chain (v >> 2) % kChains
      float& acc = part[block_of(v)][(v >> 1) & 1][(v >> 2) % kChains];
      acc = fmaxf(acc, s[v]);
    }
#pragma unroll
    for (int b = 0; b < kSB; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) mx[b][h] = chains_max(part[b][h]);
    }
  }

  // P~ (fp32, in [0, 448]) -> the FP8 A fragment of the PV wgmma. Register 4kb + r of k-block kb,
  // r = (k+16 half) * 2 + (row half); byte i of the register is k position 4t + i, i.e.
  // accumulator columns 2t + (i & 1) + 8 * (i >> 1) of 8-column group 4kb + 2*(r >> 1): values
  // v = 4 * (4kb + 2*(r>>1) + (i>>1)) + 2*(r&1) + (i&1). No shuffles (tile_config.hpp).
  // kP16: the 16-bit A fragment of k-step kb (16 keys) is the m16n8k16 one: register 4kb + r holds row
  // half r & 1, keys 16kb + 8 (r >> 1) + 2t + {0, 1}, i.e. accumulator values 8kb + 2r + {0, 1}: register
  // j packs values 2j, 2j + 1 (keys in their natural order: V needs no permutation; host_layout_check.cu).
  __device__ __forceinline__ static void pack_p_frag(const float (&s)[kN], uint32_t (&p_frag)[kPRegs]) {
    if constexpr (kP16) {
#pragma unroll
      for (int j = 0; j < kPRegs; ++j) p_frag[j] = sage_common::Elem16<P16_>::pack2(s[2 * j], s[2 * j + 1]);
    } else {
#pragma unroll
      for (int kb = 0; kb < kKeys_ / 32; ++kb) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int v0 = 4 * (4 * kb + 2 * (r >> 1)) + 2 * (r & 1);  // i = 0
          const uint32_t lo = pack_e4m3x2(s[v0], s[v0 + 1]);          // i = 0, 1
          const uint32_t hi = pack_e4m3x2(s[v0 + 4], s[v0 + 5]);      // i = 2, 3 (next 8 cols)
          p_frag[4 * kb + r] = lo | (hi << 16);
        }
      }
    }
  }

  // A tile's P~ between the softmax and its pack: fp32 values (448 p; kP16: p).
  using Scores = float[kN];

  // s_int: the int32 accumulator of q8 . k8^T. Writes the FP8 A fragment (4 registers per
  // 32-key k-block, see tile_config.hpp for why no shuffle is needed) and the per-half rescale
  // factors alpha for the output accumulator. exact (warp-uniform): the lean steps' exact
  // exponents (lean_scores), a whole second copy of the step behind one branch, so the folded
  // step's code stays one straight block.
  __device__ __forceinline__ void step(const uint32_t (&s_int)[kN], const KScales& sk_tile, const Mask& mk,
                                       uint32_t (&p_frag)[kPRegs], float (&alpha)[2], bool exact = false) {
    if (kLean && exact) {
      step_with<true>(s_int, sk_tile, mk, p_frag, alpha);
    } else {
      step_with<false>(s_int, sk_tile, mk, p_frag, alpha);
    }
  }
  template <bool kExact>
  __device__ __forceinline__ void step_with(const uint32_t (&s_int)[kN], const KScales& sk_tile, const Mask& mk,
                                            uint32_t (&p_frag)[kPRegs], float (&alpha)[2]) {
    Scores sc;
    scores_with<kExact>(s_int, sk_tile, mk, sc, alpha);
    pack(sc, p_frag);
  }

  // step's two halves: scores = max, exp2 and row sums (m, l and alpha updated), pack = the FP8 A
  // fragment.
  template <bool kExact>
  __device__ __forceinline__ void scores_with(const uint32_t (&s_int)[kN], const KScales& sk_tile, const Mask& mk,
                                              Scores& sc, float (&alpha)[2]) {
    if constexpr (kLean) {
      scores_lean<kExact>(s_int, sk_tile, mk, sc, alpha);
    } else {
      scores_plain(s_int, sk_tile, mk, sc, alpha);
    }
  }

  __device__ __forceinline__ static void pack(const Scores& sc, uint32_t (&p_frag)[kPRegs]) { pack_p_frag(sc, p_frag); }

  __device__ __forceinline__ void scores_plain(const uint32_t (&s_int)[kN], const KScales& sk_tile,
                                               const Mask& mk, float (&s)[kN], float (&alpha)[2]) {
#pragma unroll
    for (int v = 0; v < kN; ++v) {
      // Exact int32 -> fp32 without the conversion unit: |s| <= 127*127*128 < 2^22, so adding
      // the bits of 1.5*2^23 gives the float 1.5*2^23 + s, and one exact FADD removes the bias.
      s[v] = biased_score(s_int[v]) - 12582912.f;
    }
    mk.apply(s);
    static_assert(kSB == 1, "one K scale per tile");
    // s = int * c, c from row_scale
    float c[1][2], mx[1][2], muse[2];
    row_scale(sk_tile, c);
    tile_row_max(s, mx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // max commutes with the positive scale c (rounding is monotonic), so scale once.
      const float m_new = fmaxf(m[h], quad_max(mx[0][h]) * c[0][h]);
      muse[h] = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: p = 0, alpha = 0
      alpha[h] = exp2_mufu(m[h] - muse[h]);
      m[h] = m_new;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int v = 0; v < kN; ++v) {
      const int h = (v >> 1) & 1;
      const float x = fmaf(s[v], c[0][h], -muse[h]);
      float p;
      if constexpr (kPolyEvery > 0) {
        p = (v % kPolyEvery == kPolyEvery - 1) ? exp2_poly(x) : exp2_mufu(x);
      } else {
        p = exp2_mufu(x);
      }
      if constexpr (!kTcSum) sum[h] += p;
      s[v] = p * kPScale;  // exact fp32 multiply, in [0, 448] (kP16: p itself)
    }
    if constexpr (!kTcSum) {
      l[0] = l[0] * alpha[0] + sum[0];
      l[1] = l[1] * alpha[1] + sum[1];
    }
  }

  // Shared start of the lean steps: s = bias + int score (exact, |int| < 2^22), masks, row scale
  // c and max; updates m and alpha. The exponent of P~ is then x = int c - m + log2_gain, computed
  // by the caller per score as lean_x says:
  //  * kExact false (folded): x = s c - off, off = bias c + m - log2_gain per row: one FFMA. off's
  //    one fp32 rounding shifts x by up to 2^-24 |off| <= ~c (|off| <= (1.5 * 2^23 + 2^22) c + 9),
  //    common to the row's tile: at c <= kFoldMaxC = 2^-9 its weight moves by <= 0.14 %, below
  //    E4M3's averaged noise. c = sq sk scale log2(e) is ~1e-4 on N(0, 1) inputs, ~1e-3 on DiT
  //    activations; it grows with max|q| max|k| (at hd128 past 2^-9 once that exceeds ~62), and the
  //    shift with it (x1e4 inputs: shifts of thousands, garbage).
  //  * kExact true: x = (s - s_max) c + (m_tile - m) + log2_gain with the integer difference exact,
  //    so the tile's max key gets exactly log2_gain and the error is relative to |x| only: one FADD
  //    more per score. The kernel runs a tile's step this way when a c of the warp can exceed
  //    kFoldMaxC (kernel_fwd.cuh exact_exponents; step's exact branch).
  static constexpr float kFoldMaxC = 0x1p-9f;
  // Per K block b (kSB of them) and row half h.
  struct LeanRow {
    float c[kSB][2], off[kSB][2];   // folded: x = s c - off
    float base[kSB][2], add[kSB][2];  // exact: x = (s - base) c + add
  };
  __device__ __forceinline__ void lean_scores(const uint32_t (&s_int)[kN], const KScales& sk_tile, const Mask& mk,
                                              float log2_gain, float (&s)[kN], LeanRow& r, float (&alpha)[2]) {
    constexpr float kBias = 12582912.f;  // 1.5 * 2^23
#pragma unroll
    for (int v = 0; v < kN; ++v) s[v] = biased_score(s_int[v]);
    mk.apply(s);
    float mx[kSB][2];
    row_scale(sk_tile, r.c);
    tile_row_max(s, mx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_tile;
      float sb[kSB];  // kSB > 1: each K block's (thread-local) max, scaled
      if constexpr (kSB == 1) {
        const float tmax = quad_max(mx[0][h]);  // biased, or -inf: no visible key in this row's tile
        // (biased max - bias) is the exact integer max; -inf stays -inf.
        m_tile = (tmax - kBias) * r.c[0][h];
        mx[0][h] = tmax;
        sb[0] = m_tile;
      } else {
        // The K blocks have their own c: the row's tile max is the max over blocks (and the quad) of
        // each block's exact integer max times its c (max commutes with a positive scale's rounding).
        float mt = -INFINITY;
#pragma unroll
        for (int b = 0; b < kSB; ++b) {
          sb[b] = (mx[b][h] - kBias) * r.c[b][h];
          mt = fmaxf(mt, sb[b]);
        }
        m_tile = quad_max(mt);
      }
      const float m_new = fmaxf(m[h], m_tile);
      const float muse = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = exp2_mufu(m[h] - muse);
      m[h] = m_new;
#pragma unroll
      for (int b = 0; b < kSB; ++b) {
        r.off[b][h] = fmaf(kBias, r.c[b][h], muse - log2_gain);
        // exact: s - base is the exact integer difference (-inf where masked); a row tile without a
        // visible key has only -inf scores, whatever base and add are. With kSB > 1 base is the
        // thread's own block max (its key gets exactly sb - muse + log2_gain: the row's max key
        // exactly log2_gain, as with kSB = 1).
        const bool seen = mx[b][h] != -INFINITY;
        r.base[b][h] = seen ? mx[b][h] : kBias;
        r.add[b][h] = seen ? (sb[b] - muse) + log2_gain : 0.f;
      }
    }
  }
  template <bool kExact>
  __device__ __forceinline__ static float lean_x(float s, const LeanRow& r, int b, int h) {
    if constexpr (kExact) {
      return fmaf(s - r.base[b][h], r.c[b][h], r.add[b][h]);
    } else {
      return fmaf(s, r.c[b][h], -r.off[b][h]);
    }
  }

  template <bool kExact>
  __device__ __forceinline__ void scores_lean(const uint32_t (&s_int)[kN], const KScales& sk_tile,
                                              const Mask& mk, float (&s)[kN], float (&alpha)[2]) {
    // log2(448): x = s c - m + log2 448 (kP16: P~ = p, no gain)
    constexpr float kLog2Gain = kP16 ? 0.f : 8.8073549221f;
    LeanRow r;
    lean_scores(s_int, sk_tile, mk, kLog2Gain, s, r, alpha);
    float part_sum[2][kChains];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < kChains; ++j) part_sum[h][j] = 0.f;
    }
#pragma unroll
    for (int v = 0; v < kN; ++v) {
      const int h = (v >> 1) & 1;
      const float x = lean_x<kExact>(s[v], r, block_of(v), h);
      float p;
      if constexpr (kPolyEvery > 0) {
        p = (v % kPolyEvery == kPolyEvery - 1) ? exp2_poly(x) : exp2_mufu(x);
      } else {
        p = exp2_mufu(x);
      }
      if constexpr (!kTcSum) {
        float& acc = part_sum[h][(v >> 2) % kChains];
        acc += p;
      }
      s[v] = p;  // already P~ * 448 (cvt saturates the rare 448 * (1 + 1e-7); kP16: p, 1 + 1e-7 rounds to 1)
    }
    if constexpr (!kTcSum) {
      float sum[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) sum[h] = chains_sum(part_sum[h]);
      l[0] = l[0] * alpha[0] + sum[0];
      l[1] = l[1] * alpha[1] + sum[1];
    }
  }
};

}  // namespace sage_sm90
