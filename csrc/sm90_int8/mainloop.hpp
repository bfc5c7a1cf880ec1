// Data movement and tensor-core work of the attention mainloop.
//
// Producer (one elected lane of the warp after the consumers): bulk-copies the Q tiles of a work
// tile (one per consumer warpgroup: 128 or 192 query rows of one (b, h), tile_config.hpp CtaShape),
// then each K
// and V^T tile of its kv loop into a kStages-deep ring. Every tile is a pre-swizzled image written
// by the pre-pass, so one cp.async.bulk per operand per tile suffices (no tensor maps).
//   full[s]  : count 1 (producer's arrive.expect_tx) + the copies' transaction bytes
//   empty[s] : count 8 or 12 (lane 0 of each consumer warp, after its PV wgmma retired)
//   q_full   : count 1 + Q bytes; one phase (phase 0: a CTA runs one work tile)
// Phase rule: common/sm90/pipeline.cuh.
//
// Consumers (two or three warpgroups, 64 query rows each): S = Q K^T with INT8 SS wgmma, softmax in
// registers, O += P V^T with FP8 RS wgmma (FwdOptions::pv_16bit: O += P V with a 16-bit RS wgmma on
// V's 16-bit MN-major image). The wgmma descriptors come from CuTe's smem layouts
// (tile_config.hpp); accumulators are plain register arrays handed to the atoms.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "../common/smem.cuh"
#include "../common/sm90/pipeline.cuh"
#include "../common/sm90/wgmma.cuh"
#include "numerics.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

using Barrier = sage_common::sm90::TxBarrier;
using sage_common::sm90::fence_regs;
using sage_common::sm90::wgmma_rs;
using sage_common::sm90::wgmma_ss;

// kWGs: consumer warpgroups of the CTA (CtaShape), one Q tile each. kSumCols: TileConfig's ones
// rows after each V^T stage (tc_row_sum). kKeys: keys per tile (long_tile: 192). VElem: V's element
// type in smem (TileConfig's: FP8, or pv_16bit's bf16 / fp16).
template <int D, int kWGs = 2, int kSumCols = 0, int kKeys = kBlockKV, class VElem = cute::float_e4m3_t>
struct SmemPlan {
  using C = TileConfig<D, kWGs, kSumCols, kKeys, VElem>;
  uint8_t* q;   // kWGs tiles of kQTileBytes
  uint8_t* k;   // kStages tiles of kKTileBytes
  uint8_t* v;   // kStages stages of kVStageBytes (V^T: the kVTileBytes image, then kSumCols rows of ones)
  uint64_t* full;
  uint64_t* empty;
  uint64_t* q_full;

  __device__ __forceinline__ explicit SmemPlan(uint8_t* raw) {
    q = raw + sage_common::smem_align_pad<1024>(sage_common::smem_addr(raw));  // tiles start on the swizzle period
    k = q + C::kSmemQ;
    v = k + C::kSmemK;
    full = reinterpret_cast<uint64_t*>(v + C::kSmemV);
    empty = full + C::kStages;
    q_full = empty + C::kStages;
  }
};

// smem_o_every's fp32 sum of O (kBlockM x D floats), after the barriers, 16-byte aligned; the
// launch adds kSmemOSumBytes to the CTA's shared memory (kernel_fwd.cuh fwd_smem_bytes).
constexpr int kSmemOSumAlign = 16;
// (tc_row_sum: D + kSumCols columns, the row sums too.)
template <int D, int kWGs, int kSumCols = 0>
constexpr int kSmemOSumBytes = CtaShape<kWGs>::kBlockM * (D + kSumCols) * 4 + kSmemOSumAlign;
static_assert(kSmemOSumBytes<128, 3> == TileConfig<128, 3>::kSmemAfterBarriers &&
                  kSmemOSumBytes<64, 2> == TileConfig<64, 2>::kSmemAfterBarriers &&
                  kSmemOSumBytes<128, 3, 8> == TileConfig<128, 3, 8>::kSmemAfterBarriers,
              "TileConfig sizes its K/V ring to leave the O sum's room");
template <int D, int kWGs, int kSumCols, int kKeys, class VElem>
__device__ __forceinline__ float4* smem_o_sum(const SmemPlan<D, kWGs, kSumCols, kKeys, VElem>& sp) {
  uint8_t* end = reinterpret_cast<uint8_t*>(sp.q_full + 1);
  return reinterpret_cast<float4*>(end + sage_common::smem_align_pad<kSmemOSumAlign>(sage_common::smem_addr(end)));
}

