// Fused quantization pre-pass (sage8 spec steps 1-4) in two launches:
//   stats_kernel: per (b, kv head) k mean and v channel absmax, split over token chunks with a
//                 deterministic last-block reduction (no float atomics, so every run and every
//                 CUDA-graph replay is bit-identical; common/token_stats.cuh, which the FP4
//                 pre-pass runs too); extra blocks turn the bool key mask into
//                 bit words and the per-batch kv_len = last attended key + 1 (no host sync).
//   quant_kernel: INT8 Q per token, INT8 smoothed K per 128-key block (kKB: 64 for long_tile
//                 forward variants), FP8 V per channel,
//                 each written as the swizzled shared-memory image the attention kernel copies
//                 with one bulk copy per tile (tile_config.hpp). V is transposed on the way, with
//                 the key permutation that lets P stay in registers. Padding rows/keys are 0.
//                 For a pv_16bit forward variant (kPrepassV16Image) V is not quantized: its blocks
//                 are the 16-bit input laid out as the kernel's MN-major smem tile (quant_v16_block).
// With kPrepassPdl (launch.h) both launches after the first start early (common/sm90/pdl.cuh): the
// quant launch's Q blocks overlap the stats launch's tail, and the forward kernel's prologue
// overlaps the quant launch's.
// Masked keys (numerics contract, sage8_quantize): their K and V rows are selected away (never
// multiplied, so a NaN or Inf there vanishes) before anything is reduced: the k mean is taken
// over attended keys only (0 when a batch row attends none), and a masked key is code 0 excluded
// from its K block's absmax and a zero row of V (FP8 channel scales). Every absmax ignores NaN
// and Inf (finite_abs); INT8 codes of NaN are 0, of +-Inf +-127; V's non-finite elements are
// quantized as 0 and recorded in v_first for the epilogue. A Q row with a non-finite element
// stores scale NaN (its codes use the finite absmax, as the reference): the epilogue writes that
// row as NaN, so it stays in its row.
// Inputs are read through arbitrary (b, h, s) strides, so BHSD views of BSHD tensors cost nothing.
#pragma once

#include <cstdint>
#include <utility>

#include "../common/l2_hint.cuh"
#include "../common/launch.cuh"
#include "../common/sm90/pdl.cuh"
#include "../common/token_stats.cuh"
#include "launch.h"
#include "numerics.hpp"
#include "tile_config.hpp"

