// SageBwd's dQ kernel, the dK/dV kernel's counterpart (dkdv_kernel.cuh): the same
// numerics (16-bit scores, the shipped dS tiles), per 64-query row block and 64-key tile
//   S = Q K^T, dP = dO V^T (16-bit wgmma, fp32 sums), P~ = exp2(min(S * qk_scale - m, 0)),
//   dS = P~ / l (dP - delta), dQ += (dS^ int8 per 64x64 tile) . K^ (INT8 per 64-key block)
//   * (s_dS * s_K_j * scale).
// CTA: 128 queries of one (b, h); warpgroup 0 is the producer, warpgroups 1 and 2 own 64 queries each
// (Q and dO loaded once) and loop over every key block. Operands are swizzled-tile images (the
// image pre-pass): Q, dO (16-bit, 64 x D per warpgroup, the A operands of S and dP), per key block K, V (16-bit,
// 64 x D, the B operands), K^T (INT8, D x 64 keys in the A fragments' key order, dQ's B operand) and
// K's block scale. A thread's two query rows keep their m, 2^32 / l and delta in registers.
// Masks and causality (api.h Visibility): the CTA visits the key blocks with a visible key (the
// caller's ascending list), up to its last query's block when causal; a block with masked keys or
// with keys after some of the CTA's queries compares per score, the others run the plain step. GQA:
// query head h reads the tiles of KV head h / group.
#pragma once

#include "dkdv_kernel.cuh"

namespace sagebwd_sm90 {

// How dQ sums its products.
enum class DqAcc {
  // dS^ INT8 per 64 x 64 tile times K^T (the smoothed K, INT8 per 64-key block): each step's int32
  // result times the tile's scales, added to an fp32 dQ (the shipped numerics, the paper's INT8 product).
  kInt8PerStep,
  // dS (times kDsPrescale) rounded to bf16, no scale, times the smoothed K rounded to bf16 (its own
  // 16-bit image, in K^T's place): the fp32 sums stay in the wgmma accumulator across the loop, so a
  // step has no dS tile scale, no INT8 codes of dS and no conversion or scaled add of dQ. The K must
  // be the smoothed one: the rows of dS do not sum to zero exactly, and K's mean would multiply the
  // residue (eval/results/sagebwd_error_budget_cpu.md, "dQ and dK as 16-bit products"). bf16 only.
  kBf16InPlace,
};

template <int D, class Elem, DqAcc kAcc = DqAcc::kInt8PerStep>
struct DqConfig {
  using C = Config<D, Elem>;  // the layouts, atoms and tile sizes are the dK/dV kernel's
  static constexpr bool kKs16 = kAcc == DqAcc::kBf16InPlace;
  // hd128: a 16-bit K tile per stage instead of K^T's INT8 one leaves room for 3 stages
  static constexpr int kStages = D == 128 ? (kKs16 ? 3 : 4) : 6;
  using LayoutRows = typename C::LayoutKV;  // 64 rows x D, 16-bit, K-major: Q / dO (A), K / V (B) tiles
  using LayoutKV = decltype(cute::tile_to_shape(
      typename C::Atom16{}, cute::Shape<cute::Int<kKeysPerWG>, cute::Int<D>, cute::Int<kStages>>{}));
  using LayoutT8 = decltype(cute::tile_to_shape(
      typename C::Atom8{}, cute::Shape<cute::Int<D>, cute::Int<kKeysPerWG>, cute::Int<kStages>>{}));
  // kBf16InPlace: the smoothed K's 16-bit tiles (LayoutKV's bytes) as dQ's MN-major B operand, (D, 64 keys)
  using LayoutKsmn = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Elem>{}, cute::Shape<cute::Int<D>, cute::Int<kKeysPerWG>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  static constexpr int kKTileBytes = kKs16 ? C::kTile16Bytes : C::kTile8Bytes;  // dQ's K operand per key block
  static constexpr int kScaleBytes = kKScaleFloats * 4;  // the key block's K scale, padded to a bulk copy's 16 bytes
  static constexpr int kSmemQ = kConsumerWGs * C::kTile16Bytes;
  static constexpr int kSmemDO = kConsumerWGs * C::kTile16Bytes;
  static constexpr int kSmemK = kStages * C::kTile16Bytes;
  static constexpr int kSmemV = kStages * C::kTile16Bytes;
  static constexpr int kSmemKT = kStages * kKTileBytes;
  static constexpr int kSmemScale = kStages * kScaleBytes;
  static constexpr int kSmemRed = kConsumerWGs * 2 * 4 * 4;
  static constexpr int kSmemBarriers = 8 * (2 * kStages + 1);
  static constexpr int kSmemBytes = kSmemQ + kSmemDO + kSmemK + kSmemV + kSmemKT + kSmemScale + kSmemRed +
                                    kSmemBarriers + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "one CTA's shared memory");
  static constexpr int kStageTxBytes = 2 * C::kTile16Bytes + kKTileBytes + kScaleBytes;
};

