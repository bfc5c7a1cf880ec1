// Main loop of the emulated atom with EmuGemm::kWgmma (sm_90a): FA3-style warp specialization
// over K / V^T tiles that a pre-pass decoded once per head (kv_images_sm90.cuh).
//
// CTA = 128 query rows (one Q smoothing block) = 2 consumer warpgroups x 64 rows + 1 producer
// warpgroup. Consumer warp w (0..7) is warp w % 4 of warpgroup w / 4 and owns rows 16w .. 16w + 15,
// the rows of the mma.sync path, so masks, softmax and epilogue are shared with it.
//
//   producer (warps 8..11): lane 0 of warp 8 bulk-copies the decoded K image of each tile into a
//     kStagesK ring, lane 0 of warp 9 the V^T image into a kStagesV ring (cp.async.bulk, one per
//     tile; full_k / full_v count the bytes): separate rings, so K runs ahead of V (each slot is
//     refilled as soon as the 8 consumer warps released it: K after the softmax that reads its
//     correction, V after its P.V). All 128 threads, per tile: the smoothing correction
//     qbar . deq(K_n) of the tile's 128 key columns on the tensor cores (mma.sync m16n8k16: qbar
//     split into kQbarTerms 16-bit rows, K B fragments by ldmatrix from the image; warp w' takes
//     columns 32w'..32w'+31), pre-multiplied by scale * log2(e), and the key-valid bits, beside
//     the K slot; then arrive on ready[s].
//   consumers: S = Q K^T as wgmma m64n128k16 SS (Q decoded once into shared memory); masks,
//     online softmax and P~ quantization in registers; O += P~ V as wgmma m64nDk16 RS with P~ as
//     the A fragments (the S accumulator of n-tiles 2ks, 2ks + 1 is the A fragment of k16 step ks;
//     V^T's key order, vt_position_key, makes that hold). Per tile: [O *= f_t; issue Q K_{t+1}^T and
//     P~_t V_t] -> wait -> release t -> softmax / quantization of t + 1.
//     The two-level factor s1 is folded into O's running scale: O = g O' with O' accumulating
//     P~ / s1 products directly, f_t = alpha_t g_{t-1} / s1_t, g_t = s1_t (no second accumulator).
//   kPingPong: the two consumer warpgroups take turns issuing their wgmmas (named barriers), so
//     one warpgroup's softmax overlaps the other's GEMMs (FA3's inter-warpgroup schedule).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "../common/sm90/named_barrier.cuh"
#include "../common/sm90/pipeline.cuh"
#include "../common/sm90/register_split.cuh"
#include "../common/sm90/wgmma.cuh"
#include "fp4_api.h"
#include "fp4_format.cuh"
#include "kv_images_sm90.cuh"
#include "mainloop.cuh"
#include "softmax_pquant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