namespace sage_sm90 {

constexpr int kPrepassThreads = 256;

template <int D>
struct RowTiling {
  static constexpr int kLanes = D / 8;                        // threads per token row (8 elts each)
  static constexpr int kRowsPerPass = kPrepassThreads / kLanes;
};

// Compile-time pre-pass options (the kernel-side bits of launch.h's pre-pass mode, and the forward
// variant's kPrepassV16Image). A template axis of every pre-pass kernel as its int bits (nvcc's host
// stubs cannot spell a class-type template argument).
struct PrepassOpts {
  bool batch;     // kPrepassBatchLoads
  bool l2;        // kPrepassL2Reuse
  bool fast_div;  // kPrepassFastDiv
  bool v16;       // kPrepassV16Image: V's blocks as the 16-bit image (quant_v16_block)
  static constexpr PrepassOpts of(int mode) {
    return {(mode & kPrepassBatchLoads) != 0, (mode & kPrepassL2Reuse) != 0, (mode & kPrepassFastDiv) != 0,
            (mode & kPrepassV16Image) != 0};
  }
};
constexpr int kPrepassKernelBits = kPrepassBatchLoads | kPrepassL2Reuse | kPrepassFastDiv;

// kPrepassL2Reuse: the stats launch reads K and V marked evict_last (the quant launch reads them
// again), the quant launch reads K, V and Q marked evict_first (their last use): K and V's second
// read hits L2 as far as it holds them, and Q's single-use traffic does not evict them.
template <int kM>
constexpr sage_common::L2Hint kFirstReadHint =
    PrepassOpts::of(kM).l2 ? sage_common::L2Hint::kEvictLast : sage_common::L2Hint::kNormal;
template <int kM>
constexpr sage_common::L2Hint kLastReadHint =
    PrepassOpts::of(kM).l2 ? sage_common::L2Hint::kEvictFirst : sage_common::L2Hint::kNormal;

// The divisor of a block's / row's / channel's codes: the scale itself (x / s per element) or,
// with kPrepassFastDiv, its reciprocal computed once (numerics.hpp ScaleDivider: same quotients).
template <int kM>
__device__ __forceinline__ auto scale_divisor(float s) {
  if constexpr (PrepassOpts::of(kM).fast_div) {
    return ScaleDivider(s);
  } else {
    return s;
  }
}

template <int D, DType kIn, int kM>
__device__ void quant_q_block(const PrepassParams& p, int blk);

// Q image tiles the pre-pass quantizes (one block each): none with p.skip_q (set by nothing since
// FwdOptions::q_in_kernel, whose forward quantized Q itself, was deleted).
__host__ __device__ __forceinline__ int q_block_count(const PrepassParams& p) {
  return p.skip_q ? 0 : p.B * p.Hq * p.n_q_tiles;
}

// Whether key `key` of batch row b takes part (inside the sequence and attended).
using sage_common::key_attended;

// Eight 16-bit inputs kept as raw bits between load and use: half the registers of 8 floats, so
// the batched-load paths keep the quant kernel's occupancy. Zero bits are +0 in fp16 and bf16.
template <sage_common::L2Hint kHint>
__device__ __forceinline__ uint4 load_raw8(const void* ptr) {
  return sage_common::ldg16<kHint>(ptr);
}

// ---- stats ---------------------------------------------------------------------------------------
// Mask words per batch row: those of p.n_kv_tiles K blocks of kKB keys (spelled out at each use: a
// helper function gave ptxas another register plan for the stats kernels).
template <int D, int kKB>
__device__ void mask_bits_block(const PrepassParams& p, int mb) {
  const int words_per_b = kKB / 32 * p.n_kv_tiles;
  const int blocks_per_b = (words_per_b + 7) / 8;
  const int b = mb / blocks_per_b;
  const int w = (mb % blocks_per_b) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (w >= words_per_b) return;
  const int key = w * 32 + lane;
  const bool on = key < p.Skv && p.key_mask[static_cast<int64_t>(b) * p.Skv + key] != 0;
  const uint32_t word = __ballot_sync(0xffffffffu, on);
  if (lane == 0) {
    p.mask_bits[static_cast<int64_t>(b) * words_per_b + w] = word;
    if (word != 0u) atomicMax(&p.kv_len[b], w * 32 + 32 - __clz(word));  // last set bit + 1
  }
}

// kBatch (pre-pass mode bit kPrepassBatchLoads): every thread issues all its loads of a block
// (or 4 rows of the stats loop) before using any, instead of leaving that to the scheduler:
// 4-8x the bytes in flight per thread for these latency-bound, tiny-per-block passes.
// hd128 with batched loads sits right at 64 registers, where ptxas spilled one register after the
// non-finite checks were added; a floor of 3 blocks per SM (<= 85 registers) keeps it spill-free
// (3 instead of 4 blocks per SM there); the other variants stay below 64 unbounded.
template <int D, bool kBatch>
constexpr int kStatsMinBlocks = (D == 128 && kBatch) ? 3 : 0;  // 0: no floor

// kKB: keys per K block (128; 64 for long_tile forward variants), which sizes the mask words.
template <int D, DType kIn, int kM, int kKB = kBlockKV>
__global__ void __launch_bounds__(kPrepassThreads, kStatsMinBlocks<D, PrepassOpts::of(kM).batch>)
    stats_kernel(const __grid_constant__ PrepassParams p) {
  constexpr bool kBatch = PrepassOpts::of(kM).batch;
  static_assert(kPrepassThreads == sage_common::kStatsThreads, "stats blocks of common/token_stats.cuh");
  // PDL (kPrepassPdl): the quant launch may start once every stats block runs; its K and V
  // blocks wait for this launch's results (pdl_wait), its Q blocks need none of them.
  sage_common::sm90::pdl_launch_dependents();
  const int n_stat = p.B * p.Hkv * p.n_split;
  if (static_cast<int>(blockIdx.x) >= n_stat) {
    const int n_mask = p.key_mask != nullptr ? p.B * ((kKB / 32 * p.n_kv_tiles + 7) / 8) : 0;
    if (static_cast<int>(blockIdx.x) < n_stat + n_mask) {
      mask_bits_block<D, kKB>(p, blockIdx.x - n_stat);
    } else {
      quant_q_block<D, kIn, kM>(p, blockIdx.x - n_stat - n_mask);  // PrepassMode::kQInStats only
    }
    return;
  }
  // The k mean and v absmax (common/token_stats.cuh: the FP4 pre-pass runs the same reduction).
  sage_common::token_stats_block<D, typename IO<kIn>::T, kBatch, kFirstReadHint<kM>>(p, [&](int bh, int d, float mean, float amax) {
    p.kmean[bh * D + d] = mean;
    p.sv[bh * D + d] = amax / kFp8Max;
  });
}

// ---- quantization ----------------------------------------------------------------------------------
__device__ __forceinline__ uint2 pack_int8x8(const int (&q)[8]) {
  uint2 r;
  r.x = (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16) | ((q[3] & 0xff) << 24);
  r.y = (q[4] & 0xff) | ((q[5] & 0xff) << 8) | ((q[6] & 0xff) << 16) | ((q[7] & 0xff) << 24);
  return r;
}

template <int kWidth>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One 64-row Q image tile of one (b, h).
template <int D, DType kIn, int kM>
__device__ void quant_q_block(const PrepassParams& p, int blk) {
  constexpr bool kBatch = PrepassOpts::of(kM).batch;
  using RT = RowTiling<D>;
  constexpr int kPasses = kRowsPerWG / RT::kRowsPerPass;
  const int tile = blk % p.n_q_tiles, bh = blk / p.n_q_tiles;
  const int b = bh / p.Hq, h = bh % p.Hq, hk = h / (p.Hq / p.Hkv);
  const int tid = threadIdx.x, c0 = (tid % RT::kLanes) * 8;
  const char* qb = static_cast<const char*>(p.q) + 2 * (b * p.q_sb + h * p.q_sh + c0);
  int8_t* img = p.q_img + (static_cast<int64_t>(bh) * p.n_q_tiles + tile) * (kRowsPerWG * D);
  float km[8];
  if (p.qkm != nullptr) {
#pragma unroll
    for (int i = 0; i < 8; ++i) km[i] = p.kmean[(b * p.Hkv + hk) * D + c0 + i];
  }
  uint4 xs[kPasses];
  auto load_pass = [&](int pass) {
    const int i_tok = tile * kRowsPerWG + pass * RT::kRowsPerPass + tid / RT::kLanes;
    xs[pass] = i_tok < p.Sq ? load_raw8<kLastReadHint<kM>>(qb + 2 * static_cast<int64_t>(i_tok) * p.q_ss)
                            : make_uint4(0, 0, 0, 0);
  };
  if constexpr (kBatch) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) load_pass(pass);
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = pass * RT::kRowsPerPass + tid / RT::kLanes;
    const int i_tok = tile * kRowsPerWG + r;
    if constexpr (!kBatch) load_pass(pass);
    float x[8];
    raw_to_float8<kIn>(xs[pass], x);
    QRowQuant rq;  // numerics.hpp: the per-token rule
#pragma unroll
    for (int i = 0; i < 8; ++i) rq.add(x[i]);
    rq.reduce<RT::kLanes>();
    const auto sq = scale_divisor<kM>(rq.scale());
    int qi[8];
    int8_codes8(x, sq, true, qi);  // NaN -> 0, +-Inf -> +-127
    *reinterpret_cast<uint2*>(img + sw_byte_offset<D>(r, c0)) = pack_int8x8(qi);
    const int64_t srow = static_cast<int64_t>(bh) * p.n_q_tiles * kRowsPerWG + i_tok;
    // A non-finite row stores scale NaN: the epilogue's "this row is NaN" (its scores stay finite).
    if (tid % RT::kLanes == 0) p.sq[srow] = rq.stored_scale();
    if (p.qkm != nullptr) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = fmaf(x[i], km[i], dot);
      dot = group_sum<RT::kLanes>(dot);
      if (tid % RT::kLanes == 0) p.qkm[srow] = p.scale * dot;
    }
  }
}

