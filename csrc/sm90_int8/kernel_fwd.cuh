// sm_90a 8-bit attention forward: composes the producer, the consumer mainloop, the softmax and
// the epilogue. A CTA runs one work tile = 128 query rows of one (b, h) (192 with three_consumers):
// warps 0-7 are two consumer warpgroups (0-11: three), the warp after them the producer. Template
// axes: head dim, output dtype, causal, options (FwdOptions). Launched with programmatic dependent
// launch when the caller asks (launch_fwd's pdl, from the pre-pass mode's kPrepassPdl): the kernel
// waits for the pre-pass (pdl_wait) before its first read of the pre-pass's outputs.
#pragma once

#include <cstdint>

#include "../common/launch.cuh"
#include "../common/sm90/named_barrier.cuh"
#include "../common/sm90/pdl.cuh"
#include "../common/sm90/register_split.cuh"
#include "epilogue.hpp"
#include "launch.h"
#include "mainloop.hpp"
#include "softmax.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

// Options: template axis kOpt (FwdOptions, launch.h: one line each on what it does and why; the
// shipped set per head dim is policy.hpp's ShippedPolicy<D>). What each does in detail and what
// was measured: DESIGN.md.
// Register files are handed out per warpgroup, so a producer warp costs a whole warpgroup's
// share anyway (288 threads compile to <= 168 registers, ptxas's cap for 384). With the overlap the producer becomes a
// full warpgroup that gives its registers to the consumers: 128 * 40 + 256 * 232 = 64512 <= 65536.
// The pipelined loops (overlap or ping-pong) hold two P arrays: they take the producer warpgroup.
template <FwdOptions kOpt>
using FwdCta = CtaShape<kOpt.consumer_warpgroups()>;
template <FwdOptions kOpt>
constexpr int fwd_threads() {
  return kOpt.producer_warpgroup() ? FwdCta<kOpt>::kConsumerThreads + 128 : FwdCta<kOpt>::kThreads;
}
// Three consumer warpgroups (512 threads launch with 128 registers): 128 * (32 + 3 * 160) = 65536.
// long_tile (S 96 registers per thread): the producer warpgroup at setmaxnreg's minimum, 24, gives the
// consumers 240 (FA3's split): 128 * 24 + 256 * 240 = 64512. So does pv_16bit (P 32 registers instead of
// 16 per array): at 232 the hd128 overlap loop spills 16 bytes and ptxas serializes its wgmmas.
template <FwdOptions kOpt>
using FwdRegisterSplit = std::conditional_t<
    kOpt.consumer_warpgroups() == 3, sage_common::sm90::RegisterSplit<32, 160, 3>,
    std::conditional_t<kOpt.long_tile || kOpt.pv_16bit, sage_common::sm90::RegisterSplit<24, 240>,
                       sage_common::sm90::RegisterSplit<40, 232>>>;

// V's element type in smem (TileConfig's VElem): FP8, or with pv_16bit the input's 16-bit type (CuTe's
// names); P~'s 16-bit type for the softmax (OnlineSoftmax's P16_: CUDA's names), void for FP8.
template <DType kOut, FwdOptions kOpt>
using FwdVElem = std::conditional_t<!kOpt.pv_16bit, cute::float_e4m3_t,
                                    std::conditional_t<kOut == DType::kBF16, cute::bfloat16_t, cute::half_t>>;
template <DType kOut, FwdOptions kOpt>
using FwdPElem = std::conditional_t<!kOpt.pv_16bit, void, typename IO<kOut>::T>;