template <int kHeadDim, Fp4Format F>
struct WgmmaConfig {
  static constexpr bool kBf16 = F == Fp4Format::kMxfp4;  // the emulated atom's decoded type
  using Elem = std::conditional_t<kBf16, cute::bfloat16_t, cute::half_t>;
  static constexpr int kRowsPerWg = 64;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup
  static_assert(kBlockM == 2 * kRowsPerWg && kThreads == 384, "two consumer warpgroups of 64 rows");
  // Register split (setmaxnreg): 384 threads launch with 168 registers each; the producer gives
  // part of its share to the consumers: 128 * 72 + 256 * 216 = 64512 = 384 * 168 (ptxas: no
  // spills for NVFP4; 16 bytes for the MXFP4 D = 128 consumers, whose P~ takes the codes path).
  // 56 / 224 spills nothing but is slower for NVFP4 (the producer's corrections need the
  // registers); 40 / 232 spills in the producer.
  using RegSplit = sage_common::sm90::RegisterSplit<72, 216>;
  // Ring depths (a K or V^T tile is 32 KiB at D = 128, 16 KiB at D = 64). With one 2-deep ring
  // of K + V at D = 128 the copy of tile t + 1 left only the softmax of tile t to land.
  static constexpr int kStagesK = kHeadDim == 128 ? 3 : 4;
  static constexpr int kStagesV = kHeadDim == 128 ? 2 : 4;
  // 8 rows x 64 elements (128-byte rows, Swizzle<3,4,3>) tiled over each operand, K-major.
  using Atom = cute::GMMA::Layout_K_SW128_Atom<Elem>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kRowsPerWg>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStagesV>>{}));

  // Shared memory, from a 1024-byte aligned base: the Q tile (the prologue's 16-bit input rows,
  // then overwritten by the decoded Q of both warpgroups: the same size), the K and V^T rings,
  // qbar, q . k_mean per row, the corrections and key-valid bits per stage, the barriers.
  // D = 128: 32 + 96 + 64 + 11 KiB + 1 KiB alignment slack = 204 KiB.
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // one decoded K or V^T tile
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + kStagesK * kTileBytes;
  static constexpr int kOffQbar = kOffV + kStagesV * kTileBytes;
  static constexpr int kOffQkMean = kOffQbar + kHeadDim * 4;
  static constexpr int kOffBias = kOffQkMean + kBlockM * 4;
  static constexpr int kOffValid = kOffBias + kStagesK * kBlockN * 4;
  static constexpr int kOffQa = kOffValid + kStagesK * (kBlockN / 32) * 4;  // producer's qbar A fragments
  static constexpr int kQaWords = kHeadDim / 16 * 2;  // per producer thread
  static constexpr int kOffBarriers = kOffQa + 128 * kQaWords * 4;
  static constexpr int kSmemBytes = kOffBarriers + (3 * kStagesK + 2 * kStagesV) * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of sm_90");
  static_assert(kQBytes % 1024 == 0 && kTileBytes % 1024 == 0, "GMMA tiles on the 1024-byte swizzle period");
  static_assert(cute::cosize(SmemLayoutQ{}) * 2 * 2 == kQBytes, "decoded Q fills the prologue's Q tile");
  static_assert(cute::cosize(SmemLayoutK{}) * 2 == kStagesK * kTileBytes, "K ring");
  static_assert(cute::cosize(SmemLayoutVt{}) * 2 == kStagesV * kTileBytes, "V^T ring");

  using Major = cute::GMMA::Major;
  using MmaQK = std::conditional_t<kBf16, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<Major::K, Major::K>,
                                   cute::SM90::GMMA::MMA_64x128x16_F32F16F16_SS<Major::K, Major::K>>;
  using MmaPV128 = std::conditional_t<kBf16, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<Major::K, Major::K>,
                                      cute::SM90::GMMA::MMA_64x128x16_F32F16F16_RS<Major::K, Major::K>>;
  using MmaPV64 = std::conditional_t<kBf16, cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<Major::K, Major::K>,
                                     cute::SM90::GMMA::MMA_64x64x16_F32F16F16_RS<Major::K, Major::K>>;
  using MmaPV = std::conditional_t<kHeadDim == 128, MmaPV128, MmaPV64>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(MmaQK{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(MmaPV{}));
  static constexpr int kSRegs = kRowsPerWg * kBlockN / 128;   // 64 fp32 per thread
  static constexpr int kORegs = kRowsPerWg * kHeadDim / 128;  // D / 2 fp32 per thread
};

using sage_common::sm90::fence_regs;
using sage_common::sm90::fence_view_async_shared;
using sage_common::sm90::named_barrier_arrive;
using sage_common::sm90::named_barrier_sync;
using sage_common::sm90::TxBarrier;
using sage_common::sm90::wgmma_rs;
using sage_common::sm90::wgmma_ss;

// Named barriers (0 is __syncthreads): 1 the consumers' own, 2 / 3 "warpgroup 0 / 1 may issue its
// wgmmas" (kPingPong), 4 "qbar is in shared memory" (consumers arrive, producers wait).
constexpr int kBarConsumers = 1;
constexpr int kBarSchedBase = 2;
constexpr int kBarQbar = 4;
struct ConsumerSync {
  __device__ __forceinline__ void operator()() const { named_barrier_sync<256>(kBarConsumers); }
};