template <int D>
__device__ __forceinline__ float block_max(float a, float* scratch) {
  a = group_max<32>(a);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x / 32] = a;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < kPrepassThreads / 32; ++w) r = fmaxf(r, scratch[w]);
  return r;
}

// One kKB-key K block of one (b, kv head): smooth, block absmax, INT8.
// kBatch: the block's inputs stay raw 16-bit between the absmax and the quantization (converted
// twice; same values) instead of 64 fp32 registers at hd128, the quant kernel's register peak.
template <int D, DType kIn, int kM, int kKB>
__device__ void quant_k_block(const PrepassParams& p, int blk, float* scratch) {
  constexpr bool kBatch = PrepassOpts::of(kM).batch;
  using RT = RowTiling<D>;
  constexpr int kPasses = kKB / RT::kRowsPerPass;
  const int tile = blk % p.n_kv_tiles, bh = blk / p.n_kv_tiles;
  const int b = bh / p.Hkv, hk = bh % p.Hkv;
  const int tid = threadIdx.x, c0 = (tid % RT::kLanes) * 8;
  const char* kb = static_cast<const char*>(p.k) + 2 * (b * p.k_sb + hk * p.k_sh + c0);
  float km[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) km[i] = p.kmean[bh * D + c0 + i];
  if constexpr (kBatch) {
    uint4 raw[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int key = tile * kKB + pass * RT::kRowsPerPass + tid / RT::kLanes;
      raw[pass] = key < p.Skv ? load_raw8<kLastReadHint<kM>>(kb + 2 * static_cast<int64_t>(key) * p.k_ss)
                              : make_uint4(0, 0, 0, 0);
    }
    float a = 0.f;
    uint32_t on = 0;  // bit pass: this thread's row of that pass is attended
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int key = tile * kKB + pass * RT::kRowsPerPass + tid / RT::kLanes;
      if (key_attended(p, b, key)) {  // padding and masked keys: code 0, excluded from max
        on |= 1u << pass;
        float x[8];
        raw_to_float8<kIn>(raw[pass], x);
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaxf(a, finite_abs(x[i] - km[i]));
      }
    }
    const float sk = block_max<D>(a, scratch) / kInt8Max;
    const auto dk = scale_divisor<kM>(sk);
    int8_t* img = p.k_img + (static_cast<int64_t>(bh) * p.n_kv_tiles + tile) * (kKB * D);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = pass * RT::kRowsPerPass + tid / RT::kLanes;
      const bool valid = (on >> pass) & 1u;
      float x[8];
      raw_to_float8<kIn>(raw[pass], x);
      int qi[8];
      if constexpr (PrepassOpts::of(kM).fast_div) {
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] -= km[i];
        int8_codes8(x, dk, valid, qi);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) qi[i] = valid ? quant_int8(x[i] - km[i], dk) : 0;
      }
      *reinterpret_cast<uint2*>(img + sw_byte_offset<D>(r, c0)) = pack_int8x8(qi);
    }
    if (tid == 0) p.sk[static_cast<int64_t>(bh) * p.n_kv_tiles + tile] = sk;
    return;
  }
  float x[kPasses][8];
  float a = 0.f;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int key = tile * kKB + pass * RT::kRowsPerPass + tid / RT::kLanes;
    if (key_attended(p, b, key)) {
      raw_to_float8<kIn>(load_raw8<kLastReadHint<kM>>(kb + 2 * static_cast<int64_t>(key) * p.k_ss), x[pass]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[pass][i] -= km[i];
        a = fmaxf(a, finite_abs(x[pass][i]));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[pass][i] = 0.f;  // padding / masked keys: code 0, excluded from max
    }
  }
  const float sk = block_max<D>(a, scratch) / kInt8Max;
  const auto dk = scale_divisor<kM>(sk);
  int8_t* img = p.k_img + (static_cast<int64_t>(bh) * p.n_kv_tiles + tile) * (kKB * D);
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = pass * RT::kRowsPerPass + tid / RT::kLanes;
    int qi[8];
    int8_codes8(x[pass], dk, true, qi);
    *reinterpret_cast<uint2*>(img + sw_byte_offset<D>(r, c0)) = pack_int8x8(qi);
  }
  if (tid == 0) p.sk[static_cast<int64_t>(bh) * p.n_kv_tiles + tile] = sk;
}

