// The pre-passes' statistics of K and V over the attended keys of each (batch, kv head): K's token
// mean (the smoothing mean of both kernels, numerics contract) and V's per-channel absmax over the
// finite values. One deterministic reduction, used by the 8-bit pre-pass (sm90_int8/prepass.cuh,
// fused there with its other stats-launch blocks) and the FP4 pre-pass (fp4/quant_prepass.cu):
//   1. the keys of one (b, kv head) are cut into n_split chunks of split_len tokens, one thread
//      block each (stats_split picks them); inside a block each thread sums the 8 channels it
//      owns over every kRowsPerPass-th token, in token order; a masked key adds +0 (selected,
//      never multiplied: a NaN or Inf there vanishes), and so does a NaN / Inf element of an
//      attended key;
//   2. the block's kRowsPerPass partial rows are added in row order (shared memory);
//   3. the last block of the (b, kv head) to finish (an atomic ticket, no float atomics) adds the
//      chunks' partials in chunk order and divides by the number of attended keys (an exact
//      integer count; 0 keys give a mean of 0; without a mask it is Skv, the plain token mean).
// The order of every addition is fixed by the shapes alone, so every run and every CUDA-graph
// replay gives the same bits, and both kernels give the same mean for the same K. It differs from
// torch's sum order (reference.attended_mean) in the last bits unless the sums are exact.
#pragma once

#include <cstdint>

#include "l2_hint.cuh"
#include "nonfinite.cuh"
#include "numeric_conversion.cuh"
#include "token_stats.h"

namespace sage_common {

// Whether key `key` of batch row b takes part (inside the sequence and attended). P: any
// parameter struct with Skv and key_mask (bool (B, Skv) or nullptr).
template <class P>
__device__ __forceinline__ bool key_attended(const P& p, int b, int key) {
  return key < p.Skv && (p.key_mask == nullptr || p.key_mask[static_cast<int64_t>(b) * p.Skv + key] != 0);
}

// One token row into the k sum and the finite v absmax. A masked row adds +0 and 0 (selected,
// not multiplied: NaN / Inf there vanish); an attended key's NaN / Inf element adds 0 too, so it
// cannot make its channel's mean, and with it every key's smoothed value there, NaN.
__device__ __forceinline__ void add_stats_row(float (&sum)[8], float (&amax)[8], const float (&kx)[8],
                                              const float (&vx)[8], bool on) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    sum[i] += on ? finite_or_zero(kx[i]) : 0.f;
    amax[i] = fmaxf(amax[i], on ? finite_abs(vx[i]) : 0.f);
  }
}

template <int D>
struct StatsTiling {
  static_assert(D == 64 || D == 128, "the pre-passes' head dims");
  static constexpr int kLanes = D / 8;                       // threads per token row (8 channels each)
  static constexpr int kRowsPerPass = kStatsThreads / kLanes;
};