// Shared-memory pieces on the 1024-aligned base.
template <int kHeadDim, Fp4Format F>
struct WgmmaSmem {
  using W = WgmmaConfig<kHeadDim, F>;
  using Elem = typename W::Elem;
  uint8_t* base;
  __device__ __forceinline__ Elem* q(int wg) const {
    return reinterpret_cast<Elem*>(base) + wg * cute::cosize(typename W::SmemLayoutQ{});
  }
  __device__ __forceinline__ Elem* k(int s = 0) const {
    return reinterpret_cast<Elem*>(base + W::kOffK + s * W::kTileBytes);
  }
  __device__ __forceinline__ Elem* vt(int s = 0) const {
    return reinterpret_cast<Elem*>(base + W::kOffV + s * W::kTileBytes);
  }
  __device__ __forceinline__ float* qbar() const { return reinterpret_cast<float*>(base + W::kOffQbar); }
  __device__ __forceinline__ float* qk_mean() const { return reinterpret_cast<float*>(base + W::kOffQkMean); }
  __device__ __forceinline__ float* bias(int s) const {
    return reinterpret_cast<float*>(base + W::kOffBias) + s * kBlockN;
  }
  __device__ __forceinline__ uint32_t* valid(int s) const {
    return reinterpret_cast<uint32_t*>(base + W::kOffValid) + s * (kBlockN / 32);
  }
  // Producer thread i's qbar A fragments: uint4 j of thread i at j * 128 + i (conflict-free).
  __device__ __forceinline__ uint4* qa() const { return reinterpret_cast<uint4*>(base + W::kOffQa); }
  __device__ __forceinline__ uint64_t* full_k(int s) const {
    return reinterpret_cast<uint64_t*>(base + W::kOffBarriers) + s;
  }
  __device__ __forceinline__ uint64_t* empty_k(int s) const { return full_k(0) + W::kStagesK + s; }
  __device__ __forceinline__ uint64_t* ready(int s) const { return full_k(0) + 2 * W::kStagesK + s; }
  __device__ __forceinline__ uint64_t* full_v(int s) const { return full_k(0) + 3 * W::kStagesK + s; }
  __device__ __forceinline__ uint64_t* empty_v(int s) const { return full_v(0) + W::kStagesV + s; }

  __device__ __forceinline__ void init_barriers() const {
#pragma unroll
    for (int s = 0; s < W::kStagesK; ++s) {
      TxBarrier::init(full_k(s), 1);
      TxBarrier::init(empty_k(s), W::kConsumerThreads / 32);
      TxBarrier::init(ready(s), 128);
    }
#pragma unroll
    for (int s = 0; s < W::kStagesV; ++s) {
      TxBarrier::init(full_v(s), 1);
      TxBarrier::init(empty_v(s), W::kConsumerThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
};

// Rows g (elements 0, 1) and g + 8 (2, 3) of an m16n8-tiled accumulator times f[0] / f[1].
template <int N>
__device__ __forceinline__ void scale_rows(float (&acc)[N][4], const float (&f)[2]) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    acc[n][0] *= f[0];
    acc[n][1] *= f[0];
    acc[n][2] *= f[1];
    acc[n][3] *= f[1];
  }
}

// Each consumer warp writes its decoded Q fragments (AtomSm90Emulated::FragA, one per k64 chunk)
// into its warpgroup's Q tile in real k order: h[j][r] (j = 2h + q) holds row g + 8 (r & 1),
// columns 64c + 32h + 8t + 4q + 2 (r >> 1) + {0, 1} (mma_atoms.cuh). Call after every consumer is
// done reading the prologue's Q rows (they are overwritten).
template <class Atom, int kHeadDim>
__device__ __forceinline__ void store_q_decoded(const WgmmaSmem<kHeadDim, Atom::kFormat>& sm,
                                                const typename Atom::FragA (&qf)[kHeadDim / 64]) {
  using W = WgmmaConfig<kHeadDim, Atom::kFormat>;
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int g = lane >> 2, t = lane & 3;
  auto* q = sm.q(warp / 4);
#pragma unroll
  for (int c = 0; c < kHeadDim / 64; ++c) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * (warp % 4) + g + 8 * (r & 1);
        const int col = 64 * c + 32 * (j >> 1) + 8 * t + 4 * (j & 1) + 2 * (r >> 1);
        *reinterpret_cast<uint32_t*>(q + sw128_elem16_offset<W::kRowsPerWg, kHeadDim>(row, col)) = qf[c].h[j][r];
      }
    }
  }
}