// One kKB-key V block of one (b, kv head): FP8 per channel, transposed to V^T with permuted keys.
// Bytes per staged V^T row: even (16-bit reads) and 33 words, so the byte stores of the 16 (8)
// lanes of a token row, 8 channels apart, fall into 4 banks instead of 2 (136 bytes = 34 words;
// 64-key blocks: 68 bytes = 17 words).
template <int kKB>
constexpr int kVtStride = kKB + 4;

// The V^T image of a kKB-key block: D rows of kKB bytes, swizzled as rows of that many bytes
// (128: SW128; 64: SW64, the atoms of a long tile's V^T layout, tile_config.hpp SmemAtomV).
template <int D, DType kIn, int kM, int kKB>
__device__ void quant_v_block(const PrepassParams& p, int blk, uint8_t* stage) {
  constexpr bool kBatch = PrepassOpts::of(kM).batch;
  using RT = RowTiling<D>;
  constexpr int kPasses = kKB / RT::kRowsPerPass;
  const int tile = blk % p.n_kv_tiles, bh = blk / p.n_kv_tiles;
  const int b = bh / p.Hkv, hk = bh % p.Hkv;
  const int tid = threadIdx.x, c0 = (tid % RT::kLanes) * 8;
  const char* vb = static_cast<const char*>(p.v) + 2 * (b * p.v_sb + hk * p.v_sh + c0);
  decltype(scale_divisor<kM>(0.f)) sv[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) sv[i] = scale_divisor<kM>(p.sv[bh * D + c0 + i]);
  uint4 xs[kPasses];
  auto load_pass = [&](int pass) {
    const int key = tile * kKB + pass * RT::kRowsPerPass + tid / RT::kLanes;
    // padding and masked keys: +0 bits, i.e. a zero row of codes
    xs[pass] = key_attended(p, b, key) ? load_raw8<kLastReadHint<kM>>(vb + 2 * static_cast<int64_t>(key) * p.v_ss)
                                       : make_uint4(0, 0, 0, 0);
  };
  if constexpr (kBatch) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) load_pass(pass);
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = pass * RT::kRowsPerPass + tid / RT::kLanes;
    if constexpr (!kBatch) load_pass(pass);
    float x[8];
    raw_to_float8<kIn>(xs[pass], x);
    bool odd = false;  // a non-finite element (rare): recorded for the epilogue, quantized as 0
