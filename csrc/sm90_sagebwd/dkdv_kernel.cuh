// SageBwd's dK/dV kernel, warp-specialized for sm_90a (the Triton dK/dV kernel waits for every
// product and holds CTA-wide barriers each step: docs/sagebwd.md "Where the time goes"). Numerics
// are the reference's with 16-bit scores (sage_diffusers/reference/sagebwd.py, scores="fp16"): per
// 64-query block i and 64-key tile,
//   S^T = K Q^T (16-bit, fp32 sums), dP^T = V dO^T (16-bit, fp32 sums),
//   P~ = exp2(min(S * qk_scale - m, 0)), P = P~ / l, dS = P (dP - delta),
//   dV += (P^ int8 = rint(127 P~))^T . dO'^ (INT8 per 64-query block)  * (s_dO'_i / 127),
//   dK += (dS^ int8 per 64x64 tile)^T . Q^ (INT8 per 64-query block)  * (s_dS * s_Q_i * scale).
//
// CTA: 128 keys of one (b, h); warpgroup 0 is the producer (one lane issues the bulk copies),
// warpgroups 1 and 2 each own 64 keys (the wgmma M) and loop over every query block. Operands
// arrive as byte images of their swizzled shared-memory tiles (written by the Triton image pre-pass,
// sage_diffusers/kernels/sagebwd_sm90.py), so every tile is one cp.async.bulk:
//   K, V: 16-bit, per warpgroup 64 keys x D, K-major (the A operands of S^T and dP^T);
//   Q, dO: 16-bit, 64 queries x D, K-major (the B operands of S^T and dP^T);
//   Q^T, dO'^T: INT8, D x 64 queries, K-major (the B operands of dK and dV), their query positions
//     in the order that makes the S^T accumulator registers the INT8 A fragment as they are
//     (sage_sm90::vt_position_to_key, as V^T's keys in the 8-bit forward);
//   per query block: m, 2^32 / l, delta (64 floats each), s_dO' / 127 and s_Q.
// DvAcc::kInPlace (other numerics, non-causal only: eval/results/sagebwd_error_budget_cpu.md "dO' of dV
// per channel"): dO' is quantized per channel over all queries, so dV sums P^^T dO'^ in int32 in its
// own accumulator across the whole loop and takes its scales (P~'s 1/127 times the channel's) once.
// Masks (api.h Visibility): a masked key's P~ and dS are 0 (its row's exp2 cap is -inf); a CTA whose
// 128 keys are all masked writes zeros. Causal: the loop starts at the CTA's first key, and the two
// query blocks there compare key and query per score.
// GQA: the CTA visits the query blocks of each query head its KV head serves, one head after another.
// Not handled (the caller runs the Triton kernels for them): partial blocks (Sq % 64, Skv % 128 must
// be 0); non-finite Q and V are zeroed before the forward.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "../common/numeric_conversion.cuh"
#include "../common/smem.cuh"
#include "../common/sm90/named_barrier.cuh"
#include "../common/sm90/pipeline.cuh"
#include "../common/sm90/register_split.cuh"
#include "../common/sm90/wgmma.cuh"
#include "api.h"
#include "numerics.cuh"