// ---- producer warpgroup --------------------------------------------------------------------------
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  // Rows g + 8 of A (a1, a3) are zero: only rows < kQbarTerms carry qbar terms.
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(const void* row_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// Term i of x split into the atom's 16-bit type: x = term 0 + term 1 + ... (kQbarTerms of them;
// the same split as the mma.sync path's build_qbar_frags).
template <class Atom>
__device__ __forceinline__ float qbar_term(float x, int i) {
  float rest = x, term = 0.0f;
#pragma unroll
  for (int k = 0; k < Atom::kQbarTerms; ++k) {
    const float r = Atom::round_elem(rest);
    if (k == i) term = r;
    rest -= r;
  }
  return term;
}

// Producer warpgroup (threads 256..383). `k_img` / `v_img`: this kv head's tile images.
template <class Atom, int kHeadDim>
__device__ __forceinline__ void producer_wgmma(const FwdParams& p, const WgmmaSmem<kHeadDim, Atom::kFormat>& sm,
                                               int n_tiles, const uint16_t* k_img, const uint16_t* v_img) {
  using W = WgmmaConfig<kHeadDim, Atom::kFormat>;
  constexpr int kStagesK = W::kStagesK, kStagesV = W::kStagesV;
  const int ptid = static_cast<int>(threadIdx.x) - W::kConsumerThreads;
  const int pw = ptid >> 5, lane = ptid & 31, g = lane >> 2, t = lane & 3;
  constexpr int kTileElems = kBlockN * kHeadDim;
  auto issue_k = [&](int tile) {
    const int s = tile % kStagesK;
    TxBarrier::arrive_and_expect_tx(sm.full_k(s), W::kTileBytes);
    sage_common::sm90::bulk_copy_g2s(k_img + int64_t(tile) * kTileElems, sm.full_k(s), sm.k(s), W::kTileBytes);
  };
  auto issue_v = [&](int tile) {
    const int s = tile % kStagesV;
    TxBarrier::arrive_and_expect_tx(sm.full_v(s), W::kTileBytes);
    sage_common::sm90::bulk_copy_g2s(v_img + int64_t(tile) * kTileElems, sm.full_v(s), sm.vt(s), W::kTileBytes);
  };
  if (ptid == 0) {
    for (int tile = 0; tile < min(kStagesK, n_tiles); ++tile) issue_k(tile);
  } else if (ptid == 32) {
    for (int tile = 0; tile < min(kStagesV, n_tiles); ++tile) issue_v(tile);
  }
  named_barrier_sync<W::kThreads>(kBarQbar);  // the consumers' prologue wrote qbar

  // A fragments of the qbar terms (rows g < kQbarTerms), k16 step ks: a0 = (row g, k 16ks + 2t,
  // +1), a2 = (row g, k 16ks + 8 + 2t, +1).
  // Kept in shared memory (registers are scarce here): uint4 kk holds k16 steps 2kk, 2kk + 1.
  {
    const float* qbar = sm.qbar();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 32; ++kk) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // (step 2kk + i / 2, a0 / a2)
        const int d = 32 * kk + 16 * (i >> 1) + 8 * (i & 1) + 2 * t;
        w[i] = Atom::pack_pair(qbar_term<Atom>(qbar[d], g), qbar_term<Atom>(qbar[d + 1], g));
      }
      sm.qa()[kk * 128 + ptid] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  // The correction scaled by s_k only (scores_to_log2): the real score is s_k (s_q x + qbar . deq(Kq)).
  const int64_t bhk = int64_t(blockIdx.z) * p.Hkv + blockIdx.y / (p.Hq / p.Hkv);
  const float scale_log2 = p.scale * 1.4426950408889634f * p.k_scale[bhk];
  const uint8_t* key_mask_row = p.key_mask ? p.key_mask + int64_t(blockIdx.z) * p.Skv : nullptr;
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int s = tile % kStagesK;
    TxBarrier::wait(sm.full_k(s), (tile / kStagesK) & 1);
    const auto* kt = sm.k(s);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int n0 = 32 * pw + 8 * nt;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 32; ++kk) {
        // Matrix m = lane / 8: rows n0 .. n0 + 7, columns 32kk + 8m .. + 7: b0 / b1 of k16 steps
        // 2kk and 2kk + 1.
        uint32_t b[4];
        ldmatrix_x4(kt + sw128_elem16_offset<kBlockN, kHeadDim>(n0 + (lane & 7), 32 * kk + 8 * (lane >> 3)), b);
        const uint4 a = sm.qa()[kk * 128 + ptid];
        mma_m16n8k16<W::kBf16>(acc, a.x, a.y, b[0], b[1]);
        mma_m16n8k16<W::kBf16>(acc, a.z, a.w, b[2], b[3]);
      }
      // Sum the term rows g = 0..3 (rows >= kQbarTerms are zero) into the lanes g = 0.
      float c0 = acc[0], c1 = acc[1];
      c0 += __shfl_xor_sync(0xffffffffu, c0, 4);
      c1 += __shfl_xor_sync(0xffffffffu, c1, 4);
      c0 += __shfl_xor_sync(0xffffffffu, c0, 8);
      c1 += __shfl_xor_sync(0xffffffffu, c1, 8);
      if (g == 0) {
        *reinterpret_cast<float2*>(sm.bias(s) + n0 + 2 * t) = make_float2(c0 * scale_log2, c1 * scale_log2);
      }
    }
    key_valid_bits(sm.valid(s), tile, p.Skv, key_mask_row, ptid);
    TxBarrier::arrive(sm.ready(s));
    // Refill the slots of tile - 1 once all consumers released them (one lane per ring, so a
    // wait for V does not hold up the next K copy).
    if (tile >= 1) {
      if (ptid == 0 && tile - 1 + kStagesK < n_tiles) {
        TxBarrier::wait(sm.empty_k((tile - 1) % kStagesK), ((tile - 1) / kStagesK) & 1);
        issue_k(tile - 1 + kStagesK);
      } else if (ptid == 32 && tile - 1 + kStagesV < n_tiles) {
        TxBarrier::wait(sm.empty_v((tile - 1) % kStagesV), ((tile - 1) / kStagesV) & 1);
        issue_v(tile - 1 + kStagesV);
      }
    }
  }
}