#pragma unroll
    for (int i = 0; i < 8; ++i) odd |= !(fabsf(x[i]) < INFINITY);
    if (odd) {  // masked / padding rows were loaded as zeros: only attended keys get here
      const int key = tile * kKB + r;
      int* v_first = p.v_first + static_cast<int64_t>(bh) * static_cast<int>(NonFinite::kCount) * D;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (!(fabsf(x[i]) < INFINITY)) {
          record_nonfinite(v_first, D, c0 + i, key, x[i]);
          x[i] = 0.f;
        }
      }
      atomicMin(p.v_summary + bh, key);  // the epilogue's shortcut (FwdOptions::epilogue_summary)
    }
    if constexpr (PrepassOpts::of(kM).fast_div) {
      uint32_t two[4];
      e4m3_codes8(x, sv, two);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        stage[(c0 + 2 * j) * kVtStride<kKB> + r] = static_cast<uint8_t>(two[j] & 0xff);
        stage[(c0 + 2 * j + 1) * kVtStride<kKB> + r] = static_cast<uint8_t>(two[j] >> 8);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const uint32_t two = quant_e4m3x2(x[i], x[i + 1], sv[i], sv[i + 1]);
        stage[(c0 + i) * kVtStride<kKB> + r] = static_cast<uint8_t>(two & 0xff);
        stage[(c0 + i + 1) * kVtStride<kKB> + r] = static_cast<uint8_t>(two >> 8);
      }
    }
  }
  __syncthreads();
  uint8_t* img = p.vt_img + (static_cast<int64_t>(bh) * p.n_kv_tiles + tile) * (D * kKB);
  // 16-byte chunk c of channel d holds k positions 16c + 4t + i = keys 16c + 2t + (i&1) + 8(i>>1).
  for (int ch = tid; ch < D * (kKB / 16); ch += kPrepassThreads) {
    const int d = ch / (kKB / 16), c = ch % (kKB / 16);
    const uint8_t* row = stage + d * kVtStride<kKB> + 16 * c;
    uint32_t w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint32_t lo = *reinterpret_cast<const uint16_t*>(row + 2 * t);
      const uint32_t hi = *reinterpret_cast<const uint16_t*>(row + 8 + 2 * t);
      w[t] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(img + sw_byte_offset<kKB>(d, 16 * c)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// One 128-key V block of one (b, kv head) for a pv_16bit forward variant (kPrepassV16Image): not
// quantized, the input's 16-bit values as the kernel's smem tile, element sw128_elem16_offset<kKB,
// D>(key, channel) (tile_config.hpp: MN-major, V's own key order, 128-byte swizzle). Padding and
// masked keys are zero rows, and a non-finite element is 0, recorded in v_first / v_summary as
// quant_v_block records it (so masked keys' NaN / Inf vanish and the epilogue writes the rest over
// the rows that see them): the image is sage8's V0 (sage8_quantize) in the input's type. Each thread
// moves its 8 channels of a key as one 16-byte piece: no staging, no block barrier.
// Its row load and non-finite recording repeat quant_v_block's: a shared helper reordered the
// shipped pre-pass kernels' instructions (bench/sass_diff.py), so the two stay apart while this
// image is benchmark-only.
template <int D, DType kIn, int kM, int kKB>
__device__ void quant_v16_block(const PrepassParams& p, int blk) {
  static_assert(kKB == kBlockKV, "a 16-bit V image per 128-key block (pv_16bit: no long_tile)");
  constexpr bool kBatch = PrepassOpts::of(kM).batch;
  using RT = RowTiling<D>;
  constexpr int kPasses = kKB / RT::kRowsPerPass;
  const int tile = blk % p.n_kv_tiles, bh = blk / p.n_kv_tiles;
  const int b = bh / p.Hkv, hk = bh % p.Hkv;
  const int tid = threadIdx.x, c0 = (tid % RT::kLanes) * 8;
  const char* vb = static_cast<const char*>(p.v) + 2 * (b * p.v_sb + hk * p.v_sh + c0);
  uint16_t* img = reinterpret_cast<uint16_t*>(p.vt_img) + (static_cast<int64_t>(bh) * p.n_kv_tiles + tile) * (kKB * D);
  uint4 xs[kPasses];
  auto load_pass = [&](int pass) {
    const int key = tile * kKB + pass * RT::kRowsPerPass + tid / RT::kLanes;
    // padding and masked keys: +0 bits
    xs[pass] = key_attended(p, b, key) ? load_raw8<kLastReadHint<kM>>(vb + 2 * static_cast<int64_t>(key) * p.v_ss)
                                       : make_uint4(0, 0, 0, 0);
  };
  if constexpr (kBatch) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) load_pass(pass);
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = pass * RT::kRowsPerPass + tid / RT::kLanes;
    if constexpr (!kBatch) load_pass(pass);
    float x[8];
    raw_to_float8<kIn>(xs[pass], x);
    bool odd = false;  // a non-finite element (rare): recorded for the epilogue, stored as +0
#pragma unroll
    for (int i = 0; i < 8; ++i) odd |= !(fabsf(x[i]) < INFINITY);
    if (odd) {  // masked / padding rows were loaded as zeros: only attended keys get here
      const int key = tile * kKB + r;
      int* v_first = p.v_first + static_cast<int64_t>(bh) * static_cast<int>(NonFinite::kCount) * D;
      uint32_t w[4] = {xs[pass].x, xs[pass].y, xs[pass].z, xs[pass].w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (!(fabsf(x[i]) < INFINITY)) {
          record_nonfinite(v_first, D, c0 + i, key, x[i]);
          w[i / 2] &= (i & 1) ? 0x0000ffffu : 0xffff0000u;  // element i: the low half when i is even
        }
      }
      xs[pass] = make_uint4(w[0], w[1], w[2], w[3]);
      atomicMin(p.v_summary + bh, key);  // the epilogue's shortcut (FwdOptions::epilogue_summary)
    }
    *reinterpret_cast<uint4*>(img + sw128_elem16_offset<kKB, D>(r, c0)) = xs[pass];
  }
}