namespace sagebwd_sm90 {

using Barrier = sage_common::sm90::TxBarrier;
using Bf16 = sage_common::Elem16<__nv_bfloat16>;  // the bf16 products' A fragments: pack2 (lo in the low half)
using sage_common::sm90::fence_regs;
using sage_common::sm90::wgmma_rs;
using sage_common::sm90::wgmma_ss;

constexpr int kFirstNamedBarrier = 1;  // one per consumer warpgroup: its dS absmax

// A masked key's cap on its scores' exp2 argument (P~ = exp2(min(x, cap))): -inf, so P~ = 0 and dS = 0
// even where x is not finite. A visible key's cap is 0 (P~ <= 1).
__device__ __forceinline__ float masked_cap() { return __int_as_float(0xff800000u); }

// Key block j's visibility word (bit k: key 64 j + k) in batch b of nk blocks; all ones without a mask.
__device__ __forceinline__ uint64_t key_word(const Visibility& vis, int b, int nk, int j) {
  return vis.key_bits != nullptr ? __ldg(vis.key_bits + static_cast<int64_t>(b) * nk + j) : ~0ull;
}

// The ring's barriers (full: the producer's arrive + the copies' bytes; empty: lane 0 of each consumer
// warp) and the once-per-CTA operands' barrier, by thread 0, before any other thread proceeds.
__device__ __forceinline__ void init_barriers(uint64_t* full, uint64_t* empty, int stages, uint64_t* once) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], kConsumerWGs * 4);
    }
    Barrier::init(once, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

template <int D, class Elem>  // Elem: cute::bfloat16_t or cute::half_t
struct Config {
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
  static constexpr int kStages = D == 128 ? 3 : 4;
  // 16-bit K-major tiles: rows of D elements (128 or 256 bytes) in 128-byte swizzle atoms.
  using Atom16 = cute::GMMA::Layout_K_SW128_Atom<Elem>;
  // INT8 K-major tiles of 64 queries: 64-byte rows.
  using Atom8 = cute::GMMA::Layout_K_SW64_Atom<int8_t>;
  using LayoutKV = decltype(cute::tile_to_shape(Atom16{}, cute::Shape<cute::Int<kKeysPerWG>, cute::Int<D>>{}));
  using LayoutQ = decltype(cute::tile_to_shape(
      Atom16{}, cute::Shape<cute::Int<kBlockM>, cute::Int<D>, cute::Int<kStages>>{}));
  using LayoutT8 = decltype(cute::tile_to_shape(
      Atom8{}, cute::Shape<cute::Int<D>, cute::Int<kBlockM>, cute::Int<kStages>>{}));
  static constexpr int kTile16Bytes = kKeysPerWG * D * 2;  // = kBlockM * D * 2
  static constexpr int kTile8Bytes = D * kBlockM;

  using MmaS = std::conditional_t<std::is_same_v<Elem, cute::bfloat16_t>,
                                  cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
                                  cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
  using MmaD = std::conditional_t<D == 128, cute::SM90::GMMA::MMA_64x128x32_S32S8S8_RS_TN,
                                  cute::SM90::GMMA::MMA_64x64x32_S32S8S8_RS_TN>;
  // DkAcc::kBf16InPlace: dK = dS^T Q as a bf16 product (A: dS^T from registers; B: the stage's Q tile
  // read MN-major, (D, 64 queries): the same bytes as LayoutQ, its 8-query atoms innermost).
  using LayoutQmn = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Elem>{}, cute::Shape<cute::Int<D>, cute::Int<kBlockM>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // A 64 x D bf16 product with A from registers and B MN-major (DkAcc / DqAcc::kBf16InPlace).
  using Mma16Rs = std::conditional_t<
      D == 128, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>,
      cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>>;
  using TiledMmaS = decltype(cute::make_tiled_mma(MmaS{}));
  using TiledMmaD = decltype(cute::make_tiled_mma(MmaD{}));
  using TiledMma16Rs = decltype(cute::make_tiled_mma(Mma16Rs{}));
  static constexpr int kSRegs = kKeysPerWG * kBlockM / 128;  // 32 fp32 of S^T (and of dP^T)
  static constexpr int kDRegs = kKeysPerWG * D / 128;        // D / 2 of dK, of dV, of a product
  static constexpr int kARegs = kKeysPerWG * kBlockM / 128 / 4;  // 8: one 64x64 INT8 A operand

  // Shared memory: K and V (both warpgroups' tiles), then per stage Q, dO, Q^T, dO'^T, vec.
  static constexpr int kSmemK = 2 * kTile16Bytes;
  static constexpr int kSmemV = 2 * kTile16Bytes;
  static constexpr int kSmemQ = kStages * kTile16Bytes;
  static constexpr int kSmemDO = kStages * kTile16Bytes;
  static constexpr int kSmemQT = kStages * kTile8Bytes;
  static constexpr int kSmemDOT = kStages * kTile8Bytes;
  static constexpr int kSmemVec = kStages * kVecBytes;
  static constexpr int kSmemRed = kConsumerWGs * 2 * 4 * 4;  // absmax per warp, double-buffered
  static constexpr int kSmemBarriers = 8 * (2 * kStages + 1);
  static constexpr int kSmemBytes = kSmemK + kSmemV + kSmemQ + kSmemDO + kSmemQT + kSmemDOT + kSmemVec + kSmemRed +
                                    kSmemBarriers + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "one CTA's shared memory");
  static constexpr int kStageTxBytes = 2 * kTile16Bytes + 2 * kTile8Bytes + kVecBytes;
};