// kSchedule: kSerial waits for each product at once; kOverlap keeps S / dP of the next step on the
// tensor cores while a step's dQ product is scaled and added.
template <int D, class Elem, Schedule kSchedule, DqAcc kAcc = DqAcc::kInt8PerStep>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const DqParams p) {
  using C = Config<D, Elem>;
  using Q = DqConfig<D, Elem, kAcc>;
  constexpr bool kDq16 = Q::kKs16;
  static_assert(!kDq16 || std::is_same_v<Elem, cute::bfloat16_t>, "the bf16 dQ product takes bf16 operands");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = smem_raw + sage_common::smem_align_pad<1024>(sage_common::smem_addr(smem_raw));
  uint8_t* s_q = base;
  uint8_t* s_do = s_q + Q::kSmemQ;
  uint8_t* s_k = s_do + Q::kSmemDO;
  uint8_t* s_v = s_k + Q::kSmemK;
  uint8_t* s_kt = s_v + Q::kSmemV;
  float* s_scale = reinterpret_cast<float*>(s_kt + Q::kSmemKT);
  float* s_red = s_scale + Q::kSmemScale / 4;
  uint64_t* full = reinterpret_cast<uint64_t*>(s_red + Q::kSmemRed / 4);
  uint64_t* empty = full + Q::kStages;
  uint64_t* q_full = empty + Q::kStages;

  const int q_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int bh = b * p.heads + h;
  const int bh_kv = (b * p.heads + h) / p.group;  // = b * (heads / group) + h / group: K, V, K^T, entries
  const int nk = p.skv / kKeysPerWG;
  const int wg = threadIdx.x / 128;
  using Split = sage_common::sm90::RegisterSplit<24, 240, kConsumerWGs>;
  // Step n's key block (the caller's list of visible blocks, or n), and the number of steps: the
  // visible blocks up to `last`, this CTA's last query's block when causal.
  const int32_t* blocks = p.vis.key_blocks != nullptr ? p.vis.key_blocks + static_cast<int64_t>(b) * nk : nullptr;
  auto key_block = [&](int n) { return blocks != nullptr ? __ldg(blocks + n) : n; };
  const int last = p.vis.causal ? min(nk - 1, (q_block * kBlockN + kBlockN - 1) / kKeysPerWG) : nk - 1;
  int steps = last + 1;
  if (blocks != nullptr) {  // the first list entry past `last` (the padding, nk, is past every block)
    int lo = 0, hi = nk;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (__ldg(blocks + mid) <= last) lo = mid + 1; else hi = mid;
    }
    steps = lo;
  }

  init_barriers(full, empty, Q::kStages, q_full);

  if (wg == 0) {
    Split::producer();
    if (threadIdx.x == 0) {
      using sage_common::sm90::bulk_copy_g2s;
      const int64_t q_off = (static_cast<int64_t>(bh) * (p.sq / kBlockM) + 2 * q_block) * C::kTile16Bytes;
      Barrier::arrive_and_expect_tx(q_full, Q::kSmemQ + Q::kSmemDO);
      bulk_copy_g2s(p.q + q_off, q_full, s_q, Q::kSmemQ);
      bulk_copy_g2s(p.dO + q_off, q_full, s_do, Q::kSmemDO);
      const int64_t blk0 = static_cast<int64_t>(bh_kv) * nk;
      for (int n = 0; n < steps; ++n) {
        const int s = n % Q::kStages, r = n / Q::kStages;
        if (r > 0) Barrier::wait(&empty[s], (r - 1) & 1);
        Barrier::arrive_and_expect_tx(&full[s], Q::kStageTxBytes);
        const int64_t blk = blk0 + key_block(n);
        bulk_copy_g2s(p.k + blk * C::kTile16Bytes, &full[s], s_k + s * C::kTile16Bytes, C::kTile16Bytes);
        bulk_copy_g2s(p.v + blk * C::kTile16Bytes, &full[s], s_v + s * C::kTile16Bytes, C::kTile16Bytes);
        bulk_copy_g2s(p.kt + blk * Q::kKTileBytes, &full[s], s_kt + s * Q::kKTileBytes, Q::kKTileBytes);
        bulk_copy_g2s(p.k_scale + blk * kKScaleFloats, &full[s], s_scale + s * kKScaleFloats, Q::kScaleBytes);
      }
    }
    return;
  }
  Split::consumer();
  const int cw = wg - 1;  // this warpgroup's 64 queries
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  namespace sm90 = sage_common::sm90;
  const auto dQa = sm90::gmma_desc_a<typename C::TiledMmaS, typename Q::LayoutRows>(
      reinterpret_cast<Elem*>(s_q + cw * C::kTile16Bytes), tid);
  const auto dDOa = sm90::gmma_desc_a<typename C::TiledMmaS, typename Q::LayoutRows>(
      reinterpret_cast<Elem*>(s_do + cw * C::kTile16Bytes), tid);
  const auto dKb = sm90::gmma_desc_b<typename C::TiledMmaS, typename Q::LayoutKV>(reinterpret_cast<Elem*>(s_k), tid);
  const auto dVb = sm90::gmma_desc_b<typename C::TiledMmaS, typename Q::LayoutKV>(reinterpret_cast<Elem*>(s_v), tid);
  const auto dKTb = sm90::gmma_desc_b<typename C::TiledMmaD, typename Q::LayoutT8>(reinterpret_cast<int8_t*>(s_kt), tid);
  static_assert(cute::size<2>(decltype(dKb){}) == D / 16 && cute::size<3>(decltype(dKb){}) == Q::kStages,
                "16-bit B descriptors: one per 16-wide k-step and stage");
  static_assert(cute::size<2>(decltype(dKTb){}) == kKeysPerWG / 32 && cute::size<3>(decltype(dKTb){}) == Q::kStages,
                "INT8 B descriptors: one per 32-key k-step and stage");
  // kDq16: the stage's smoothed K tile as dQ's B operand (otherwise unused: 0)
  const auto dKsb = [&] {
    if constexpr (kDq16) {
      const auto d = sm90::gmma_desc_b<typename C::TiledMma16Rs, typename Q::LayoutKsmn>(reinterpret_cast<Elem*>(s_kt), tid);
      static_assert(cute::size<2>(decltype(d){}) == kKeysPerWG / 16 && cute::size<3>(decltype(d){}) == Q::kStages,
                    "bf16 dQ descriptors: one per 16-key k-step and stage");
      return d;
    } else {
      return 0;
    }
  }();

  // This thread's query rows: 16 warp + g + 8 h, h = 0, 1 (value v's h is (v >> 1) & 1).
  const int query0 = q_block * (kConsumerWGs * kBlockM) + cw * kBlockM + 16 * warp + g;
  float m_row[2], invl_row[2], delta_row[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t row = static_cast<int64_t>(bh) * p.sq + query0 + 8 * hh;
    m_row[hh] = p.m[row];
    invl_row[hh] = p.inv_l[row];
    delta_row[hh] = p.delta[row];
  }
  float dq[C::kDRegs];