// quant_kernel's V block: the FP8 V^T image, or (kPrepassV16Image) the 16-bit one.
template <int D, DType kIn, int kM, int kKB>
__device__ __forceinline__ void quant_v_image(const PrepassParams& p, int blk, uint8_t* stage) {
  if constexpr (PrepassOpts::of(kM).v16) {
    quant_v16_block<D, kIn, kM, kKB>(p, blk);
  } else {
    quant_v_block<D, kIn, kM, kKB>(p, blk, stage);
  }
}

// kBatch also brings hd128 from 92 to ~70 registers: 3 blocks per SM instead of 2 (a cap of 64
// for 4 blocks spills). kPrepassFastDiv's eight quotients in flight take hd64 from 58 to ~72
// registers: a floor of 4 blocks per SM (<= 64 registers) keeps its occupancy.
template <int D, int kM>
constexpr int kQuantMinBlocks = (D == 64 && PrepassOpts::of(kM).fast_div) ? 4 : 0;  // 0: no floor
// kPrepassL2Reuse: the K / V blocks run in the reverse of the stats launch's (b, kv head) order and
// each K tile next to its V tile, so the first of them read what the stats launch read last (the
// likeliest still in L2); Q blocks keep their place.
template <int D, DType kIn, int kM, int kKB = kBlockKV>
__global__ void __launch_bounds__(kPrepassThreads, kQuantMinBlocks<D, kM>)
    quant_kernel(const __grid_constant__ PrepassParams p) {
  __shared__ __align__(16) uint8_t stage[D * kVtStride<kKB>];
  __shared__ float scratch[kPrepassThreads / 32];
  const int n_qb = p.q_in_stats ? 0 : q_block_count(p);
  const int n_kb = p.B * p.Hkv * p.n_kv_tiles;
  const int blk = blockIdx.x;
  // PDL (kPrepassPdl): the forward kernel may be scheduled once every block of this launch runs
  // (it waits for this launch's results itself); without the launch attribute both are no-ops.
  sage_common::sm90::pdl_launch_dependents();
  if (blk < n_qb) {
    // Q needs nothing from the stats launch but the k mean for the LSE correction, so under PDL
    // these blocks run while the stats launch drains.
    if (p.qkm != nullptr) sage_common::sm90::pdl_wait();
    quant_q_block<D, kIn, kM>(p, blk);
  } else if constexpr (PrepassOpts::of(kM).l2) {
    const int j = blk - n_qb;                   // 2 * (K/V tile pair) + (0: K, 1: V)
    const int kv_blk = n_kb - 1 - j / 2;        // (b, kv head, tile) in reverse
    sage_common::sm90::pdl_wait();              // the k mean / the V channel scales
    if (j % 2 == 0) {
      quant_k_block<D, kIn, kM, kKB>(p, kv_blk, scratch);
    } else {
      quant_v_image<D, kIn, kM, kKB>(p, kv_blk, stage);
    }
  } else if (blk < n_qb + n_kb) {
    sage_common::sm90::pdl_wait();  // the k mean
    quant_k_block<D, kIn, kM, kKB>(p, blk - n_qb, scratch);
  } else {
    sage_common::sm90::pdl_wait();  // the V channel scales (kPrepassV16Image: none needed; waits all the same)
    quant_v_image<D, kIn, kM, kKB>(p, blk - n_qb - n_kb, stage);
  }
}

