// Main loop of the emulated atom with EmuGemm::kWgmma (sm_90a): the two GEMMs on Hopper warpgroup
// MMAs, FA3-style, on operands decoded once per CTA.
//
// CTA = 128 query rows = 2 warpgroups x 64 rows; warp w (0..7) is warp w % 4 of warpgroup w / 4 and
// owns rows 64 (w / 4) + 16 (w % 4) = 16 w .. 16 w + 15, the same rows as in the mma.sync path, so
// the softmax, P~ quantization and epilogue are shared unchanged.
//
//   decode (all 256 threads, once per tile): half the warps decode the K tile (a thread per stored
//     key row: E2M1 x scale -> fp16 / bf16, exact, and the smoothing correction qbar . deq(K) of
//     that row on the CUDA cores), the other half the V^T tile; into GMMA K-major SW128 tiles, two
//     buffers.
//   S = Q K^T: wgmma m64n128k16 SS (decoded Q of the warpgroup, written once after the prologue).
//     The accumulator of warp w is the m16n8 D layout tiled along N (CuTe CLayout_64xN: value
//     4j + e = row g + 8 (e >> 1), column 8j + 2t + (e & 1)), i.e. s[j][e] of the mma.sync path;
//     column n is stored key n (permuted in 64-key chunks by the pre-pass, tile_config.cuh).
//   O += P V: wgmma m64nDk16 RS. The A fragment of a warp for one k16 step is the mma.sync
//     m16n8k16 A fragment of its 16 rows (CuTe ALayout_64x16: registers a0..a3 = (row g, k 2t..+1),
//     (g+8, 2t..+1), (g, 2t+8..+9), (g+8, 2t+8..+9)), so k-step 4c + j takes AtomSm90Emulated's
//     FragA pf[c].h[j] as is. That fragment puts real key 64c + 32h + 8t + 4q + 2u + e (h, q: j =
//     2h + q) in slot 2t + 8u + e; V^T is therefore stored with its k position
//     kk = 32q' + 8p + 2t + e holding key 32q' + 8t + 2p + e (vt_position_key below; proven in
//     layout_model.py): 16-byte chunk p of a decoded 32-key group gathers decoded pair p of each of
//     its four raw words.
//   Schedule per tile i (one __syncthreads): issue QK(i) async -> cp.async of raw tile i + 2 ->
//     first half of the decode of tile i + 1 (overlaps the QK wgmma) -> wait QK -> masks, softmax,
//     P~ -> issue PV(i) -> second half of the decode (overlaps the PV wgmma) -> wait PV ->
//     O = O * alpha + s1 * PV (the per-row two-level factor s1 keeps PV in its own accumulator,
//     as the mma.sync path does).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "fp4_api.h"
#include "fp4_format.cuh"
#include "mainloop.cuh"
#include "softmax_pquant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

// Stored V^T column kk of a kBlockN tile -> real key (see the header comment).
__host__ __device__ __forceinline__ constexpr int vt_position_key(int kk) {
  // kk = 32 q' + 8 p + 2 t + e  ->  key = 32 q' + 8 t + 2 p + e
  return (kk & ~31) + ((kk >> 1) & 3) * 8 + ((kk >> 3) & 3) * 2 + (kk & 1);
}

template <int kHeadDim, Fp4Format F>
struct WgmmaConfig {
  using Cfg = FwdConfig<kHeadDim, F>;
  static constexpr bool kBf16 = F == Fp4Format::kMxfp4;  // the emulated atom's decoded type
  using Elem = std::conditional_t<kBf16, cute::bfloat16_t, cute::half_t>;
  static constexpr int kRowsPerWg = 64;
  static_assert(kBlockM == 2 * kRowsPerWg && kThreads == 256, "two consumer warpgroups of 64 rows");
  // 8 rows x 64 elements (128-byte rows, Swizzle<3,4,3>) tiled over each operand, K-major.
  using Atom = cute::GMMA::Layout_K_SW128_Atom<Elem>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kRowsPerWg>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<2>>{}));
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<2>>{}));
  static_assert(cute::cosize(SmemLayoutQ{}) * 2 * 2 == Cfg::kQTileBytes, "decoded Q fills the prologue's Q tile");
  static_assert(cute::cosize(SmemLayoutK{}) * 2 == 2 * Cfg::kWgmmaTileBytes, "two decoded K tiles");
  static_assert(cute::cosize(SmemLayoutVt{}) * 2 == 2 * Cfg::kWgmmaTileBytes, "two decoded V^T tiles");

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

