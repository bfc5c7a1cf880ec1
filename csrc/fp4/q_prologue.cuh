// Prologue of the FP4 forward: load the CTA's 128 query rows, compute their mean qbar (the
// Q smoothing block is exactly the CTA tile) over the rows whose elements are all finite (so a
// NaN / Inf row stays in its row), quantize (q - qbar) / q_scale into register A fragments, and
// q . k_mean per row (the LSE's shift; kBadRowBits, a NaN, for a row with a non-finite element,
// which the epilogue reads as "this row is NaN").
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/nonfinite.cuh"
#include "../common/numeric_conversion.cuh"
#include "fp4_api.h"
#include "fragment_quant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

// qk_mean of a query row holding a NaN / Inf: a NaN with the sign bit set, a pattern no arithmetic
// produces on the GPU (its NaNs are the canonical 0x7fffffff), so a NaN q . k_mean (k_mean not
// finite) stays distinguishable. Still a NaN: the row's LSE is NaN through it.
constexpr uint32_t kBadRowBits = 0xffffffffu;
__device__ __forceinline__ bool is_bad_row(float qk_mean) { return __float_as_uint(qk_mean) == kBadRowBits; }

struct CtaSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// Threads 0 .. kThreads - 1 (warp w quantizes rows 16w .. 16w + 15); `sync` is a barrier over
// exactly those threads. Shared memory: qs [kBlockM][kHeadDim] of T (the Q tile), qbar
// [kHeadDim], qk_mean [kBlockM] (q . k_mean, or kBadRowBits for a row with a non-finite element).
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

  {
    // q . k_mean, the score shift K smoothing removed (added back to the LSE in the epilogue),
    // plus the sum of x * 0 over the row: +0 when every element is finite, NaN otherwise.
    static_assert(kThreads == 2 * kBlockM, "two threads per row");
    const int row = tid >> 1, half = tid & 1;
    const float* km = p.k_mean + (int64_t(b) * p.Hkv + hk) * kHeadDim + half * (kHeadDim / 2);
    const T* qrow = qs + row * kHeadDim + half * (kHeadDim / 2);
    float dot = 0.0f, bad = 0.0f;
    for (int d = 0; d < kHeadDim / 2; ++d) {
      const float x = sage_common::Elem16<T>::to_float(qrow[d]);
      dot = fmaf(x, km[d], dot);
      bad += x * 0.0f;
    }
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    bad += __shfl_xor_sync(0xffffffffu, bad, 1);
    // padding rows (zeros) are finite; a NaN dot alone (k_mean not finite) is not a bad row
    if (half == 0) qk_mean[row] = isnan(bad) ? __uint_as_float(kBadRowBits) : dot;
  }
  sync();

  // qbar over the block's real rows whose elements are all finite (the tail block averages only
  // its real tokens, as the spec); 0 when there is none.
  for (int d = tid; d < kHeadDim; d += kThreads) {
    float sum = 0.0f;
    int n = 0;
    for (int r = 0; r < rows; ++r) {
      const bool ok = !is_bad_row(qk_mean[r]);
      sum += ok ? sage_common::Elem16<T>::to_float(qs[r * kHeadDim + d]) : 0.0f;
      n += ok;
    }
    qbar[d] = n > 0 ? __fdiv_rn(sum, static_cast<float>(n)) : 0.0f;
  }
  sync();

  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const float q_scale = p.q_scale[int64_t(b) * p.Hq + h];
#pragma unroll
  for (int c = 0; c < kHeadDim / 64; ++c) {
    float vals[2][16];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const T* qrow = qs + (16 * warp + g + 8 * r) * kHeadDim + 64 * c;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int d = (i < 8 ? 8 * t + i : 32 + 8 * t + (i - 8));
        // Non-finite values are quantized as 0 (the row's output is NaN anyway, qk_mean).
        const float x = __fdiv_rn(sage_common::Elem16<T>::to_float(qrow[d]) - qbar[64 * c + d], q_scale);
        vals[r][i] = sage_common::finite_or_zero(x);
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