// p.q_in_stats (PrepassMode::kQInStats, only without qkm: qkm needs the k mean): the Q blocks
// depend on nothing the stats compute, so they ride in the stats launch. Both launches then move
// about the same bytes (stats: read K, V + Q in/out; quant: K, V in/out), the stats launch,
// under one wave of long serial reductions otherwise, gets independent work to hide its latency,
// and the quant launch has a third fewer blocks (fewer waves and a shorter tail).
// kPrepassV16Image changes the quant launch's V blocks only: the stats launch is the same kernel.
template <int D, DType kIn, int kM, int kKB = kBlockKV>
cudaError_t launch_prepass_impl(const PrepassParams& p, bool pdl, cudaStream_t stream) {
  const int n_stat = p.B * p.Hkv * p.n_split;
  const int n_mask = p.key_mask ? p.B * ((kKB / 32 * p.n_kv_tiles + 7) / 8) : 0;
  const int n_q = p.q_in_stats ? q_block_count(p) : 0;
  stats_kernel<D, kIn, kM & ~kPrepassV16Image, kKB><<<n_stat + n_mask + n_q, kPrepassThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int n_quant = (p.q_in_stats ? 0 : q_block_count(p)) + 2 * p.B * p.Hkv * p.n_kv_tiles;
  return sage_common::launch_with_smem(quant_kernel<D, kIn, kM, kKB>, dim3(n_quant), kPrepassThreads, 0, p, stream,
                                       pdl ? sage_common::LaunchKind::kPdl : sage_common::LaunchKind::kPlain);
}