// Element (row, col[, buffer]) of a GMMA-swizzled tile at `base` (1024-byte aligned), as CuTe
// (and so the wgmma descriptors) sees it. The GMMA::Layout_*_Atom swizzle acts on the byte
// address (CuTe moves it into the smem pointer); evaluating the layout alone would apply it to
// element indices. Reference for wgmma_layout_check.cu; the kernel uses gmma_sw128_offset.
template <class Layout, class Elem, class... Coord>
__host__ __device__ __forceinline__ Elem* tile_elem(Elem* base, Coord... coord) {
  auto tile = cute::make_tensor(cute::make_smem_ptr(base), Layout{});
  return &tile(coord...);
}

// The same address as an element offset, for 16-bit elements (wgmma_layout_check.cu proves the
// two equal for every coordinate of every tile here): K-major, 64-element (128-byte) rows in
// 8-row swizzle atoms stacked along the rows (kRows of them per 64-column block), 16-byte chunk
// c of row r stored at chunk c ^ (r % 8); buffer b of kRows x kCols tiles follows buffer b - 1.
template <int kRows, int kCols>
__host__ __device__ __forceinline__ constexpr int gmma_sw128_offset(int row, int col, int buf = 0) {
  return buf * kRows * kCols + (col >> 6) * kRows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) +
         (col & 7);
}

// ---- wgmma calls on plain register arrays ------------------------------------------------------
template <class Mma, int N, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t desc_a, uint64_t desc_b, float (&d)[N][4],
                                         cute::GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
  Mma::fma(desc_a, desc_b, d[I / 4][I % 4]..., scale_d);
}
template <class Mma, int N, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N][4],
                                         cute::GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
  Mma::fma(a[0], a[1], a[2], a[3], desc_b, d[I / 4][I % 4]..., scale_d);
}
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(d[i][e]);
  }
}
template <class FragA, int N>
__device__ __forceinline__ void fence_frags(FragA (&f)[N]) {
#pragma unroll
  for (int c = 0; c < N; ++c) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) cute::warpgroup_fence_operand(f[c].h[j][r]);
    }
  }
}

// Generic-proxy stores to shared memory (the decode) made visible to the async proxy (wgmma);
// each writing thread fences before the barrier that publishes the tile.
__device__ __forceinline__ void fence_view_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Shared-memory pieces of the wgmma variant on a 1024-byte aligned base (tile_config.cuh).
template <int kHeadDim, Fp4Format F>
struct WgmmaSmem {
  using W = WgmmaConfig<kHeadDim, F>;
  using Cfg = FwdConfig<kHeadDim, F>;
  using Elem = typename W::Elem;
  uint8_t* base;
  __device__ __forceinline__ Elem* q(int wg) const {
    return reinterpret_cast<Elem*>(base + Cfg::kOffQ) + wg * cute::cosize(typename W::SmemLayoutQ{});
  }
  __device__ __forceinline__ Elem* k() const { return reinterpret_cast<Elem*>(base + Cfg::kWgmmaOffDecoded); }
  __device__ __forceinline__ Elem* vt() const {
    return reinterpret_cast<Elem*>(base + Cfg::kWgmmaOffDecoded + 2 * Cfg::kWgmmaTileBytes);
  }
};

