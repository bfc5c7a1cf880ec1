// The backward kernels' host interface: tile constants, the kernels' parameters and the shipped
// launches by head dim and dtype. Free of torch and CuTe, so the binding compiles without them.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace sagebwd_sm90 {

constexpr int kBlockM = 64;        // queries per step (Q / dO / dS quantization block)
constexpr int kKeysPerWG = 64;     // keys per consumer warpgroup (wgmma M)
constexpr int kConsumerWGs = 2;
constexpr int kBlockN = kKeysPerWG * kConsumerWGs;  // keys per dK/dV CTA (queries per dQ CTA)
constexpr int kThreads = 128 * (1 + kConsumerWGs);
constexpr int kVecFloats = 256;    // per query block: m[64], kDsPrescale / l [64], delta[64], dv factor, s_Q, pad
constexpr int kVecM = 0, kVecInvL = 64, kVecDelta = 128, kVecDvFactor = 192, kVecSQ = 193;
constexpr int kVecBytes = kVecFloats * 4;
// Per key block of the dQ kernel, 16 bytes (one bulk copy): K's scale (float), the block's index (int32)
// and its visibility word (uint64, all ones without a mask; Visibility), so that a consumer reads what
// its step needs from shared memory.
constexpr int kKScaleFloats = 4;
constexpr int kKScaleValue = 0, kKScaleBlock = 1, kKScaleWord = 2;
// dV in place sums |P^| |dO'^| <= 127 * 127 per query in int32: exact up to 2^31 / 127^2 = 133,152 queries.
constexpr int kDvInPlaceMaxQueries = 131072;

// Which scores are visible, shared by both kernels. Key visibility comes per batch as one 64-bit word
// per 64-key block (bit k: key 64 j + k visible); causality is top-left aligned, as torch SDPA's
// is_causal (query i sees keys j <= i). A masked score's dS is 0 (and in the dK/dV kernel its P~, whose
// exp2 argument is capped at -inf), so masked K / V values never reach a result.
struct Visibility {
  // dK/dV kernel: (B, Skv / 64) words, or nullptr: every key visible. (The dQ kernel reads a block's
  // word from its K scale entry, kKScaleWord.)
  const uint64_t* key_bits;
  // dQ kernel: per batch the key blocks with a visible key in ascending order, then Skv / 64 as
  // padding (B, Skv / 64), or nullptr: every block. Fully masked blocks are never loaded.
  const int32_t* key_blocks;
  int causal;
};

// The dK/dV kernel's arguments. GQA: KV head hk serves query heads hk * group ... hk * group + group - 1,
// whose query blocks one CTA visits in turn.
struct Params {
  // images, per (b, KV head) in order: K, V [Skv / 128][2 warpgroup tiles]; per (b, query head): Q, dO
  // [Sq / 64] 16-bit tiles; Q^T, dO'^T [Sq / 64] INT8 tiles; vec [Sq / 64][kVecFloats]
  const uint8_t *k, *v, *q, *dO, *qt, *dot;
  const float* vec;
  float *dk, *dv;  // (B, KV heads, Skv, D) float32
  // DvAcc::kInPlace (no GQA): (B, H, D), P~'s 1/127 times dO''s channel scale
  const float* dv_channel_scale;
  int heads, sq, skv;  // heads: KV heads
  float qk_scale;  // softmax scale * log2(e)
  float sm_scale;
  Visibility vis;  // key_blocks unused: a CTA whose 128 keys are all masked writes zeros and ends
  int group;       // query heads per KV head
};

// The dQ kernel's arguments.
struct DqParams {
  // images, per (b, query head): Q, dO [Sq / 64] 16-bit tiles; per (b, KV head): K, V [Skv / 64] 16-bit
  // tiles; K^T [Skv / 64] INT8 tiles (DqAcc::kBf16InPlace, the lab's: the smoothed K's 16-bit tiles
  // instead, as K's); scale [Skv / 64][kKScaleFloats] (K's block scale, the block's index and word)
  const uint8_t *q, *dO, *k, *v, *kt;
  const float* k_scale;
  const float *m, *inv_l, *delta;  // (B, H, Sq): row max, kDsPrescale / l, delta
  float* dq;                       // (B, H, Sq, D) float32
  int heads, sq, skv;              // heads: query heads
  float qk_scale, sm_scale;
  Visibility vis;
  int group;  // query heads per KV head (query head h reads KV head h / group)
};

// The shipped kernels (launch.cuh ShippedPolicy) for head dim 64 or 128, bf16 or fp16 operands;
// dv_in_place (bf16, Sq <= kDvInPlaceMaxQueries, p.dv_channel_scale set): DvAcc::kInPlace.
// cudaErrorInvalidValue for another head dim or an in-place call the build does not cover.
cudaError_t run_dkdv(const Params& p, int batch, int head_dim, bool bf16, bool dv_in_place, cudaStream_t stream);
cudaError_t run_dq(const DqParams& p, int batch, int head_dim, bool bf16, cudaStream_t stream);

}  // namespace sagebwd_sm90