// The kernel-side mode bits a build compiles (each one instantiation of both kernels):
// the shipped build's one, kPrepassDefaultMode's (prepass.cu: the shipped binding runs nothing else) ...
using PrepassShippedKernelModes = std::integer_sequence<int, kPrepassDefaultMode & kPrepassKernelBits>;
// ... and every subset, the benchmark build's (bench/sm90_int8/prepass_modes.cu, prepass_long.cu).
template <int kB = kPrepassBatchLoads, int kL = kPrepassL2Reuse, int kF = kPrepassFastDiv>
using PrepassKernelModeSubsets = std::integer_sequence<int, 0, kB, kL, kB | kL, kF, kB | kF, kL | kF, kB | kL | kF>;
using PrepassAllKernelModes = PrepassKernelModeSubsets<>;
static_assert(kPrepassKernelBits == (kPrepassBatchLoads | kPrepassL2Reuse | kPrepassFastDiv),
              "PrepassKernelModeSubsets spans every kernel-side bit");
// ... and each of those with kPrepassV16Image (the pv_16bit variants' V image; the benchmark build's
// bench/sm90_int8/prepass_v16.cu).
template <int kBits, int... kModes>
constexpr auto with_mode_bits(std::integer_sequence<int, kModes...>) {
  return std::integer_sequence<int, (kModes | kBits)...>{};
}
using PrepassV16KernelModes = decltype(with_mode_bits<kPrepassV16Image>(PrepassAllKernelModes{}));
// ... and the shipped mode with it: the accurate policy's pre-pass (prepass.cu).
using PrepassShippedV16KernelModes = decltype(with_mode_bits<kPrepassV16Image>(PrepassShippedKernelModes{}));
static_assert((kPrepassV16Image & (kPrepassKernelBits | kPrepassModeMax)) == 0, "kPrepassV16Image is no mode bit");

// p.kernel_mode: the pre-pass mode's kernel-side bits (kPrepassKernelBits), one instantiation each
// of the modes in kModes (cudaErrorInvalidValue for any other). kKB: keys per K block (128; 64 in
// bench/sm90_int8/prepass_long.cu).
template <int D, DType kIn, int kKB, int... kModes>
cudaError_t launch_prepass_of(const PrepassParams& p, bool pdl, cudaStream_t stream, std::integer_sequence<int, kModes...>) {
  cudaError_t err = cudaErrorInvalidValue;  // a mode outside the list
  ((p.kernel_mode == kModes ? (err = launch_prepass_impl<D, kIn, kModes, kKB>(p, pdl, stream), 0) : 0), ...);
  return err;
}
template <int D, DType kIn, int kKB, class KernelModes>
cudaError_t launch_prepass(const PrepassParams& p, bool pdl, cudaStream_t stream) {
  return launch_prepass_of<D, kIn, kKB>(p, pdl, stream, KernelModes{});
}

// The runtime (head dim, dtype) switch over one set of kernel modes, for kKB-key blocks: the shipped
// pre-pass (prepass.cu) and the benchmark build's every-mode one (bench/sm90_int8/prepass_modes.cu).
template <int kKB, class KernelModes>
cudaError_t dispatch_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  if (head_dim == 64) {
    return dtype == DType::kF16 ? launch_prepass<64, DType::kF16, kKB, KernelModes>(p, pdl, stream)
                                : launch_prepass<64, DType::kBF16, kKB, KernelModes>(p, pdl, stream);
  }
  if (head_dim == 128) {
    return dtype == DType::kF16 ? launch_prepass<128, DType::kF16, kKB, KernelModes>(p, pdl, stream)
                                : launch_prepass<128, DType::kBF16, kKB, KernelModes>(p, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90