template <int D, class Elem>
struct Smem {
  using C = Config<D, Elem>;
  uint8_t *k, *v, *q, *dO, *qt, *dot;
  float *vec, *red;
  uint64_t *full, *empty, *kv_full;
  __device__ __forceinline__ explicit Smem(uint8_t* raw) {
    k = raw + sage_common::smem_align_pad<1024>(sage_common::smem_addr(raw));
    v = k + C::kSmemK;
    q = v + C::kSmemV;
    dO = q + C::kSmemQ;
    qt = dO + C::kSmemDO;
    dot = qt + C::kSmemQT;
    vec = reinterpret_cast<float*>(dot + C::kSmemDOT);
    red = vec + C::kSmemVec / 4;
    full = reinterpret_cast<uint64_t*>(red + C::kSmemRed / 4);
    empty = full + C::kStages;
    kv_full = empty + C::kStages;
  }
};

// How a consumer warpgroup orders its step's products.
enum class Schedule {
  // Every product waited for at once: S^T / dP^T, then dV, then dK. Only the other warpgroup's work
  // overlaps a product. Fits hd128's registers.
  kSerial,
  // Step i's dV and dK stay in flight while step i + 1's softmax gradient runs: S^T / dP^T of step
  // i + 1 are issued before them, so the tensor cores finish those first. Holds two products' int32
  // results and two steps' A fragments: hd64 only (at hd128 that is 350 registers).
  kOverlap,
};

// How dV sums its INT8 products.
enum class DvAcc {
  // Each step's int32 result times the step's dO' block scale / 127, added to an fp32 dV (the shipped
  // numerics).
  kScaledPerStep,
  // dO' per channel: the int32 sum stays in the wgmma accumulator across the loop (in flight, no
  // conversion per step), scaled once at the end. Exact up to 2^31 / 127^2 = 133,000 queries.
  kInPlace,
};

// How dK sums its products.
enum class DkAcc {
  // dS^ INT8 per 64 x 64 tile times Q^ (INT8 per query block): each step's int32 result times the
  // tile's scales, added to an fp32 dK (the shipped numerics, the paper's INT8 product).
  kInt8PerStep,
  // dS (times kDsPrescale) rounded to bf16, no scale, times Q as the 16-bit scores read it: the fp32
  // sums stay in the wgmma accumulator across the loop, so a step has no dS tile scale, no INT8
  // codes of dS and no conversion or scaled add of dK (eval/results/sagebwd_error_budget_cpu.md, "dQ
  // and dK as 16-bit products": dK rel-L1 ~0.014 -> ~0.002 emulated). bf16 only (dS's range).
  kBf16InPlace,
};