template <int D, DType kOut, FwdOptions kOpt>
constexpr int fwd_smem_bytes() {
  // epilogue_staged: its tile takes the O sum's place (StagedOut, epilogue.hpp), or adds it
  constexpr int kWGs = kOpt.consumer_warpgroups();
  constexpr int bytes = TileConfig<D, kWGs, kOpt.sum_cols(), kOpt.tile_keys(), FwdVElem<kOut, kOpt>>::kSmemBytes + (kOpt.smem_o_every > 0 ? kSmemOSumBytes<D, kWGs, kOpt.sum_cols()>
                                                           : kOpt.epilogue_staged ? StagedOut<D, kWGs>::kBytes
                                                                                  : 0);
  static_assert(bytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");
  return bytes;
}

// phase_clock: the CTA's record of its phase points (launch.h kPhaseSlots). Lane 0 of warp 0 of
// each warpgroup writes (the producer lane, thread 256, as warpgroup 2: from kProducerSlot0 on);
// nothing is kept in registers between the marks (the address is recomputed from the kernel
// parameters each time: the consumers' register budget is full); without kOn it compiles away.
template <bool kOn>
struct PhaseClock {
  const FwdParams& p;

  // This thread's part of the CTA's record, or nullptr where the thread writes none.
  __device__ __forceinline__ unsigned long long* record() const {
    // two consumer warpgroups (FwdOptions::valid refuses phase_clock with three_consumers)
    static_assert(CtaShape<2>::kConsumerWGs * kConsumerPhases == kProducerSlot0, "launch.h: two consumer warpgroups");
    if (p.phase_clock == nullptr || threadIdx.x % 128 != 0) return nullptr;
    const int64_t cta = blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + gridDim.y * blockIdx.z);
    return p.phase_clock + (cta * kPhaseSlots + threadIdx.x / 128 * kConsumerPhases) * kPhaseWords;
  }
  // {%globaltimer, %clock64} into slot `phase` of this thread's part (a consumer or producer phase).
  __device__ __forceinline__ void mark(int phase) const {
    if constexpr (kOn) {
      if (unsigned long long* rec = record()) {
        unsigned long long ns, cycles;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(cycles));
        rec[phase * kPhaseWords] = ns;
        rec[phase * kPhaseWords + 1] = cycles;
      }
    }
  }
  // The producer lane: {%smid, 0} into the record's kSmSlot.
  __device__ __forceinline__ void mark_sm() const {
    if constexpr (kOn) {
      if (unsigned long long* rec = record()) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        rec[(kSmSlot - kProducerSlot0) * kPhaseWords] = sm;
        rec[(kSmSlot - kProducerSlot0) * kPhaseWords + 1] = 0;
      }
    }
  }
  __device__ __forceinline__ void mark(ConsumerPhase ph) const { mark(static_cast<int>(ph)); }
  __device__ __forceinline__ void mark(ProducerPhase ph) const { mark(static_cast<int>(ph)); }
};

// Named barriers 1 and 2 (0 is __syncthreads): "warpgroup w may issue its wgmmas" (pingpong).
constexpr int kBarSchedFirst = 1;

// A work tile: kBlockM query rows (m_block) of one (b, h), and the key tiles it visits.
struct FwdWork {
  int m_block, h, b, hk;
  int kv_len;   // keys of batch b that may be attended (key mask: the last attended one + 1)
  int n_tiles;  // key tiles of the loop; causal: those holding a key j <= i < (m_block+1)*kBlockM,
                // less the skipped run
  SkippedTiles skip;  // a run of wholly masked key tiles the loop skips (mainloop.hpp)
};

// The first run of wholly masked key tiles among tiles [0, n), as [lo, lo + len) (len 0: none):
// text padding inside a joint sequence (Flux, QwenImage, Chroma put the text first), which the
// loop then skips instead of scoring every key as -inf. A skipped tile changes no row's max, sum
// or O. Each warp scans 32 tiles per step with a ballot, so every thread gets the same answer;
// kWords mask words per tile (bits: tile t's at kWords * t).
template <int kWords>
__device__ __forceinline__ void masked_run(const uint32_t* bits, int n, int& lo, int& len) {
  const int lane = threadIdx.x & 31;
  lo = n;
  int hi = n;
  for (int base = 0; base < n && hi == n; base += 32) {
    const int t = base + lane;
    uint32_t any = 0;
    if (t < n) {
#pragma unroll
      for (int i = 0; i < kWords; ++i) any |= __ldg(bits + kWords * t + i);
    }
    const unsigned empty = __ballot_sync(0xffffffffu, t < n && any == 0);
    unsigned kept = ~empty;  // lanes past n count as kept: they end a run at n
    if (lo == n) {
      if (empty == 0) continue;
      lo = base + __ffs(empty) - 1;
      kept &= ~0u << (lo - base);  // the kept tiles after the run's first
    }
    if (kept != 0) hi = min(n, base + __ffs(kept) - 1);
  }
  len = hi - lo;
}