// Each warp writes its decoded Q fragments (AtomSm90Emulated::FragA, one per k64 chunk) into its
// warpgroup's Q tile in real k order: h[j][r] (j = 2h + q) holds row g + 8 (r & 1), columns
// 64c + 32h + 8t + 4q + 2 (r >> 1) + {0, 1} (mma_atoms.cuh). Call after every thread is done
// reading the prologue's Q tile (it is overwritten).
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
        *reinterpret_cast<uint32_t*>(q + gmma_sw128_offset<W::kRowsPerWg, kHeadDim>(row, col)) = qf[c].h[j][r];
      }
    }
  }
}

// All threads: decode raw stage `st` (one key tile) into decoded buffer `buf` and write the
// tile's smoothing correction corr[n] = qbar . deq(K row n) (fp32 on the CUDA cores: per scale
// block, qbar . codes (exact E2M1 values), times the block scale). Warps 0, 2, 5, 7: K, a thread
// per stored key row n = 32 (w / 2) + lane, all D / 32 raw 16-byte chunks. Warps 1, 3, 4, 6: V^T,
// a thread per channel and D / 32 of the tile's four 32-key groups. (The K share, with the
// correction, is the longer one: each SM sub-partition, which issues warps w and w + 4, gets one
// warp of each role.) The work is done in kParts calls
// (part = 0 .. kParts - 1, each a 1 / kParts share of every thread's chunks or groups) so that
// each share can hide a different wgmma; `corr_sum` carries the K row's partial correction from
// part to part (corr[n] is written by the last).
template <class Atom, int kHeadDim, int kParts, int kPart>
__device__ __forceinline__ void decode_tile_wgmma(const StageView<kHeadDim, Atom::kFormat>& st,
                                                  const WgmmaSmem<kHeadDim, Atom::kFormat>& sm, int buf,
                                                  const float* qbar, float* corr, float& corr_sum) {
  constexpr Fp4Format F = Atom::kFormat;
  using W = WgmmaConfig<kHeadDim, F>;
  using Cfg = FwdConfig<kHeadDim, F>;
  constexpr bool kBf16 = W::kBf16;
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int idx = 32 * (warp >> 1) + lane;  // 0 .. 127 within the role
  const bool k_role = ((warp ^ (warp >> 2)) & 1) == 0;
  auto codes = [](uint32_t x, uint32_t (&out)[4]) {
    if constexpr (kBf16) {
      decode8_bf16_codes(x, out);
    } else {
      decode8_half_codes(x, out);
    }
  };
  // Scale byte -> (16-bit pair for the decode, fp32 for the correction).
  auto scale2 = [](uint32_t byte) {
    if constexpr (kBf16) {
      return e8m0_bf16_pair(byte);
    } else {
      return __half2half2(e4m3_to_half(byte));
    }
  };
  if (k_role) {
    const int n = idx;
    auto* kdec = sm.k();
    const uint8_t* sf_row = st.ksf() + n * Cfg::kKSfRowBytes;
    constexpr int kChunks = kHeadDim / 32 / kParts;
    static_assert(kChunks * kParts == kHeadDim / 32, "whole chunks per part");
    float sum = kPart == 0 ? 0.0f : corr_sum;
#pragma unroll
    for (int q = kPart * kChunks; q < (kPart + 1) * kChunks; ++q) {
      const uint4 w4 = *reinterpret_cast<const uint4*>(st.k() + swizzled_offset<Cfg::kKRowBytes>(n, q));
      const uint32_t words[4] = {w4.x, w4.y, w4.z, w4.w};
      float part = 0.0f;
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        // NVFP4: block 2q + wi / 2 (16 values, two words); MXFP4: block q (the whole chunk).
        const uint32_t byte = kBf16 ? sf_row[q] : sf_row[2 * q + wi / 2];
        uint32_t c[4];
        codes(words[wi], c);
        const float4 qa = *reinterpret_cast<const float4*>(qbar + 32 * q + 8 * wi);
        const float4 qb = *reinterpret_cast<const float4*>(qbar + 32 * q + 8 * wi + 4);
        const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float2 f;
          if constexpr (kBf16) {
            f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&c[i]));
          } else {
            f = __half22float2(*reinterpret_cast<const __half2*>(&c[i]));
          }
          part = fmaf(qv[2 * i], f.x, part);
          part = fmaf(qv[2 * i + 1], f.y, part);
        }
        const auto s2 = scale2(byte);
        uint4 out;
        out.x = hmul2_bits(c[0], s2);
        out.y = hmul2_bits(c[1], s2);
        out.z = hmul2_bits(c[2], s2);
        out.w = hmul2_bits(c[3], s2);
        *reinterpret_cast<uint4*>(kdec + gmma_sw128_offset<kBlockN, kHeadDim>(n, 32 * q + 8 * wi, buf)) = out;
        if (kBf16 ? wi == 3 : (wi & 1) == 1) {  // end of a scale block
          sum = fmaf(part, scale_byte_to_float<F>(byte), sum);
          part = 0.0f;
        }
      }
    }
    if constexpr (kPart == kParts - 1) {
      corr[n] = sum;
    } else {
      corr_sum = sum;
    }
  } else {
    constexpr int kGroupsPerThread = kHeadDim / 32;  // of the tile's kBlockN / 32 = 4 key groups
    static_assert(kHeadDim * (kBlockN / 32) == 128 * kGroupsPerThread, "128 threads cover V^T");
    constexpr int kGroups = kGroupsPerThread / kParts;
    static_assert(kGroups * kParts == kGroupsPerThread, "whole key groups per part");
    const int d = idx % kHeadDim, g0 = (idx / kHeadDim) * kGroupsPerThread + kPart * kGroups;
    auto* vdec = sm.vt();
    const uint8_t* sf_row = st.vsf() + d * Cfg::kVSfRowBytes;
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
      const int grp = g0 + gi;  // keys 32 grp .. 32 grp + 31
      const uint4 w4 = *reinterpret_cast<const uint4*>(st.v() + swizzled_offset<Cfg::kVRowBytes>(d, grp));
      const uint32_t words[4] = {w4.x, w4.y, w4.z, w4.w};
      uint32_t dec[4][4];  // [word t][pair p]: keys 32 grp + 8t + 2p, +1
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint32_t byte = kBf16 ? sf_row[grp] : sf_row[2 * grp + t / 2];
        uint32_t c[4];
        codes(words[t], c);
        const auto s2 = scale2(byte);
#pragma unroll
        for (int pp = 0; pp < 4; ++pp) dec[t][pp] = hmul2_bits(c[pp], s2);
      }
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        *reinterpret_cast<uint4*>(vdec + gmma_sw128_offset<kHeadDim, kBlockN>(d, 32 * grp + 8 * pp, buf)) =
            make_uint4(dec[0][pp], dec[1][pp], dec[2][pp], dec[3][pp]);
      }
    }
  }
}