// tc_row_sum: every thread writes its share of the ones rows (fp8 1.0 = 0x38) after each V^T stage's
// image, before init_barriers' __syncthreads; the fence makes these generic-proxy stores visible to
// the wgmmas (async proxy) that read them. The producer's copies never touch them.
template <int D, int kWGs, int kSumCols, int kKeys, class VElem>
__device__ __forceinline__ void fill_sum_rows(const SmemPlan<D, kWGs, kSumCols, kKeys, VElem>& sp) {
  if constexpr (kSumCols > 0) {
    using C = TileConfig<D, kWGs, kSumCols, kKeys, VElem>;
    // the ones rows after each chunk's image rows (one chunk per stage but with long_tile's three)
    constexpr int kChunks = kSumCols * C::kVChunkKeys / 16;  // 16-byte pieces per chunk
    for (int i = threadIdx.x; i < C::kStages * C::kVChunks * kChunks; i += blockDim.x) {
      const int chunk = i / kChunks;  // stage chunk / kVChunks, chunk % kVChunks
      uint8_t* ones = sp.v + (chunk / C::kVChunks) * C::kVStageBytes + (chunk % C::kVChunks) * C::kVChunkBytes +
                      C::kVChunkImageBytes;
      *reinterpret_cast<uint4*>(ones + 16 * (i % kChunks)) = make_uint4(0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u);
    }
    sage_common::sm90::fence_view_async_shared();
  }
}

