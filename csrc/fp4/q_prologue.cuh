// Prologue of the FP4 forward: load the CTA's 128 query rows, compute their mean qbar (the
// Q smoothing block is exactly the CTA tile), quantize q - qbar into register A fragments, and
// (for the LSE) q . k_mean per row.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4_api.h"
#include "fragment_quant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

template <typename T>
__device__ __forceinline__ float elem_to_float(T x);
template <>
__device__ __forceinline__ float elem_to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float elem_to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

struct CtaSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// Threads 0 .. kThreads - 1 (warp w quantizes rows 16w .. 16w + 15); `sync` is a barrier over
// exactly those threads. Shared memory: qs [kBlockM][kHeadDim] of T (the Q tile), qbar
// [kHeadDim], qk_mean [kBlockM] (written when p.lse is set).
template <class Atom, int kHeadDim, typename T, class Sync>
__device__ __forceinline__ void q_prologue(const FwdParams& p, T* qs, float* qbar, float* qk_mean, int b, int h,
                                           int hk, int q0, typename Atom::FragA (&qf)[kHeadDim / 64], Sync sync) {
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = min(kBlockM, p.Sq - q0);
  const T* qg = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;

  constexpr int kVecPerRow = kHeadDim / 8;  // 16-byte vectors
  for (int i = tid; i < kBlockM * kVecPerRow; i += kThreads) {
    const int row = i / kVecPerRow, c = i % kVecPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < rows) v = *reinterpret_cast<const uint4*>(qg + int64_t(q0 + row) * p.q_ss + c * 8);
    *reinterpret_cast<uint4*>(qs + row * kHeadDim + c * 8) = v;
  }
  sync();

  // qbar over the block's real rows (the tail block averages only its real tokens, as the spec).
  for (int d = tid; d < kHeadDim; d += kThreads) {
    float sum = 0.0f;
    for (int r = 0; r < rows; ++r) sum += elem_to_float(qs[r * kHeadDim + d]);
    qbar[d] = __fdiv_rn(sum, static_cast<float>(rows));
  }
  if (p.lse != nullptr) {
    // q . k_mean, the score shift K smoothing removed; added back to the LSE in the epilogue.
    static_assert(kThreads == 2 * kBlockM, "two threads per row");
    const int row = tid >> 1, half = tid & 1;
    const float* km = p.k_mean + (int64_t(b) * p.Hkv + hk) * kHeadDim + half * (kHeadDim / 2);
    const T* qrow = qs + row * kHeadDim + half * (kHeadDim / 2);
    float dot = 0.0f;
    for (int d = 0; d < kHeadDim / 2; ++d) dot = fmaf(elem_to_float(qrow[d]), km[d], dot);
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    if (half == 0) qk_mean[row] = dot;
  }
  sync();

  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int c = 0; c < kHeadDim / 64; ++c) {
    float vals[2][16];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const T* qrow = qs + (16 * warp + g + 8 * r) * kHeadDim + 64 * c;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int d = (i < 8 ? 8 * t + i : 32 + 8 * t + (i - 8));
        vals[r][i] = elem_to_float(qrow[d]) - qbar[64 * c + d];
      }
    }
    uint32_t codes[4], sf_lo, sf_hi;
    quantize_a_chunk<Atom::kFormat, Division::kExact, false>(vals, codes, sf_lo, sf_hi);
    qf[c] = Atom::make_a(codes, sf_lo, sf_hi);
  }
}

template <class Atom, int kHeadDim, typename T>
__device__ __forceinline__ void q_prologue(const FwdParams& p, uint8_t* smem, int b, int h, int hk, int q0,
                                           typename Atom::FragA (&qf)[kHeadDim / 64]) {
  using Cfg = FwdConfig<kHeadDim, Atom::kFormat>;
  q_prologue<Atom, kHeadDim, T>(p, reinterpret_cast<T*>(smem + Cfg::kOffQ),
                                reinterpret_cast<float*>(smem + Cfg::kOffQbar),
                                reinterpret_cast<float*>(smem + Cfg::kOffQkMean), b, h, hk, q0, qf, CtaSync{});
}

}  // namespace sage_fp4