template <int D, class Elem, Schedule kSchedule, DvAcc kDvAcc, DkAcc kDkAcc = DkAcc::kInt8PerStep>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(const Params p) {
  using C = Config<D, Elem>;
  constexpr bool kInPlace = kDvAcc == DvAcc::kInPlace;
  constexpr bool kDk16 = kDkAcc == DkAcc::kBf16InPlace;
  static_assert(!kDk16 || std::is_same_v<Elem, cute::bfloat16_t>, "the bf16 dK product takes bf16 operands");
  constexpr int kDsRegs = kDk16 ? C::kSRegs / 2 : C::kARegs;  // dK's A fragment: bf16 pairs or INT8 codes
  static_assert(kSchedule == Schedule::kSerial || D == 64, "the overlapped schedule fits hd64's registers only");
  extern __shared__ uint8_t smem_raw[];
  Smem<D, Elem> sp(smem_raw);
  const int kv_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int bh = b * p.heads + h;  // K, V, dK, dV; query head h * group + j: bh * group + j
  const int nq = p.sq / kBlockM;
  const int wg = threadIdx.x / 128;
  using Split = sage_common::sm90::RegisterSplit<24, 240, kConsumerWGs>;
  // The query blocks this CTA visits per query head: from the block of its first key when causal
  // (earlier queries see none of its keys), none when all its keys are masked. Step n is query block
  // i0 + n % per_head of the group's query head n / per_head.
  const int nk = p.skv / kKeysPerWG;
  const uint64_t word[kConsumerWGs] = {key_word(p.vis, b, nk, kConsumerWGs * kv_block),
                                       key_word(p.vis, b, nk, kConsumerWGs * kv_block + 1)};
  const int i0 = p.vis.causal ? kv_block * (kBlockN / kBlockM) : 0;
  const int per_head = (word[0] | word[1]) != 0 ? max(nq - i0, 0) : 0;
  const int steps = per_head * p.group;

  init_barriers(sp.full, sp.empty, C::kStages, sp.kv_full);

  if (wg == 0) {
    Split::producer();
    if (threadIdx.x == 0) {
      using sage_common::sm90::bulk_copy_g2s;
      const int64_t kv_off = (static_cast<int64_t>(bh) * (p.skv / kBlockN) + kv_block) * C::kSmemK;
      Barrier::arrive_and_expect_tx(sp.kv_full, C::kSmemK + C::kSmemV);
      bulk_copy_g2s(p.k + kv_off, sp.kv_full, sp.k, C::kSmemK);
      bulk_copy_g2s(p.v + kv_off, sp.kv_full, sp.v, C::kSmemV);
      const int64_t blk0 = static_cast<int64_t>(bh) * p.group * nq;  // the group's first query head
      for (int n = 0; n < steps; ++n) {
        const int s = n % C::kStages, r = n / C::kStages;
        if (r > 0) Barrier::wait(&sp.empty[s], (r - 1) & 1);
        Barrier::arrive_and_expect_tx(&sp.full[s], C::kStageTxBytes);
        const int64_t blk = blk0 + static_cast<int64_t>(n / per_head) * nq + i0 + n % per_head;
        bulk_copy_g2s(p.q + blk * C::kTile16Bytes, &sp.full[s], sp.q + s * C::kTile16Bytes, C::kTile16Bytes);
        bulk_copy_g2s(p.dO + blk * C::kTile16Bytes, &sp.full[s], sp.dO + s * C::kTile16Bytes, C::kTile16Bytes);
        bulk_copy_g2s(p.qt + blk * C::kTile8Bytes, &sp.full[s], sp.qt + s * C::kTile8Bytes, C::kTile8Bytes);
        bulk_copy_g2s(p.dot + blk * C::kTile8Bytes, &sp.full[s], sp.dot + s * C::kTile8Bytes, C::kTile8Bytes);
        bulk_copy_g2s(p.vec + blk * kVecFloats, &sp.full[s], sp.vec + s * kVecFloats, kVecBytes);
      }
    }
    return;
  }
  Split::consumer();
  const int cw = wg - 1;  // this warpgroup's 64 keys: cw * 64 ...
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // This thread's two key rows (value v's is 16 warp + g + 8 ((v >> 1) & 1) of the warpgroup's 64):
  // the first's index in the sequence, and each row's exp2 cap (masked_cap() for a masked key).
  const int key0 = kv_block * kBlockN + cw * kKeysPerWG + 16 * warp + g;
  float cap_row[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) cap_row[hh] = (word[cw] >> (16 * warp + g + 8 * hh)) & 1 ? 0.f : masked_cap();

  namespace sm90 = sage_common::sm90;
  const auto dK_ = sm90::gmma_desc_a<typename C::TiledMmaS, typename C::LayoutKV>(
      reinterpret_cast<Elem*>(sp.k + cw * C::kTile16Bytes), tid);
  const auto dV_ = sm90::gmma_desc_a<typename C::TiledMmaS, typename C::LayoutKV>(
      reinterpret_cast<Elem*>(sp.v + cw * C::kTile16Bytes), tid);
  const auto dQ_ = sm90::gmma_desc_b<typename C::TiledMmaS, typename C::LayoutQ>(reinterpret_cast<Elem*>(sp.q), tid);
  const auto dDO_ = sm90::gmma_desc_b<typename C::TiledMmaS, typename C::LayoutQ>(reinterpret_cast<Elem*>(sp.dO), tid);
  const auto dQT_ = sm90::gmma_desc_b<typename C::TiledMmaD, typename C::LayoutT8>(reinterpret_cast<int8_t*>(sp.qt), tid);
  const auto dDOT_ = sm90::gmma_desc_b<typename C::TiledMmaD, typename C::LayoutT8>(reinterpret_cast<int8_t*>(sp.dot), tid);
  static_assert(cute::size<2>(decltype(dK_){}) == D / 16 && cute::size<2>(decltype(dQ_){}) == D / 16 &&
                    cute::size<3>(decltype(dQ_){}) == C::kStages,
                "16-bit descriptors: one per 16-wide k-step (and stage)");
  static_assert(cute::size<2>(decltype(dQT_){}) == kBlockM / 32 && cute::size<3>(decltype(dQT_){}) == C::kStages,
                "INT8 descriptors: one per 32-query k-step and stage");
  // kDk16: the stage's Q tile as dK's B operand (otherwise unused: 0)
  const auto dQmn_ = [&] {
    if constexpr (kDk16) {
      const auto d = sm90::gmma_desc_b<typename C::TiledMma16Rs, typename C::LayoutQmn>(reinterpret_cast<Elem*>(sp.q), tid);
      static_assert(cute::size<2>(decltype(d){}) == kBlockM / 16 && cute::size<3>(decltype(d){}) == C::kStages,
                    "bf16 dK descriptors: one per 16-query k-step and stage");
      return d;
    } else {
      return 0;
    }
  }();

  // dV's sums: fp32 (kScaledPerStep), or with kInPlace int32 bits in the wgmma's own accumulator,
  // set by the first step's product (the unused one of the two is never live). dK's: fp32, added to
  // per step, or with kDk16 the bf16 product's accumulator itself (from these zeros).
  float dv[C::kDRegs], dk[C::kDRegs];
  uint32_t dv_int[C::kDRegs];
#pragma unroll
  for (int i = 0; i < C::kDRegs; ++i) dv[i] = dk[i] = 0.f;
  float s_acc[C::kSRegs], dp_acc[C::kSRegs];

  // S^T = K Q^T and dP^T = V dO^T of stage s as one committed group.
  auto issue_sdp = [&](int s) { issue_pair<typename C::MmaS, D / 16>(dK_, dQ_, s_acc, dV_, dDO_, dp_acc, s); };
  // prod = frag^T B (INT8, int32 sums) with B the stage's dO'^T (dV) or Q^T (dK) image; not committed.
  // accumulate: add onto prod (kInPlace's dV after its first step) instead of starting from zero.
  auto issue_int8 = [&](const uint32_t (&frag)[C::kARegs], bool dv_product, int s, uint32_t (&prod)[C::kDRegs],
                        bool accumulate = false) {
#pragma unroll
    for (int kb = 0; kb < kBlockM / 32; ++kb)
      wgmma_rs<typename C::MmaD>(&frag[4 * kb], uint64_t(dv_product ? dDOT_(0, 0, kb, s) : dQT_(0, 0, kb, s)), prod,
                                 kb == 0 && !accumulate ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                 std::make_index_sequence<C::kDRegs>{});
  };
  // kDk16: dk += dS^T Q with dS^T's bf16 A fragment and the stage's Q tile; not committed.
  auto issue_dk16 = [&](const uint32_t (&frag)[C::kSRegs / 2], int s) {
    if constexpr (kDk16) {
#pragma unroll
      for (int kb = 0; kb < kBlockM / 16; ++kb)
        wgmma_rs<typename C::Mma16Rs>(&frag[4 * kb], uint64_t(dQmn_(0, 0, kb, s)), dk, cute::GMMA::ScaleOut::One,
                                      std::make_index_sequence<C::kDRegs>{});
    }
  };
  auto add_scaled = [&](float (&acc)[C::kDRegs], const uint32_t (&prod)[C::kDRegs], float factor) {
#pragma unroll
    for (int v = 0; v < C::kDRegs; ++v) acc[v] = fmaf(i2f(prod[v]), factor, acc[v]);
  };
  // Step n's softmax gradient from the retired S^T / dP^T into pt (P~) and ds (dS * kDsPrescale), fp32 in the
  // accumulator layout (value v of this thread: key row 16 warp + g + 8 ((v >> 1) & 1), query column
  // 8 (v >> 2) + 2 t + (v & 1)), and the two products' scale factors. Separate arrays, not the
  // accumulators: ptxas serializes every wgmma (C7515) when registers of an accumulator are written
  // while another product is in flight.
  auto softmax_grad = [&](int n, int s, float (&pt)[C::kSRegs], float (&ds)[C::kSRegs], float& dv_factor,
                          float& dk_factor, float& s_big) {
    const float* vec = sp.vec + s * kVecFloats;
    const int i = i0 + n % per_head;  // the step's query block
    float amax = 0.f;
    auto scores = [&](auto cap_of) {  // cap_of(v, col): value v's exp2 cap
#pragma unroll
      for (int v = 0; v < C::kSRegs; ++v) {
        const int col = 8 * (v >> 2) + 2 * t + (v & 1);
        pt[v] = exp2_mufu(fminf(s_acc[v] * p.qk_scale - vec[kVecM + col], cap_of(v, col)));  // P~
        const float pr = pt[v] * vec[kVecInvL + col];                                     // P * kDsPrescale
        ds[v] = pr * (dp_acc[v] - vec[kVecDelta + col]);
        amax = fmaxf(amax, fabsf(ds[v]));
      }
    };
    if (p.vis.causal && i < i0 + kBlockN / kBlockM) {  // a query block holding some of the CTA's keys
      scores([&](int v, int col) {
        const int hh = (v >> 1) & 1;
        return key0 + 8 * hh > i * kBlockM + col ? masked_cap() : cap_row[hh];
      });
    } else {
      scores([&](int v, int) { return cap_row[(v >> 1) & 1]; });
    }
    if constexpr (kDk16) {  // dS goes to bf16 unscaled
      s_big = dk_factor = 0.f;
      dv_factor = vec[kVecDvFactor];
    } else {
      // alternated by step, not by query block (a GQA wrap repeats a block's parity)
      const DsTileScale sc(amax, sp.red + (cw * 2 + (n & 1)) * 4, warp, lane, kFirstNamedBarrier + cw);
      s_big = sc.s_big;
      dv_factor = vec[kVecDvFactor];
      dk_factor = sc.sds * vec[kVecSQ] * p.sm_scale;
    }
  };
  // The INT8 A fragments of dV (P~ codes) and dK (dS codes). Packed only once the registers they go
  // to are free: with dS in fp32 beside a product's int32 result and dV, dK the registers spill at hd128.
  // kDk16: ds_frag is dS^T's bf16 A fragment instead, kSRegs / 2 registers (register j: values 2 j,
  // 2 j + 1, the accumulator layout's pairs).
  auto pack = [&](const float (&pt)[C::kSRegs], const float (&ds)[C::kSRegs], float s_big, uint32_t (&p_frag)[C::kARegs],
                  uint32_t (&ds_frag)[kDsRegs]) {
    if constexpr (kDk16) {
#pragma unroll
      for (int j = 0; j < C::kSRegs / 2; ++j) ds_frag[j] = Bf16::pack2(ds[2 * j], ds[2 * j + 1]);
    } else {
      const float r = s_big > 0.f ? 1.f / s_big : 0.f;  // scale 0 (an all-zero tile): codes 0
      pack_a([&](int v) { return code_by_reciprocal(ds[v], s_big, r); }, ds_frag);
    }
    pack_a([&](int v) { return code_bits(__fmul_rn(pt[v], 127.f) + kMagic); }, p_frag);  // rint(fl(127 P~)), as the reference
  };
  auto release = [&](int s) {  // every read of stage s is done (products retired, vec values in registers)
    if (lane == 0) Barrier::arrive(&sp.empty[s]);
  };

  Barrier::wait(sp.kv_full, 0);
  float pt[C::kSRegs], ds[C::kSRegs];
  if constexpr (kSchedule == Schedule::kSerial) {
    uint32_t prod[C::kDRegs];  // int32 bits (CuTe types INT8 products' accumulators as uint32_t)
    uint32_t p_frag[C::kARegs], ds_frag[kDsRegs];
    auto issue_dk = [&](int s) {  // dK's product of stage s (in the open group): into prod, or onto dk
      if constexpr (kDk16) {
        issue_dk16(ds_frag, s);
      } else {
        issue_int8(ds_frag, /*dv_product=*/false, s, prod);
      }
    };
    for (int n = 0; n < steps; ++n) {
      const int s = n % C::kStages;
      Barrier::wait(&sp.full[s], (n / C::kStages) & 1);
      issue_sdp(s);
      cute::warpgroup_wait<0>();
      fence_regs(s_acc);
      fence_regs(dp_acc);
      float dv_factor, dk_factor, s_big;
      softmax_grad(n, s, pt, ds, dv_factor, dk_factor, s_big);
      pack(pt, ds, s_big, p_frag, ds_frag);
      if constexpr (kInPlace || kDk16) {  // dV and dK, one group (dV into prod when scaled per step)
        uint32_t (&dv_dst)[C::kDRegs] = kInPlace ? dv_int : prod;
        fence_regs(dv_dst);
        fence_regs(prod);
        if constexpr (kDk16) fence_regs(dk);
        fence_regs(p_frag);
        fence_regs(ds_frag);
        cute::warpgroup_arrive();
        issue_int8(p_frag, /*dv_product=*/true, s, dv_dst, /*accumulate=*/kInPlace && n > 0);
        issue_dk(s);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs(dv_dst);
        fence_regs(prod);
        if constexpr (kDk16) fence_regs(dk);
        fence_regs(p_frag);
        fence_regs(ds_frag);
        if constexpr (!kInPlace) add_scaled(dv, prod, dv_factor);
      } else {
        fence_regs(prod);
        fence_regs(p_frag);
        cute::warpgroup_arrive();
        issue_int8(p_frag, /*dv_product=*/true, s, prod);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs(prod);
        fence_regs(p_frag);
        add_scaled(dv, prod, dv_factor);
        fence_regs(prod);
        fence_regs(ds_frag);
        cute::warpgroup_arrive();
        issue_int8(ds_frag, /*dv_product=*/false, s, prod);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs(prod);
        fence_regs(ds_frag);
      }
      release(s);
      if constexpr (!kDk16) add_scaled(dk, prod, dk_factor);
    }
  } else {
    // Step i: issue S^T / dP^T (i), then dV, dK (i - 1); wait for S^T / dP^T (i) only (groups retire
    // in order) and run its softmax gradient while dV, dK (i - 1) are on the tensor cores; then retire
    // those, add them, release stage i - 1 and pack step i's fragments. Every wait in the loop has a
    // constant count and every issue is unconditional, so ptxas can follow which group each wait
    // retires (a conditional issue made it serialize every wgmma: C7514).
    uint32_t prod_v[C::kDRegs], prod_k[C::kDRegs];  // kDk16: dK's product goes onto dk, prod_k is unused
    uint32_t p_frag[C::kARegs], ds_frag[kDsRegs];
    float dv_prev, dk_prev, s_big;
    // kInPlace: dV's product goes onto dv_int, prod_v is unused
    uint32_t (&dv_dst)[C::kDRegs] = kInPlace ? dv_int : prod_v;
    auto issue_products = [&](int step) {  // dV, dK from the packed fragments of step `step`'s stage
      fence_regs(dv_dst);
      fence_regs(prod_k);
      if constexpr (kDk16) fence_regs(dk);
      fence_regs(p_frag);
      fence_regs(ds_frag);
      cute::warpgroup_arrive();
      issue_int8(p_frag, /*dv_product=*/true, step % C::kStages, dv_dst, /*accumulate=*/kInPlace && step > 0);
      if constexpr (kDk16) {
        issue_dk16(ds_frag, step % C::kStages);
      } else {
        issue_int8(ds_frag, /*dv_product=*/false, step % C::kStages, prod_k);
      }
      cute::warpgroup_commit_batch();
    };
    auto retire_products = [&]() {
      cute::warpgroup_wait<0>();
      fence_regs(dv_dst);
      fence_regs(prod_k);
      if constexpr (kDk16) fence_regs(dk);
      fence_regs(p_frag);
      fence_regs(ds_frag);
      if constexpr (!kInPlace) add_scaled(dv, prod_v, dv_prev);
      if constexpr (!kDk16) add_scaled(dk, prod_k, dk_prev);
    };
    if (steps > 0) {
      Barrier::wait(&sp.full[0], 0);
      issue_sdp(0);
      cute::warpgroup_wait<0>();
      fence_regs(s_acc);
      fence_regs(dp_acc);
      softmax_grad(0, 0, pt, ds, dv_prev, dk_prev, s_big);
      pack(pt, ds, s_big, p_frag, ds_frag);
      for (int n = 1; n < steps; ++n) {
        const int s = n % C::kStages;
        Barrier::wait(&sp.full[s], (n / C::kStages) & 1);
        issue_sdp(s);
        issue_products(n - 1);
        cute::warpgroup_wait<1>();
        fence_regs(s_acc);
        fence_regs(dp_acc);
        float dv_factor, dk_factor;
        softmax_grad(n, s, pt, ds, dv_factor, dk_factor, s_big);
        retire_products();
        release((n - 1) % C::kStages);
        dv_prev = dv_factor;
        dk_prev = dk_factor;
        pack(pt, ds, s_big, p_frag, ds_frag);
      }
      issue_products(steps - 1);
      retire_products();
    }
  }
  if constexpr (kInPlace) {  // no step set dV's accumulator
    if (steps == 0) {
#pragma unroll
      for (int v = 0; v < C::kDRegs; ++v) dv_int[v] = 0u;
    }
  }

  // Epilogue: value v at key row 16 warp + g + 8 ((v >> 1) & 1), channel 8 (v >> 2) + 2 t + (v & 1).
  const int64_t row0 = static_cast<int64_t>(bh) * p.skv + kv_block * kBlockN + cw * kKeysPerWG + 16 * warp + g;
#pragma unroll
  for (int v = 0; v < C::kDRegs; v += 2) {
    const int col = 8 * (v >> 2) + 2 * t;
    const int64_t off = (row0 + 8 * ((v >> 1) & 1)) * D + col;
    float2 dv2 = make_float2(dv[v], dv[v + 1]);
    if constexpr (kInPlace) {  // the int32 sums (beyond i2f's 2^22) times the channels' scales
      const float2 sc = *reinterpret_cast<const float2*>(p.dv_channel_scale + static_cast<int64_t>(bh) * D + col);
      dv2 = make_float2(static_cast<float>(static_cast<int32_t>(dv_int[v])) * sc.x,
                        static_cast<float>(static_cast<int32_t>(dv_int[v + 1])) * sc.y);
    }
    float2 dk2 = make_float2(dk[v], dk[v + 1]);
    if constexpr (kDk16) {  // the bf16 product summed dS * kDsPrescale: times sm_scale / kDsPrescale
      const float sc = p.sm_scale * (1.f / kDsPrescale);
      dk2 = make_float2(dk2.x * sc, dk2.y * sc);
    }
    *reinterpret_cast<float2*>(p.dk + off) = dk2;
    *reinterpret_cast<float2*>(p.dv + off) = dv2;
  }
}

}  // namespace sagebwd_sm90