// ---- consumer warpgroups -------------------------------------------------------------------------
// One consumer warpgroup's wgmma descriptors (CuTe builds them from the smem layouts).
template <int kHeadDim, Fp4Format F>
struct WgmmaOperands {
  using W = WgmmaConfig<kHeadDim, F>;
  using Elem = typename W::Elem;
  using TQ = sage_common::sm90::GmmaDescA<typename W::TiledMmaQK, typename W::SmemLayoutQ, Elem>;
  using TK = sage_common::sm90::GmmaDescB<typename W::TiledMmaQK, typename W::SmemLayoutK, Elem>;
  using TV = sage_common::sm90::GmmaDescB<typename W::TiledMmaPV, typename W::SmemLayoutVt, Elem>;
  TQ q;  // (1, 1, D / 16)
  TK k;  // (1, 1, D / 16, kStagesK)
  TV v;  // (1, 1, kBlockN / 16, kStagesV)

  __device__ __forceinline__ WgmmaOperands(const WgmmaSmem<kHeadDim, F>& sm, int wg, int tid_in_wg)
      : q(sage_common::sm90::gmma_desc_a<typename W::TiledMmaQK, typename W::SmemLayoutQ>(sm.q(wg), tid_in_wg)),
        k(sage_common::sm90::gmma_desc_b<typename W::TiledMmaQK, typename W::SmemLayoutK>(sm.k(), tid_in_wg)),
        v(sage_common::sm90::gmma_desc_b<typename W::TiledMmaPV, typename W::SmemLayoutVt>(sm.vt(), tid_in_wg)) {
    static_assert(cute::size<0>(TQ{}) == 1 && cute::size<1>(TQ{}) == 1 && cute::size<2>(TQ{}) == kHeadDim / 16,
                  "Q descriptors: one per k16 step");
    static_assert(cute::size<1>(TK{}) == 1 && cute::size<2>(TK{}) == kHeadDim / 16 &&
                      cute::size<3>(TK{}) == W::kStagesK,
                  "K descriptors: (k16 step, stage)");
    static_assert(cute::size<1>(TV{}) == 1 && cute::size<2>(TV{}) == kBlockN / 16 &&
                      cute::size<3>(TV{}) == W::kStagesV,
                  "V^T descriptors: (k16 step, stage)");
  }