// One consumer warpgroup's wgmma descriptors (CuTe builds them from the smem layouts).
template <int kHeadDim, Fp4Format F>
struct WgmmaOperands {
  using W = WgmmaConfig<kHeadDim, F>;
  using Elem = typename W::Elem;
  using TQ = decltype(typename W::TiledMmaQK{}.get_slice(0).partition_fragment_A(
      cute::make_tensor(cute::make_smem_ptr(static_cast<Elem*>(nullptr)), typename W::SmemLayoutQ{})));
  using TK = decltype(typename W::TiledMmaQK{}.get_slice(0).partition_fragment_B(
      cute::make_tensor(cute::make_smem_ptr(static_cast<Elem*>(nullptr)), typename W::SmemLayoutK{})));
  using TV = decltype(typename W::TiledMmaPV{}.get_slice(0).partition_fragment_B(
      cute::make_tensor(cute::make_smem_ptr(static_cast<Elem*>(nullptr)), typename W::SmemLayoutVt{})));
  TQ q;  // (1, 1, D / 16)
  TK k;  // (1, 1, D / 16, 2)
  TV v;  // (1, 1, kBlockN / 16, 2)

  __device__ __forceinline__ WgmmaOperands(const WgmmaSmem<kHeadDim, F>& sm, int wg, int tid_in_wg)
      : q(typename W::TiledMmaQK{}.get_slice(tid_in_wg).partition_fragment_A(
            cute::make_tensor(cute::make_smem_ptr(sm.q(wg)), typename W::SmemLayoutQ{}))),
        k(typename W::TiledMmaQK{}.get_slice(tid_in_wg).partition_fragment_B(
            cute::make_tensor(cute::make_smem_ptr(sm.k()), typename W::SmemLayoutK{}))),
        v(typename W::TiledMmaPV{}.get_slice(tid_in_wg).partition_fragment_B(
            cute::make_tensor(cute::make_smem_ptr(sm.vt()), typename W::SmemLayoutVt{}))) {
    static_assert(cute::size<0>(TQ{}) == 1 && cute::size<1>(TQ{}) == 1 && cute::size<2>(TQ{}) == kHeadDim / 16,
                  "Q descriptors: one per k16 step");
    static_assert(cute::size<1>(TK{}) == 1 && cute::size<2>(TK{}) == kHeadDim / 16 && cute::size<3>(TK{}) == 2,
                  "K descriptors: (k16 step, buffer)");
    static_assert(cute::size<1>(TV{}) == 1 && cute::size<2>(TV{}) == kBlockN / 16 && cute::size<3>(TV{}) == 2,
                  "V^T descriptors: (k16 step, buffer)");
  }