template <int D, int kWGs, int kSumCols, int kKeys, class VElem>
__device__ __forceinline__ void init_barriers(const SmemPlan<D, kWGs, kSumCols, kKeys, VElem>& sp) {
  constexpr int kConsumerWarps = CtaShape<kWGs>::kConsumerThreads / 32;  // every one arrives
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < TileConfig<D, kWGs, kSumCols, kKeys, VElem>::kStages; ++s) {
      Barrier::init(&sp.full[s], 1);
      Barrier::init(&sp.empty[s], kConsumerWarps);
    }
    Barrier::init(sp.q_full, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// The run of wholly masked key tiles [lo, lo + n) a work tile's loop skips (kernel_fwd.cuh
// masked_run; n = 0: none): loop step i visits key tile key_tile(i), in the producer's copies and
// the consumers' K scales and mask words alike.
struct SkippedTiles {
  int lo, n;
  __device__ __forceinline__ int key_tile(int i) const { return i < lo ? i : i + n; }
};

// Stage and use count (n) of item `tile` of the K/V ring. kWGs: the CTA's consumer warpgroups (the
// ring depth depends on them: TileConfig::kStages); kSumCols, kKeys: TileConfig's.
template <int D, int kWGs, int kSumCols = 0, int kKeys = kBlockKV, class VElem = cute::float_e4m3_t>
__device__ __forceinline__ void ring_slot(int tile, int& stage, int& n) {
  constexpr int kStages = TileConfig<D, kWGs, kSumCols, kKeys, VElem>::kStages;
  stage = tile % kStages;
  n = tile / kStages;
}

// The work tile's copies; runs on one lane only.
// long_tile: a tile's images are its three 64-key blocks' images, back to back in memory: one copy
// each for K and V^T all the same (k_src / v_src advance by whole tiles).
template <int D, int kWGs, int kSumCols, int kKeys, class VElem>
__device__ __forceinline__ void producer_loop(const SmemPlan<D, kWGs, kSumCols, kKeys, VElem>& sp, const int8_t* q_src,
                                              const int8_t* k_src, const uint8_t* v_src, int n_tiles,
                                              SkippedTiles skip) {
  using C = TileConfig<D, kWGs, kSumCols, kKeys, VElem>;  // kSmemQ: the Q tiles of every consumer warpgroup
  using sage_common::sm90::bulk_copy_g2s;
  Barrier::arrive_and_expect_tx(sp.q_full, C::kSmemQ);
  bulk_copy_g2s(q_src, sp.q_full, sp.q, C::kSmemQ);
  for (int t = 0; t < n_tiles; ++t) {
    int s, n;
    ring_slot<D, kWGs, kSumCols, kKeys, VElem>(t, s, n);
    if (n > 0) Barrier::wait(&sp.empty[s], (n - 1) & 1);
    Barrier::arrive_and_expect_tx(&sp.full[s], C::kKTileBytes + C::kVTileBytes);
    const int kt = skip.key_tile(t);
    bulk_copy_g2s(k_src + static_cast<int64_t>(kt) * C::kKTileBytes, &sp.full[s],
                  sp.k + s * C::kKTileBytes, C::kKTileBytes);
#pragma unroll
    for (int j = 0; j < C::kVCopies; ++j) {  // long_tile with ones rows: one copy per chunk, before its ones rows
      bulk_copy_g2s(v_src + static_cast<int64_t>(kt) * C::kVTileBytes + j * C::kVCopyBytes, &sp.full[s],
                    sp.v + s * C::kVStageBytes + j * C::kVChunkBytes, C::kVCopyBytes);
    }
  }
}

// Descriptor tensors of one consumer warpgroup (CuTe builds the GMMA descriptors). kWGs: the CTA's
// consumer warpgroups, which set the ring depth of the K / V^T layouts (TileConfig::kStages);
// kSumCols: the V^T stages' ones rows (PV's N = D + kSumCols); kKeys: keys per tile; VElem: V's
// element type (a 16-bit V: k-steps of 16 keys, C::kPVK).
template <int D, int kWGs = 2, int kSumCols = 0, int kKeys = kBlockKV, class VElem = cute::float_e4m3_t>
struct WarpgroupOperands {
  using C = TileConfig<D, kWGs, kSumCols, kKeys, VElem>;
  using TQ = sage_common::sm90::GmmaDescA<typename C::TiledMmaQK, typename C::SmemLayoutQ, int8_t>;
  using TK = sage_common::sm90::GmmaDescB<typename C::TiledMmaQK, typename C::SmemLayoutK, int8_t>;
  using TV = sage_common::sm90::GmmaDescB<typename C::TiledMmaPV, typename C::SmemLayoutVt, VElem>;
  TQ q;  // (1, 1, D/32)
  TK k;  // (1, 1, D/32, kStages)
  TV v;  // (1, 1, kKeys / kPVK, kStages)

  __device__ __forceinline__ WarpgroupOperands(const SmemPlan<D, kWGs, kSumCols, kKeys, VElem>& sp, int wg, int tid_in_wg)
      : q(sage_common::sm90::gmma_desc_a<typename C::TiledMmaQK, typename C::SmemLayoutQ>(
            reinterpret_cast<int8_t*>(sp.q + wg * C::kQTileBytes), tid_in_wg)),
        k(sage_common::sm90::gmma_desc_b<typename C::TiledMmaQK, typename C::SmemLayoutK>(
            reinterpret_cast<int8_t*>(sp.k), tid_in_wg)),
        v(sage_common::sm90::gmma_desc_b<typename C::TiledMmaPV, typename C::SmemLayoutVt>(
            reinterpret_cast<VElem*>(sp.v), tid_in_wg)) {
    static_assert(cute::size<0>(TQ{}) == 1 && cute::size<1>(TQ{}) == 1 && cute::size<2>(TQ{}) == D / 32,
                  "Q descriptors: one per 32-wide k-block");
    static_assert(cute::size<1>(TK{}) == 1 && cute::size<2>(TK{}) == D / 32 &&
                      cute::size<3>(TK{}) == C::kStages,
                  "K descriptors: (k-block, stage)");
    static_assert(cute::size<1>(TV{}) == 1 && cute::size<2>(TV{}) == kKeys / C::kPVK &&
                      cute::size<3>(TV{}) == C::kStages,
                  "V descriptors: (k-step, stage)");
  }

  // S(64 x 128, int32) = Q_wg K_s^T as one committed wgmma group (not waited for). `fence`:
  // issue wgmma.fence first (needed whenever registers the group uses were written since).
  // accumulate: the first k-block adds to s as it is (seeded_scores: s holds the bias bits) instead of
  // overwriting it.
  __device__ __forceinline__ void qk_issue(int stage, uint32_t (&s)[C::kSRegs], bool accumulate = false) const {
    fence_regs(s);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < D / 32; ++kb) {
      wgmma_ss<typename C::MmaQK>(uint64_t(q(0, 0, kb)), uint64_t(k(0, 0, kb, stage)), s,
                                  kb == 0 && !accumulate ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                  std::make_index_sequence<C::kSRegs>{});
    }
    cute::warpgroup_commit_batch();
  }

  // q_in_registers: this warpgroup's Q tile as the A fragments of the RS atom, read once from the
  // swizzled smem image. 8-bit A layout (as P's, tile_config.hpp): register 4kb + r, r =
  // (k+16 half) * 2 + (row half), holds row 16w + g + 8(r & 1), bytes 32kb + 16(r >> 1) + 4t + i;
  // 4 aligned bytes never straddle a 16-byte swizzle chunk.
  // The first column of register `reg` (= 4kb + r) of that layout for quad lane t (its row: 16w +
  // g + 8 * q_frag_row_half(reg)).
  __host__ __device__ static constexpr int q_frag_col(int reg, int t) {
    return 32 * (reg >> 2) + 16 * ((reg >> 1) & 1) + 4 * t;
  }
  __host__ __device__ static constexpr int q_frag_row_half(int reg) { return reg & 1; }

  __device__ __forceinline__ static void load_q_frag(const SmemPlan<D, kWGs, kSumCols, kKeys, VElem>& sp, int wg, int tid_in_wg,
                                                     uint32_t (&qf)[D / 8]) {
    const int lane = tid_in_wg & 31, g = lane >> 2, t = lane & 3;
    const uint8_t* tile = sp.q + wg * C::kQTileBytes;
#pragma unroll
    for (int reg = 0; reg < D / 8; ++reg) {
      const int row = 16 * (tid_in_wg / 32) + g + 8 * q_frag_row_half(reg);
      qf[reg] = *reinterpret_cast<const uint32_t*>(tile + sw_byte_offset<D>(row, q_frag_col(reg, t)));
    }
  }

  // S = Q K_s^T with Q from registers (q_in_registers): saves the 8 KB smem read of Q per tile and
  // warpgroup (a third of the QK operand traffic).
  __device__ __forceinline__ void qk_issue_rs(int stage, const uint32_t (&qf)[D / 8],
                                              uint32_t (&s)[C::kSRegs], bool accumulate = false) const {
    fence_regs(s);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < D / 32; ++kb) {
      wgmma_rs<typename C::MmaQKRS>(&qf[4 * kb], uint64_t(k(0, 0, kb, stage)), s,
                                    kb == 0 && !accumulate ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                    std::make_index_sequence<C::kSRegs>{});
    }
    cute::warpgroup_commit_batch();
  }

  // O(64 x D, fp32) += P(64 x 128, e4m3 registers) V_s as one committed group (not waited for);
  // with kSumCols also the row sums of P (columns D.., the ones rows: TileConfig kPVRegs). A 16-bit
  // V: P in the same 16-bit type (twice the registers), 16 keys per k-step, full fp32 accumulation.
  // zero_first: O = P V_s instead (the first k-step overwrites the accumulator): a key tile's
  // product from zero (fp32_pv_tiles), or the first tile after a flush to smem (smem_o_every). The FP8 wgmma adds each k-step into its accumulator at reduced
  // precision with truncation, so summing all key tiles inside the tensor core loses a share of
  // O that grows with the key count (eval/pv_accumulation_model.py); one tile from zero keeps
  // that error at one tile's worth, and the tiles are summed in fp32 registers.
  __device__ __forceinline__ void pv_issue(int stage, uint32_t (&p)[C::kPRegs], float (&o)[C::kPVRegs],
                                           bool fence, bool zero_first = false) const {
    fence_regs(p);
    fence_regs(o);
    if (fence) cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < kKeys / C::kPVK; ++kb) {
      wgmma_rs<typename C::MmaPV>(&p[4 * kb], uint64_t(v(0, 0, kb, stage)), o,
                                  zero_first && kb == 0 ? cute::GMMA::ScaleOut::Zero
                                                        : cute::GMMA::ScaleOut::One,
                                  std::make_index_sequence<C::kPVRegs>{});
    }
    cute::warpgroup_commit_batch();
  }

  // Issued and retired.
  __device__ __forceinline__ void qk(int stage, uint32_t (&s)[C::kSRegs]) const {
    qk_issue(stage, s);
    cute::warpgroup_wait<0>();
    fence_regs(s);
  }
  __device__ __forceinline__ void pv(int stage, uint32_t (&p)[C::kPRegs], float (&o)[C::kPVRegs],
                                     bool zero_first = false) const {
    pv_issue(stage, p, o, /*fence=*/true, zero_first);
    cute::warpgroup_wait<0>();
    fence_regs(o);
    fence_regs(p);
  }
};

}  // namespace sage_sm90