// kKeys: keys per tile (TileConfig; 192 with long_tile).
template <bool kCausal, int kBlockM, int kKeys = kBlockKV>
// bits: batch b's mask words (kKeys / 32 per tile), nullptr without a key mask.
__device__ __forceinline__ FwdWork make_work(const FwdParams& p, int m_block, int h, int b, const uint32_t* bits) {
  FwdWork w;
  w.m_block = m_block;
  w.h = h;
  w.b = b;
  w.hk = h / (p.Hq / p.Hkv);
  w.kv_len = p.kv_len != nullptr ? min(p.kv_len[b], p.Skv) : p.Skv;
  w.n_tiles = (w.kv_len + kKeys - 1) / kKeys;
  if constexpr (kCausal) {
    // the tiles up to the block's last row; at kBlockM = kKeys spelled as before (same SASS)
    const int last = kBlockM == kKeys ? m_block + 1 : ((m_block + 1) * kBlockM + kKeys - 1) / kKeys;
    w.n_tiles = min(w.n_tiles, last);
  }
  w.skip = {w.n_tiles, 0};
  if (bits != nullptr) {
    masked_run<kKeys / 32>(bits, w.n_tiles, w.skip.lo, w.skip.n);
    w.n_tiles -= w.skip.n;
  }
  return w;
}