  // S (64 x 128, fp32) = Q_wg K_buf^T, one committed group (not waited for).
  __device__ __forceinline__ void qk_issue(int buf, float (&s)[kBlockN / 8][4]) const {
    fence_acc(s);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < kHeadDim / 16; ++kb) {
      wgmma_ss<typename W::MmaQK>(uint64_t(q(0, 0, kb)), uint64_t(k(0, 0, kb, buf)), s,
                                  kb == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                  std::make_index_sequence<W::kSRegs>{});
    }
    cute::warpgroup_commit_batch();
  }

  // o (64 x D, fp32) = P V_buf with P~ decoded in registers (k16 step 4c + j = pf[c].h[j]), one
  // committed group (not waited for: pf and o stay untouched until pv_wait).
  template <class FragA>
  __device__ __forceinline__ void pv_issue(int buf, FragA (&pf)[kBlockN / kKeyChunk],
                                           float (&o)[kHeadDim / 8][4]) const {
    fence_frags(pf);
    fence_acc(o);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      wgmma_rs<typename W::MmaPV>(pf[ks / 4].h[ks % 4], uint64_t(v(0, 0, ks, buf)), o,
                                  ks == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                  std::make_index_sequence<W::kORegs>{});
    }
    cute::warpgroup_commit_batch();
  }
  template <class FragA>
  __device__ __forceinline__ static void pv_wait(FragA (&pf)[kBlockN / kKeyChunk], float (&o)[kHeadDim / 8][4]) {
    cute::warpgroup_wait<0>();
    fence_acc(o);
    fence_frags(pf);
  }
};