  // S (64 x 128, fp32) = Q_wg K_s^T, one committed group (not waited for).
  __device__ __forceinline__ void qk_issue(int s, float (&acc)[kBlockN / 8][4]) const {
    fence_regs(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < kHeadDim / 16; ++kb) {
      wgmma_ss<typename W::MmaQK>(uint64_t(q(0, 0, kb)), uint64_t(k(0, 0, kb, s)), acc,
                                  kb == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                  std::make_index_sequence<W::kSRegs>{});
    }
    cute::warpgroup_commit_batch();
  }

  // o (64 x D, fp32) += P~ V_s with P~ in registers (pf[ks]: k16 step ks), one committed group.
  __device__ __forceinline__ void pv_issue(int s, uint32_t (&pf)[kBlockN / 16][4],
                                           float (&o)[kHeadDim / 8][4]) const {
    fence_regs(pf);
    fence_regs(o);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      wgmma_rs<typename W::MmaPV>(pf[ks], uint64_t(v(0, 0, ks, s)), o, cute::GMMA::ScaleOut::One,
                                  std::make_index_sequence<W::kORegs>{});
    }
    cute::warpgroup_commit_batch();
  }
};

// Consumers' tile loop. On entry the decoded Q tiles are visible to the async proxy. Returns O'
// in `o` and the running scale g per row (O = g O').
template <class Atom, int kHeadDim, bool kPingPong>
__device__ __forceinline__ void consumer_wgmma(const FwdParams& p, const WgmmaSmem<kHeadDim, Atom::kFormat>& sm,
                                               int n_tiles, int warp_row0, float (&o)[kHeadDim / 8][4],
                                               RowState& rs, float (&g_scale)[2]) {
  constexpr Fp4Format F = Atom::kFormat;
  using W = WgmmaConfig<kHeadDim, F>;
  constexpr int kStagesK = W::kStagesK, kStagesV = W::kStagesV;
  const int tid = static_cast<int>(threadIdx.x), wg = tid / 128, lane = tid & 31;
  const WgmmaOperands<kHeadDim, F> ops(sm, wg, tid % 128);
  // Score scale with both tensor scales (the corrections carry s_k only: scores_to_log2).
  const float s_k = p.k_scale[int64_t(blockIdx.z) * p.Hkv + blockIdx.y / (p.Hq / p.Hkv)];
  const float scale_log2 = p.scale * 1.4426950408889634f * s_k * p.q_scale[int64_t(blockIdx.z) * p.Hq + blockIdx.y];

  float s[kBlockN / 8][4];
  uint32_t pf[kBlockN / 16][4];
  float factor[2] = {1.0f, 1.0f};

  // Masks, softmax and P~ of tile `tile` (K slot st: its correction and key bits) from s into pf;
  // sets factor (O's rescale before this tile's P~ V is added) and g_scale.
  auto softmax_tile = [&](int tile, int st) {
    TileMask mk;
    mk.corr = sm.bias(st);
    mk.valid_bits = sm.valid(st);
    mk.key0 = tile * kBlockN;
    mk.row[0] = warp_row0 + (lane >> 2);
    mk.row[1] = mk.row[0] + 8;
    mk.causal = p.causal;
    const int key_end = (tile + 1) * kBlockN;
    mk.needed = p.key_mask != nullptr || key_end > p.Skv || (p.causal && key_end - 1 > warp_row0);
    scores_to_log2<true>(s, mk, scale_log2);
    float alpha[2], s1[2];
    if constexpr (F == Fp4Format::kNvfp4) {
      softmax_p_nvfp4_half(s, rs, p.p_quant, alpha, s1, pf);
    } else {
      typename Atom::FragA pa[kBlockN / kKeyChunk];
      softmax_quantize_p<Atom>(s, rs, p.p_quant, alpha, s1, pa);
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; ++r) pf[ks][r] = pa[ks / 4].h[ks % 4][r];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (s1[r] > 0.0f) {  // O_t = alpha g O'_{t-1} + s1 P~' V = s1 (f O'_{t-1} + P~' V)
        factor[r] = alpha[r] * g_scale[r] * fast_rcp(s1[r]);
        g_scale[r] = s1[r];
      } else {  // P~ of the row is all zero: O_t = alpha O_{t-1}
        factor[r] = 1.0f;
        g_scale[r] *= alpha[r];
      }
    }
  };
  auto release = [&](uint64_t* empty) {
    __syncwarp();
    if (lane == 0) TxBarrier::arrive(empty);
  };
  // kPingPong: each issue block is one turn (common/sm90/named_barrier.cuh).
  const sage_common::sm90::WarpgroupPingPong<kPingPong, kBarSchedBase, W::kConsumerThreads> sched{wg};
  auto turn_begin = [&] { sched.begin(); };
  auto turn_end = [&](bool last) { sched.end(last); };
  sched.start();
  if (n_tiles <= 0) {
    turn_begin();
    turn_end(true);
    return;
  }
  TxBarrier::wait(sm.ready(0), 0);
  turn_begin();
  ops.qk_issue(0, s);
  turn_end(false);
  cute::warpgroup_wait<0>();
  fence_regs(s);
  softmax_tile(0, 0);
  release(sm.empty_k(0));  // K tile 0, its correction and bits are no longer read
  // Iteration `tile`: O *= factor_tile; issue Q K_{tile+1}^T and P~_tile V_tile; wait; softmax of
  // tile + 1. (Running that softmax while P~_tile V_tile is still in flight, FA3's intra-warpgroup
  // overlap, needs a second P~ array: ptxas then serializes the wgmmas at this register budget;
  // the timing is in eval/results/fp4_emu_speed_h200.md.)
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int sv = tile % kStagesV;
    const bool more = tile + 1 < n_tiles;
    const int sk_next = (tile + 1) % kStagesK;
    if (more) TxBarrier::wait(sm.ready(sk_next), ((tile + 1) / kStagesK) & 1);
    TxBarrier::wait(sm.full_v(sv), (tile / kStagesV) & 1);
    scale_rows(o, factor);
    turn_begin();
    if (more) ops.qk_issue(sk_next, s);
    ops.pv_issue(sv, pf, o);
    turn_end(!more);
    cute::warpgroup_wait<0>();
    fence_regs(o);
    fence_regs(pf);
    fence_regs(s);
    release(sm.empty_v(sv));
    if (more) {
      softmax_tile(tile + 1, sk_next);
      release(sm.empty_k(sk_next));
    }
  }
}

}  // namespace sage_fp4