// Block blockIdx.x (the stats blocks are the grid's first B * Hkv * p.n_split blocks, of
// kStatsThreads threads) of the reduction above; the last
// block of each (b, kv head) calls store(bh, d, mean, amax) for its D channels d (bh = b * Hkv + kv head). T: the
// element type of k and v (__half or __nv_bfloat16). kBatch: each thread issues the loads of 4
// rows before adding any (more bytes in flight; the sums keep the same order, so the same bits).
// kHint: the L2 policy of the K and V loads (l2_hint.cuh; evict_last when a later launch reads
// them again; values unchanged).
// P: a parameter struct with
//   k, v (const void*) and their element strides k_sb, k_sh, k_ss, v_sb, v_sh, v_ss (rows 16-byte
//   aligned, last dim contiguous); key_mask, Skv (key_attended); Hkv; n_split, split_len
//   (stats_split); the workspace partial (float, B * Hkv * n_split * 2 * D), split_count (int,
//   B * Hkv * n_split) and counter (int, B * Hkv, zero before the launch).
template <int D, typename T, bool kBatch, L2Hint kHint = L2Hint::kNormal, class P, class Store>
__device__ __forceinline__ void token_stats_block(const P& p, Store store) {
  using RT = StatsTiling<D>;
  const int bh = blockIdx.x / p.n_split, split = blockIdx.x % p.n_split;
  const int b = bh / p.Hkv, hk = bh % p.Hkv;
  const int tid = threadIdx.x;
  const int c0 = (tid % RT::kLanes) * 8, r0 = tid / RT::kLanes;
  const int s_begin = split * p.split_len;
  const int s_end = min(p.Skv, s_begin + p.split_len);
  const char* kb = static_cast<const char*>(p.k) + 2 * (b * p.k_sb + hk * p.k_sh + c0);
  const char* vb = static_cast<const char*>(p.v) + 2 * (b * p.v_sb + hk * p.v_sh + c0);

  float sum[8], amax[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) sum[i] = amax[i] = 0.f;
  auto load = [&](const char* ptr, float (&x)[8]) { unpack8_float<T>(ldg16<kHint>(ptr), x); };
  auto accumulate = [&](int s) {
    float kx[8], vx[8];
    load(kb + 2 * static_cast<int64_t>(s) * p.k_ss, kx);
    load(vb + 2 * static_cast<int64_t>(s) * p.v_ss, vx);
    add_stats_row(sum, amax, kx, vx, key_attended(p, b, s));
  };
  int s = s_begin + r0;
  if constexpr (kBatch) {
    // Four rows per trip, loads first; the sums keep the sequential order (same bits as below).
    for (; s + 3 * RT::kRowsPerPass < s_end; s += 4 * RT::kRowsPerPass) {
      float kx[4][8], vx[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        load(kb + 2 * static_cast<int64_t>(s + u * RT::kRowsPerPass) * p.k_ss, kx[u]);
        load(vb + 2 * static_cast<int64_t>(s + u * RT::kRowsPerPass) * p.v_ss, vx[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) add_stats_row(sum, amax, kx[u], vx[u], key_attended(p, b, s + u * RT::kRowsPerPass));
    }
  }
  for (; s < s_end; s += RT::kRowsPerPass) accumulate(s);
  __shared__ float red[2][RT::kRowsPerPass][D];  // 16 KB at both head dims
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    red[0][r0][c0 + i] = sum[i];
    red[1][r0][c0 + i] = amax[i];
  }
  // Attended keys of the chunk (the k mean's divisor), an exact integer count; the barriers of
  // __syncthreads_count also publish red[].
  int split_attended = s_end - s_begin;
  if (p.key_mask != nullptr) {
    split_attended = 0;
    for (int t0 = s_begin; t0 < s_end; t0 += kStatsThreads) {
      split_attended += __syncthreads_count(t0 + tid < s_end && key_attended(p, b, t0 + tid));
    }
  }
  __syncthreads();
  float* part = p.partial + static_cast<int64_t>(bh) * p.n_split * 2 * D;
  for (int d = tid; d < D; d += kStatsThreads) {
    float s = 0.f, a = 0.f;
    for (int r = 0; r < RT::kRowsPerPass; ++r) {  // fixed order: deterministic
      s += red[0][r][d];
      a = fmaxf(a, red[1][r][d]);
    }
    part[(split * 2 + 0) * D + d] = s;
    part[(split * 2 + 1) * D + d] = a;
  }
  if (tid == 0) p.split_count[static_cast<int64_t>(bh) * p.n_split + split] = split_attended;
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  if (tid == 0) is_last = atomicAdd(&p.counter[bh], 1) == p.n_split - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  int attended = 0;  // integer sum: exact, any order
  for (int j = 0; j < p.n_split; ++j) attended += __ldcg(&p.split_count[static_cast<int64_t>(bh) * p.n_split + j]);
  for (int d = tid; d < D; d += kStatsThreads) {
    float s = 0.f, a = 0.f;
    for (int j = 0; j < p.n_split; ++j) {  // fixed order over chunks
      s += __ldcg(&part[(j * 2 + 0) * D + d]);
      a = fmaxf(a, __ldcg(&part[(j * 2 + 1) * D + d]));
    }
    // Without a mask attended == Skv: the same bits as the plain token mean.
    store(bh, d, attended > 0 ? s / static_cast<float>(attended) : 0.f, a);
  }
}

}  // namespace sage_common