// kFlags, kPoly: FwdOptions::flags() and exp2_poly_every of the options (launch_fwd).
template <int D, DType kOut, bool kCausal, int kPoly, int kFlags>
__global__ void __launch_bounds__(fwd_threads<FwdOptions::from_flags(kFlags, kPoly)>(), 1)
    fwd_kernel(const __grid_constant__ FwdParams p) {
  constexpr FwdOptions kOpt = FwdOptions::from_flags(kFlags, kPoly);
  static_assert(kOpt.valid(), "FwdOptions combination the kernel does not implement (FwdOptions::valid)");
  // hd128's overlapped loop holds two P arrays: S 64 + O 64 + 2 x P 16 (+ Q 16) registers > 160.
  static_assert(!kOpt.three_consumers || D == 64 || !kOpt.overlap_softmax_pv,
                "three_consumers at head dim 128: without overlap_softmax_pv (160 registers per consumer thread)");
  // The CTA shape (tile_config.hpp CtaShape): two or three consumer warpgroups.
  constexpr int kWGs = kOpt.consumer_warpgroups();
  using Cta = CtaShape<kWGs>;
  constexpr int kBlockM = Cta::kBlockM, kConsumerThreads = Cta::kConsumerThreads;
  constexpr int kProducerWarp = Cta::kProducerWarp, kQTilesPerCTA = Cta::kQTilesPerCTA;
  static_assert(kRowsPerWG == kQImageRows, "launch.h sizes the Q images in tiles of one warpgroup's rows");
  // tc_row_sum: the V^T stages carry kSumCols rows of ones, the PV accumulator kPVRegs values
  constexpr int kSumCols = kOpt.sum_cols();
  // long_tile: 192-key tiles of three 64-key K blocks (tile_config.hpp kLongTileKeys)
  constexpr int kKeys = kOpt.tile_keys();
  // pv_16bit: V's stages hold its 16-bit image, P~ is packed into the same 16-bit type
  using VElem = FwdVElem<kOut, kOpt>;
  using C = TileConfig<D, kWGs, kSumCols, kKeys, VElem>;
  static_assert(kKeys == (kOpt.long_tile ? kLongTileKeys : kBlockKV) && C::kKBlock == kOpt.kv_block(),
                "launch.h FwdOptions::tile_keys / kv_block and tile_config.hpp agree");
  constexpr bool kLean = kOpt.lean_softmax;
  constexpr bool kOverlapSoftmaxWithPV = kOpt.overlap_softmax_pv;
  constexpr bool kPingPong = kOpt.pingpong;
  constexpr bool kQRegs = kOpt.q_in_registers;
  constexpr bool kSplitReduce = kOpt.split_reductions;
  constexpr bool kTilePV = kOpt.fp32_pv_tiles;
  constexpr int kSmemOEvery = kOpt.smem_o_every;
  constexpr bool kSmemO = kSmemOEvery > 0;
  // The plain loop (no overlap, no ping-pong) keeps its original order; the others share one
  // software-pipelined loop (S_t and PV_{t-1} issued together).
  constexpr bool kPipelined = kOverlapSoftmaxWithPV || kPingPong;
  const PhaseClock<kOpt.phase_clock> clock{p};
  clock.mark(ConsumerPhase::kEntry);  // ProducerPhase::kEntry is the same slot index
  static_assert(static_cast<int>(ConsumerPhase::kEntry) == static_cast<int>(ProducerPhase::kEntry) &&
                static_cast<int>(ConsumerPhase::kReady) == static_cast<int>(ProducerPhase::kReady));
  // Consumer warpgroup wg's first row in the work tile at m_block, and the two rows there of the
  // thread tid (in the warpgroup) and lane: those of its Q, S and O fragments.
  auto wg_first_row = [](int m_block, int wg) { return m_block * kBlockM + wg * kRowsPerWG; };
  auto fragment_rows = [](int wg_row0, int tid, int lane, int (&row)[2]) {
    row[0] = wg_row0 + 16 * (tid / 32) + (lane >> 2);
    row[1] = row[0] + 8;
  };
  // With PDL the pre-pass may still be draining: every read of its outputs (kv_len, sq, sk, the
  // mask bits, the Q / K / V^T images) comes after this (a no-op in a plain launch).
  sage_common::sm90::pdl_wait();
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const SmemPlan<D, kWGs, kSumCols, kKeys, VElem> sp(smem_raw);

  // The CTA's work tile is (blockIdx.x, y, z); batch blockIdx.z's mask words, p.n_kv_tiles K blocks' worth
  const uint32_t* bits = p.mask_bits != nullptr
                             ? p.mask_bits + static_cast<int64_t>(blockIdx.z) * (C::kKBlock / 32) * p.n_kv_tiles
                             : nullptr;
  const FwdWork wk =
      make_work<kCausal, kBlockM, kKeys>(p, kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x, blockIdx.y, blockIdx.z,
                                         bits);

  fill_sum_rows(sp);  // tc_row_sum only; ordered before any wgmma by init_barriers' __syncthreads
  init_barriers<D>(sp);
  clock.mark(ConsumerPhase::kReady);  // = ProducerPhase::kReady on the producer lane

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp >= kProducerWarp) {
    if constexpr (kOpt.producer_warpgroup()) FwdRegisterSplit<kOpt>::producer();
    if (warp == kProducerWarp && lane == 0) {
      clock.mark_sm();
      const int64_t bhk = static_cast<int64_t>(wk.b) * p.Hkv + wk.hk;
      const int8_t* q_src = p.q_img + ((static_cast<int64_t>(wk.b) * p.Hq + wk.h) * p.n_q_tiles +
                                       kQTilesPerCTA * wk.m_block) * C::kQTileBytes;
      // p.n_kv_tiles K blocks (kKBlock keys each) per (b, kv head): kScaleBlocks per tile
      producer_loop<D>(sp, q_src, p.k_img + bhk * p.n_kv_tiles * C::kKBlockBytes,
                       p.vt_img + bhk * p.n_kv_tiles * C::kVBlockBytes, wk.n_tiles, wk.skip);
      clock.mark(ProducerPhase::kLastCopy);
    }
    return;
  }

  // ---- consumers ----
  if constexpr (kOpt.producer_warpgroup()) FwdRegisterSplit<kOpt>::consumer();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int m_block = wk.m_block, h = wk.h, b = wk.b, hk = wk.hk, kv_len = wk.kv_len, n_tiles = wk.n_tiles;
  // Stage and phase parity of key tile t in the K/V ring.
  auto stage_of = [&](int t) {
    int s, n;
    ring_slot<D, kWGs, kSumCols, kKeys, VElem>(t, s, n);
    return s;
  };
  auto parity_of = [&](int t) {
    int s, n;
    ring_slot<D, kWGs, kSumCols, kKeys, VElem>(t, s, n);
    return n & 1;
  };
  const int wg_row0 = wg_first_row(m_block, wg);
  int row[2];
  fragment_rows(wg_row0, tid, lane, row);

  using Softmax = OnlineSoftmax<kPoly, kLean, kSplitReduce, kOpt.tc_row_sum, kOpt.seeded_scores, kKeys, FwdPElem<kOut, kOpt>>;
  Softmax sm;
  {
    const int64_t q_rows = (static_cast<int64_t>(b) * p.Hq + h) * p.n_q_tiles * kRowsPerWG;
    sm.init(p.sq[q_rows + row[0]] * p.scale_log2, p.sq[q_rows + row[1]] * p.scale_log2);
  }
  const WarpgroupOperands<D, kWGs, kSumCols, kKeys, VElem> ops(sp, wg, tid);
  // per (b, kv head) p.n_kv_tiles K scales (the mask words: bits, above)
  const float* sk = p.sk + (static_cast<int64_t>(b) * p.Hkv + hk) * p.n_kv_tiles;

  uint32_t s_acc[C::kSRegs];
  uint32_t p_frag[C::kPRegs];
  // O's accumulator; tc_row_sum: then the row sums of P~ (TileConfig kPVRegs), which every step
  // below (rescale, tile sums, the smem sum) treats as O's values.
  float o[C::kPVRegs];
  // tile_sums (tc_row_sum where O stays in the FP8 accumulator past one tile): each tile's row
  // sums leave it as soon as its PV retired, into sm.l in fp32 (rescaled with O), and their
  // columns restart at 0. Left there, the sums run smem_o_every tiles through the wgmma's
  // truncating adds: the LSE came out 2e-3 to 3e-3 low on DiT-like inputs at hd128
  // (eval/results/gpu_tests_h200.md run 15). Per thread, columns D/2 + 2x, D/2 + 2x + 1 hold row
  // half x's whole sum (every ones column the same sum), so sm.l needs no quad reduction.
  constexpr bool kSumsToFp32 = kOpt.tile_sums;  // FwdOptions::valid: with tc_row_sum, without fp32_pv_tiles
  auto take_sums = [&] {
    if constexpr (kSumsToFp32) {
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        sm.l[x] += o[D / 2 + 2 * x];
        o[D / 2 + 2 * x] = o[D / 2 + 2 * x + 1] = 0.f;
      }
    }
  };
  // sm.l *= alpha where sm.l holds the row sums (kSumsToFp32), as O's registers.
  auto scale_sums = [&](const float (&alpha)[2]) {
    if constexpr (kSumsToFp32) {
      sm.l[0] *= alpha[0];
      sm.l[1] *= alpha[1];
    }
  };
  // fp32_pv_tiles: the PV wgmma's accumulator, one tile's P V (unused, and compiled away, without).
  float o_tile[C::kPVRegs];