#pragma unroll
  for (int v = 0; v < C::kDRegs; ++v) dq[v] = 0.f;
  // kDq16: dq is the bf16 product's accumulator itself (from these zeros), ds_frag dS's bf16 A fragment
  float s_acc[C::kSRegs], dp_acc[C::kSRegs], ds[C::kSRegs];
  constexpr int kDsRegs = kDq16 ? C::kSRegs / 2 : C::kARegs;
  uint32_t prod[C::kDRegs], ds_frag[kDsRegs];

  // S = Q K_j^T and dP = dO V_j^T of stage s, one committed group.
  auto issue_sdp = [&](int s) { issue_pair<typename C::MmaS, D / 16>(dQa, dKb, s_acc, dDOa, dVb, dp_acc, s); };
  // Step n's dS codes from the retired S, dP into ds_frag, and its dQ scale factor.
  auto softmax_grad = [&](int n, int s) {
    fence_regs(s_acc);
    fence_regs(dp_acc);
#pragma unroll
    for (int v = 0; v < C::kSRegs; ++v) {
      const int hh = (v >> 1) & 1;
      const float pt = exp2_mufu(fminf(s_acc[v] * p.qk_scale - m_row[hh], 0.f));  // P~
      ds[v] = pt * invl_row[hh] * (dp_acc[v] - delta_row[hh]);                    // dS * kDsPrescale
    }
    // Masked scores: dS = 0 (their P~ may not be: a masked key's scores are those of a zeroed row).
    // Causal: a key block whose last key comes after the CTA's first query holds masked scores.
    const float* entry = s_scale + s * kKScaleFloats;  // api.h kKScale*: the block's index and word
    const int j = __float_as_int(entry[kKScaleBlock]);
    const uint64_t word = *reinterpret_cast<const uint64_t*>(entry + kKScaleWord);
    if (word != ~0ull || (p.vis.causal && j * kKeysPerWG + kKeysPerWG - 1 > q_block * kBlockN)) {
      // key 8 (v >> 2) + 2 t + (v & 1) of the block is visible to query0 + 8 h up to this offset
      const int last[2] = {p.vis.causal ? query0 - j * kKeysPerWG : kKeysPerWG,
                           p.vis.causal ? query0 + 8 - j * kKeysPerWG : kKeysPerWG};
      const uint64_t cols = word >> (2 * t);
#pragma unroll
      for (int v = 0; v < C::kSRegs; ++v) {
        const int c = 8 * (v >> 2) + (v & 1);  // the column less 2 t
        if (!((cols >> c) & 1) || c + 2 * t > last[(v >> 1) & 1]) ds[v] = 0.f;
      }
    }
    if constexpr (kDq16) {  // no tile scale: pack_ds16 rounds dS to bf16 once the fragment is free
      return 0.f;
    } else {
      float amax = 0.f;
#pragma unroll
      for (int v = 0; v < C::kSRegs; ++v) amax = fmaxf(amax, fabsf(ds[v]));
      const DsTileScale sc(amax, s_red + (cw * 2 + (n & 1)) * 4, warp, lane, kFirstNamedBarrier + cw);
      const float r = sc.s_big > 0.f ? 1.f / sc.s_big : 0.f;
      pack_a([&](int v) { return code_by_reciprocal(ds[v], sc.s_big, r); }, ds_frag);
      return sc.sds * entry[kKScaleValue] * p.sm_scale;
    }
  };
  auto pack_ds16 = [&] {  // kDq16: dS's bf16 A fragment (register j: values 2 j, 2 j + 1); INT8: packed already
    if constexpr (kDq16) {
#pragma unroll
      for (int j = 0; j < C::kSRegs / 2; ++j) ds_frag[j] = Bf16::pack2(ds[2 * j], ds[2 * j + 1]);
    }
  };
  auto issue_dq = [&](int s) {  // prod = dS^ K^ of stage s (kDq16: dq += dS K_s), one committed group
    if constexpr (kDq16) {
      fence_regs(dq);
      fence_regs(ds_frag);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kb = 0; kb < kKeysPerWG / 16; ++kb)
        wgmma_rs<typename C::Mma16Rs>(&ds_frag[4 * kb], uint64_t(dKsb(0, 0, kb, s)), dq, cute::GMMA::ScaleOut::One,
                                      std::make_index_sequence<C::kDRegs>{});
      cute::warpgroup_commit_batch();
    } else {
      fence_regs(prod);
      fence_regs(ds_frag);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kb = 0; kb < kKeysPerWG / 32; ++kb)
        wgmma_rs<typename C::MmaD>(&ds_frag[4 * kb], uint64_t(dKTb(0, 0, kb, s)), prod,
                                   kb == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                                   std::make_index_sequence<C::kDRegs>{});
      cute::warpgroup_commit_batch();
    }
  };
  auto add_dq = [&](int s, float factor) {  // after dQ's product of stage s retired (kDq16: nothing to add)
    if constexpr (kDq16) {
      fence_regs(dq);
      fence_regs(ds_frag);
      if (lane == 0) Barrier::arrive(&empty[s]);
    } else {
      fence_regs(prod);
      fence_regs(ds_frag);
      if (lane == 0) Barrier::arrive(&empty[s]);
#pragma unroll
      for (int v = 0; v < C::kDRegs; ++v) dq[v] = fmaf(i2f(prod[v]), factor, dq[v]);
    }
  };
  auto wait_full = [&](int n) { Barrier::wait(&full[n % Q::kStages], (n / Q::kStages) & 1); };

  Barrier::wait(q_full, 0);
  if constexpr (kSchedule == Schedule::kSerial) {
    for (int n = 0; n < steps; ++n) {
      const int s = n % Q::kStages;
      wait_full(n);
      issue_sdp(s);
      cute::warpgroup_wait<0>();
      const float factor = softmax_grad(n, s);
      pack_ds16();
      issue_dq(s);
      cute::warpgroup_wait<0>();
      add_dq(s, factor);
    }
  } else if (kDq16 && steps > 0) {
    // Step n: S / dP (n) go to the tensor cores first, then dQ (n - 1), whose accumulator needs no
    // scale-add; waiting for S / dP (n) only (groups retire in order), step n's softmax gradient runs
    // while dQ (n - 1) is on the tensor cores, and dS (n) is packed once that retired (its A fragment
    // is dQ (n - 1)'s operand until then). The last step is peeled (C7514).
    wait_full(0);
    issue_sdp(0);
    cute::warpgroup_wait<0>();
    softmax_grad(0, 0);
    pack_ds16();
    for (int n = 1; n < steps; ++n) {
      const int s = n % Q::kStages;
      wait_full(n);
      issue_sdp(s);
      issue_dq((n - 1) % Q::kStages);
      cute::warpgroup_wait<1>();
      softmax_grad(n, s);
      cute::warpgroup_wait<0>();
      add_dq((n - 1) % Q::kStages, 0.f);
      pack_ds16();
    }
    issue_dq((steps - 1) % Q::kStages);
    cute::warpgroup_wait<0>();
    add_dq((steps - 1) % Q::kStages, 0.f);
  } else if (steps > 0) {
    // Step j: its dQ product goes to the tensor cores first, then S / dP of step j + 1; waiting for the
    // dQ product only (groups retire in order), its scale-add runs while S / dP (j + 1) are computed.
    // The S / dP registers are free by then (dS is packed), so this fits hd128's registers. The last
    // step is peeled so every issue in the loop is unconditional and every wait constant (C7514).
    wait_full(0);
    issue_sdp(0);
    for (int n = 0; n + 1 < steps; ++n) {
      const int s = n % Q::kStages;
      cute::warpgroup_wait<0>();
      const float factor = softmax_grad(n, s);
      issue_dq(s);
      wait_full(n + 1);
      issue_sdp((n + 1) % Q::kStages);
      cute::warpgroup_wait<1>();
      add_dq(s, factor);
    }
    const int s = (steps - 1) % Q::kStages;
    cute::warpgroup_wait<0>();
    const float factor = softmax_grad(steps - 1, s);
    issue_dq(s);
    cute::warpgroup_wait<0>();
    add_dq(s, factor);
  }

  const int64_t row0 = static_cast<int64_t>(bh) * p.sq + query0;
#pragma unroll
  for (int v = 0; v < C::kDRegs; v += 2) {
    const int64_t off = (row0 + 8 * ((v >> 1) & 1)) * D + 8 * (v >> 2) + 2 * t;
    float2 dq2 = make_float2(dq[v], dq[v + 1]);
    if constexpr (kDq16) {  // the bf16 product summed dS * kDsPrescale: times sm_scale / kDsPrescale
      const float sc = p.sm_scale * (1.f / kDsPrescale);
      dq2 = make_float2(dq2.x * sc, dq2.y * sc);
    }
    *reinterpret_cast<float2*>(p.dq + off) = dq2;
  }
}

}  // namespace sagebwd_sm90