// The tile loop of the wgmma variant. On entry: raw tile 0 is in flight into stage 0 (committed),
// the prologue has run (qbar, q.k_mean in shared memory; qf this warp's decoded Q fragments) and
// every thread has passed the prologue's last barrier. `smem` is the 1024-aligned base.
template <class Atom, int kHeadDim>
__device__ __forceinline__ void mainloop_wgmma(const FwdParams& p, uint8_t* smem, const KvHead& kv, int n_tiles,
                                               const typename Atom::FragA (&qf)[kHeadDim / 64],
                                               float (&acc)[kHeadDim / 8][4], RowState& rs, int warp_row0) {
  constexpr Fp4Format F = Atom::kFormat;
  using Cfg = FwdConfig<kHeadDim, F>;
  using Stage = StageView<kHeadDim, F>;
  const WgmmaSmem<kHeadDim, F> sm{smem};
  const int tid = static_cast<int>(threadIdx.x);
  auto stage = [&](int i) { return Stage{smem + i * Cfg::kStageBytes}; };
  auto corr_buf = [&](int i) { return reinterpret_cast<float*>(smem + Cfg::kOffCorr) + i * kBlockN; };
  auto valid_buf = [&](int i) { return reinterpret_cast<uint32_t*>(smem + Cfg::kOffValid) + i * (kBlockN / 32); };
  const uint8_t* key_mask_row = p.key_mask ? p.key_mask + int64_t(blockIdx.z) * p.Skv : nullptr;
  const float* qbar = reinterpret_cast<const float*>(smem + Cfg::kOffQbar);
  const float scale_log2 = p.scale * 1.4426950408889634f;

  __syncthreads();  // every warp is done reading the prologue's Q tile: overwrite it decoded
  store_q_decoded<Atom, kHeadDim>(sm, qf);
  if (n_tiles > 1) load_kv_tile<kHeadDim, F>(stage(1), kv, 1);
  cp_async_commit();   // possibly empty: keeps the group count uniform
  cp_async_wait<1>();  // this thread's copies of tile 0
  __syncthreads();     // everyone's tile-0 copies are visible
  key_valid_bits(valid_buf(0), 0, p.Skv, key_mask_row);
  float corr_sum;  // a K row's partial correction between the two decode parts
  decode_tile_wgmma<Atom, kHeadDim, 2, 0>(stage(0), sm, 0, qbar, corr_buf(0), corr_sum);
  decode_tile_wgmma<Atom, kHeadDim, 2, 1>(stage(0), sm, 0, qbar, corr_buf(0), corr_sum);

  const WgmmaOperands<kHeadDim, F> ops(sm, tid / 128, tid % 128);
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int cur = tile & 1, nxt = cur ^ 1;
    cp_async_wait<0>();          // raw tile + 1 (issued one iteration earlier)
    fence_view_async_shared();   // this thread's decoded stores -> visible to wgmma
    // Decoded tile `tile` (and Q) are visible; every warp is done with tile - 1 (its wgmmas
    // retired), so decoded buffer `nxt`, its corr / valid slots and raw stage `cur` are free.
    __syncthreads();
    float s[kBlockN / 8][4];
    ops.qk_issue(cur, s);
    if (tile + 2 < n_tiles) {
      load_kv_tile<kHeadDim, F>(stage(cur), kv, tile + 2);
      cp_async_commit();
    }
    const bool more = tile + 1 < n_tiles;
    if (more) {  // first half of the next tile's decode: overlaps the QK wgmma
      key_valid_bits(valid_buf(nxt), tile + 1, p.Skv, key_mask_row);
      decode_tile_wgmma<Atom, kHeadDim, 2, 0>(stage(nxt), sm, nxt, qbar, corr_buf(nxt), corr_sum);
    }
    cute::warpgroup_wait<0>();
    fence_acc(s);

    float alpha[2], s1[2];
    typename Atom::FragA pf[kBlockN / kKeyChunk];
    scores_to_p_tile<Atom>(s, p, tile, warp_row0, corr_buf(cur), valid_buf(cur), scale_log2, rs, alpha, s1, pf);
    float o[kHeadDim / 8][4];
    ops.pv_issue(cur, pf, o);
    if (more) {  // second half: overlaps the PV wgmma
      decode_tile_wgmma<Atom, kHeadDim, 2, 1>(stage(nxt), sm, nxt, qbar, corr_buf(nxt), corr_sum);
    }
    ops.pv_wait(pf, o);
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      acc[n][0] = fmaf(acc[n][0], alpha[0], s1[0] * o[n][0]);
      acc[n][1] = fmaf(acc[n][1], alpha[0], s1[0] * o[n][1]);
      acc[n][2] = fmaf(acc[n][2], alpha[1], s1[1] * o[n][2]);
      acc[n][3] = fmaf(acc[n][3], alpha[1], s1[1] * o[n][3]);
    }
  }
}

}  // namespace sage_fp4