#pragma unroll
  for (int i = 0; i < C::kPVRegs; ++i) o[i] = o_tile[i] = 0.f;
  float (&pv_acc)[C::kPVRegs] = *(kTilePV ? &o_tile : &o);
  // smem_o_every: this thread's share of O's smem sum, as float4 j at o_sum[j * kConsumerThreads]
  // (a warp's 32 lanes touch 512 consecutive bytes: no bank conflicts); o_scale: per row, the
  // product of the alphas applied to the register accumulator since the last flush.
  float4* const o_sum = kSmemO ? smem_o_sum<D>(sp) + threadIdx.x : nullptr;
  float o_scale[2] = {1.f, 1.f};
  if constexpr (kSmemO) {
#pragma unroll
    for (int j = 0; j < C::kPVRegs / 4; ++j) o_sum[j * kConsumerThreads] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // Whether the PV wgmma of key tile u starts its accumulator from zero.
  // (the divisor is never 0 when evaluated: without kSmemO the && stops first; spelled so nvcc
  // does not warn of a zero divisor in the variants without the smem sum)
  auto pv_zero = [&](int u) { return kSmemO && u % (kSmemO ? kSmemOEvery : 1) == 0; };
  // o_scale * (float4 j of the smem sum) + O's registers 4j..4j+3 (register i holds row (i >> 1) & 1).
  auto scaled_sum = [&](int j) {
    float4 x = o_sum[j * kConsumerThreads];
    x.x = fmaf(x.x, o_scale[0], o[4 * j]);
    x.y = fmaf(x.y, o_scale[0], o[4 * j + 1]);
    x.z = fmaf(x.z, o_scale[1], o[4 * j + 2]);
    x.w = fmaf(x.w, o_scale[1], o[4 * j + 3]);
    return x;
  };
  auto flush_o = [&] {
#pragma unroll
    for (int j = 0; j < C::kPVRegs / 4; ++j) o_sum[j * kConsumerThreads] = scaled_sum(j);
    o_scale[0] = o_scale[1] = 1.f;
  };
  // After key tile u's PV retired and O was rescaled to the next tile's max.
  auto maybe_flush = [&](int u) {
    if constexpr (kSmemO) {
      if (u % kSmemOEvery == kSmemOEvery - 1) flush_o();
    }
  };
  // O += the tile the last PV wgmma wrote (fp32_pv_tiles; a no-op without).
  auto add_tile = [&] {
    if constexpr (kTilePV) {
#pragma unroll
      for (int i = 0; i < C::kPVRegs; ++i) o[i] += o_tile[i];
    }
  };
  // fused_rescale: O = alpha O + the tile the last PV wgmma wrote (register i: row (i >> 1) & 1).
  constexpr bool kFusedRescale = kOpt.fused_rescale;  // FwdOptions::valid: fp32_pv_tiles, the plain loop
  auto add_scaled_tile = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < C::kPVRegs; ++i) o[i] = fmaf(o[i], alpha[(i >> 1) & 1], o_tile[i]);
  };

  // Per-tile scalars; fetched before waiting on the tile so their latency hides behind the copy.
  using Mask = typename Softmax::Mask;
  constexpr int kWords = kKeys / 32;
  auto tile_mask = [&](int t) {
    Mask mk;
    mk.key_base = t * kKeys;
    mk.kv_len = kv_len;
    mk.causal = kCausal;
    mk.row[0] = row[0];
    mk.row[1] = row[1];
    if constexpr (kWords == 4) {
      if (bits != nullptr) {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(bits + 4 * t));
        mk.words[0] = w.x; mk.words[1] = w.y; mk.words[2] = w.z; mk.words[3] = w.w;
      } else {
        mk.words[0] = mk.words[1] = mk.words[2] = mk.words[3] = 0xffffffffu;
      }
      mk.active = mk.key_base + kKeys > kv_len ||
                  (mk.words[0] & mk.words[1] & mk.words[2] & mk.words[3]) != 0xffffffffu ||
                  (kCausal && mk.key_base + kKeys - 1 > wg_row0);
    } else {  // long_tile: 6 words, 8-byte aligned
      uint32_t all = 0xffffffffu;
#pragma unroll
      for (int i = 0; i < kWords / 2; ++i) {
        const uint2 w = bits != nullptr ? __ldg(reinterpret_cast<const uint2*>(bits + kWords * t) + i)
                                        : make_uint2(0xffffffffu, 0xffffffffu);
        mk.words[2 * i] = w.x;
        mk.words[2 * i + 1] = w.y;
        all &= w.x & w.y;
      }
      mk.active = mk.key_base + kKeys > kv_len || all != 0xffffffffu ||
                  (kCausal && mk.key_base + kKeys - 1 > wg_row0);
    }
    return mk;
  };
  // Tile t's K scales (C::kScaleBlocks of them).
  auto tile_scales = [&](int t) {
    typename Softmax::KScales ks;
    if constexpr (C::kScaleBlocks == 1) {
      ks.v[0] = __ldg(sk + t);  // (the loop below, unrolled, gave ptxas another uniform-register plan)
    } else {
#pragma unroll
      for (int i = 0; i < C::kScaleBlocks; ++i) ks.v[i] = __ldg(sk + C::kScaleBlocks * t + i);
    }
    return ks;
  };
  auto release = [&](int stage) {
    __syncwarp();
    if (lane == 0) Barrier::arrive(&sp.empty[stage]);
  };

  // No row of the warp changed its max (warp-uniform): the lean softmax then skips O *= alpha.
  auto max_kept = [&](const float (&alpha)[2]) {
    return __all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f);
  };
  // O *= alpha; with kLean skipped when max_kept.
  auto scale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < C::kPVRegs; ++i) o[i] *= alpha[(i >> 1) & 1];
    scale_sums(alpha);
    if constexpr (kSmemO) {
      o_scale[0] *= alpha[0];
      o_scale[1] *= alpha[1];
    }
  };
  auto rescale = [&](const float (&alpha)[2]) {
    if constexpr (kLean) {
      if (max_kept(alpha)) return;
    }
    scale_o(alpha);
  };

  uint32_t q_frag[D / 8];
  Barrier::wait(sp.q_full, 0);
  if constexpr (kQRegs) WarpgroupOperands<D, kWGs, kSumCols, kKeys, VElem>::load_q_frag(sp, wg, tid, q_frag);
  clock.mark(ConsumerPhase::kQReady);
  // Whether a key tile's row scales c = rowf sk can exceed the folded exponent's bound
  // (softmax.hpp lean_scores): then that tile's softmax step runs the exact exponents (a branch
  // at the top of the step, so the folded step keeps its code). Warp-uniform (the step's quad
  // shuffles need it); from the tile's K scale, loaded before its wait, and the rows' scales.
  auto exact_exponents = [&](const typename Softmax::KScales& sk_t) {
    return kLean && __any_sync(0xffffffffu, fmaxf(sm.rowf[0], sm.rowf[1]) * sk_t.max() > Softmax::kFoldMaxC);
  };
  auto qk_issue = [&](int stage) {
    if constexpr (kQRegs) {
      ops.qk_issue_rs(stage, q_frag, s_acc, Softmax::kSeeded);
    } else {
      ops.qk_issue(stage, s_acc, Softmax::kSeeded);
    }
  };
  // seeded_scores: S's registers = the bias bits, before the waits that precede the next QK issue
  // (S is dead from the softmax's pack to that issue).
  auto seed_scores = [&] {
    if constexpr (Softmax::kSeeded) {
#pragma unroll
      for (int i = 0; i < C::kSRegs; ++i) s_acc[i] = Softmax::kScoreBiasBits;
    }
  };
  if constexpr (!kPipelined) {
    // Plain order: S_t, softmax_t, O += P_t V_t, each retired before the next.
    for (int t = 0; t < n_tiles; ++t) {
      const int s = stage_of(t);
      const auto sk_t = tile_scales(wk.skip.key_tile(t));
      const Mask mk = tile_mask(wk.skip.key_tile(t));
      seed_scores();
      Barrier::wait(&sp.full[s], parity_of(t));
      qk_issue(s);
      cute::warpgroup_wait<0>();
      fence_regs(s_acc);
      float alpha[2];
      sm.step(s_acc, sk_t, mk, p_frag, alpha, exact_exponents(sk_t));
      if (t == 0) clock.mark(ConsumerPhase::kFirstSoftmax);
      if (pv_zero(t)) {
        // smem_o_every: this PV starts from zero and overwrites O's registers (flushed after the
        // tile before), so only the smem sum's scale takes alpha; at smem_o_every = 1 O's
        // registers are thus dead through every softmax (the three-warpgroup hd128 loop fits
        // 160 registers only so).
        o_scale[0] *= alpha[0];
        o_scale[1] *= alpha[1];
        scale_sums(alpha);
      } else if (!kFusedRescale) {
        rescale(alpha);
      }
      ops.pv(s, p_frag, pv_acc, kTilePV || pv_zero(t));
      if constexpr (kFusedRescale) {
        add_scaled_tile(alpha);
      } else {
        add_tile();
      }
      take_sums();
      release(s);
      // Not after the last tile: the epilogue adds O's registers to the sum (scaled_sum), as
      // after the pipelined loop, whose last PV is never flushed either.
      if (t + 1 < n_tiles) maybe_flush(t);
    }
  } else if (n_tiles > 0) {
    // Pipelined order: S_t and O += P_{t-1} V_{t-1} are issued back to back; with the overlap
    // the softmax of tile t starts as soon as S_t retired, while the PV group still runs. O is
    // rescaled by alpha_t only after that group retired (O_t = alpha_t O_{t-1} + P_t V_t). A
    // tile's stage is released after its PV retired, i.e. one iteration later. P alternates
    // between two register arrays so the one an in-flight wgmma reads is never redefined (else
    // ptxas serializes). Ping-pong: each issue block is one turn (common/sm90/named_barrier.cuh).
    uint32_t p_alt[C::kPRegs];
    // two consumer warpgroups only (FwdOptions::valid: no ping-pong with three_consumers)
    const sage_common::sm90::WarpgroupPingPong<kPingPong, kBarSchedFirst, CtaShape<2>::kConsumerThreads> sched{wg};
    sched.start();
    auto turn_begin = [&] { sched.begin(); };
    auto turn_end = [&](bool last) { sched.end(last); };
    {
      const auto sk_t = tile_scales(wk.skip.key_tile(0));
      const Mask mk = tile_mask(wk.skip.key_tile(0));
      seed_scores();
      Barrier::wait(&sp.full[stage_of(0)], parity_of(0));
      turn_begin();
      qk_issue(stage_of(0));
      turn_end(false);
      cute::warpgroup_wait<0>();
      fence_regs(s_acc);
      float alpha[2];
      sm.step(s_acc, sk_t, mk, p_frag, alpha, exact_exponents(sk_t));  // O is still 0: alpha unused
      clock.mark(ConsumerPhase::kFirstSoftmax);
    }
    auto body = [&](int t, uint32_t (&p_prev)[C::kPRegs], uint32_t (&p_next)[C::kPRegs]) {
      const int s = stage_of(t), s_prev = stage_of(t - 1);
      const auto sk_t = tile_scales(wk.skip.key_tile(t));
      const Mask mk = tile_mask(wk.skip.key_tile(t));
      seed_scores();
      Barrier::wait(&sp.full[s], parity_of(t));
      turn_begin();
      qk_issue(s);
      ops.pv_issue(s_prev, p_prev, pv_acc, /*fence=*/false,  // qk_issue's fence covers it
                   kTilePV || pv_zero(t - 1));
      turn_end(false);
      // PV_{t-1} retired: its stage goes back to the producer and O_{t-1} is complete.
      auto retire_pv = [&] {
        fence_regs(pv_acc);
        fence_regs(p_prev);
        release(s_prev);
        add_tile();
        take_sums();
      };
      if constexpr (kOverlapSoftmaxWithPV) {
        cute::warpgroup_wait<1>();  // S_t retired, PV_{t-1} may still run
      } else {
        cute::warpgroup_wait<0>();
        retire_pv();  // before the softmax: fp32_pv_tiles' tile dies before S_t's softmax needs registers
      }
      fence_regs(s_acc);
      float alpha[2];
      sm.step(s_acc, sk_t, mk, p_next, alpha, exact_exponents(sk_t));
      if constexpr (kOverlapSoftmaxWithPV) {
        cute::warpgroup_wait<0>();
        retire_pv();
      }
      rescale(alpha);
      maybe_flush(t - 1);
    };
    for (int t = 1; t < n_tiles; ++t) {
      if (t & 1) {
        body(t, p_frag, p_alt);
      } else {
        body(t, p_alt, p_frag);
      }
    }
    const int s_last = stage_of(n_tiles - 1);
    turn_begin();
    if ((n_tiles - 1) & 1) {
      ops.pv_issue(s_last, p_alt, pv_acc, /*fence=*/true, kTilePV || pv_zero(n_tiles - 1));
    } else {
      ops.pv_issue(s_last, p_frag, pv_acc, /*fence=*/true, kTilePV || pv_zero(n_tiles - 1));
    }
    turn_end(true);
    cute::warpgroup_wait<0>();
    fence_regs(pv_acc);
    fence_regs(p_frag);
    fence_regs(p_alt);
    release(s_last);
    add_tile();
    take_sums();
  }
  clock.mark(ConsumerPhase::kLastPV);
  if constexpr (kSmemO) {  // O = o_scale * smem sum + the tiles since the last flush
#pragma unroll
    for (int j = 0; j < C::kPVRegs / 4; ++j) {
      const float4 x = scaled_sum(j);
      o[4 * j] = x.x;
      o[4 * j + 1] = x.y;
      o[4 * j + 2] = x.z;
      o[4 * j + 3] = x.w;
    }
  }
  if constexpr (kSumsToFp32) {  // where the epilogue reads the row sums (their columns hold 0 here)
    o[D / 2] = sm.l[0];
    o[D / 2 + 2] = sm.l[1];
  }
  clock.mark(ConsumerPhase::kEpilogue);
  epilogue_store<D, kOut, kCausal, kOpt.epilogue_summary, kOpt.epilogue_staged, kWGs>(
      p, sm, o, row, b, h, hk, kOpt.epilogue_staged ? smem_o_sum<D>(sp) : nullptr);
  clock.mark(ConsumerPhase::kStored);
}

template <int D, DType kOut, bool kCausal, FwdOptions kOpt>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream, bool pdl) {
  static_assert(kOpt.valid(), "FwdOptions combination the kernel does not implement (FwdOptions::valid)");
  auto kernel = fwd_kernel<D, kOut, kCausal, kOpt.exp2_poly_every, kOpt.flags()>;
  const dim3 grid(p.n_q_tiles / FwdCta<kOpt>::kQTilesPerCTA, p.Hq, p.B);  // ceil(Sq / kBlockM) row blocks
  const sage_common::LaunchKind kind = pdl ? sage_common::LaunchKind::kPdl : sage_common::LaunchKind::kPlain;
  return sage_common::launch_with_smem(kernel, grid, fwd_threads<kOpt>(), fwd_smem_bytes<D, kOut, kOpt>(), p, stream, kind);
}

}  // namespace sage_sm90
