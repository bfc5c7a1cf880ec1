// Online-softmax building blocks shared by the kernels: exp2 on MUFU or on the FMA pipes, the
// reductions over the 4 lanes of an mma/wgmma accumulator row (lanes 4g .. 4g + 3 hold one row),
// independent reduction chains, and the natural-log LSE of a log2-domain running state.
#pragma once

#include <cstdint>

namespace sage_common {

// exp2 on the MUFU unit (16 results/clk/SM on sm_90 and sm_120); ex2.approx(-inf) = +0.
__device__ __forceinline__ float exp2_mufu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp2 on the FMA pipes for x <= 0 (as FlashAttention-4 does to relieve MUFU where the exp unit
// bounds the loop): Cody-Waite split x = j + f with j = floor(x), f in [0, 1); 2^f from a degree-3
// polynomial (relative error < 1e-4, far below the 2^-4 step of the E4M3 code P~ is rounded to
// next); 2^j added to the exponent field. floor comes from adding 1.5*2^23 with rounding toward
// -inf, which keeps everything off the conversion units. Results below 2^-126 flush to 0 like ftz.
__device__ __forceinline__ float exp2_poly(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  constexpr float kC1 = 0.69507056f, kC2 = 0.22765099f, kC3 = 0.07714326f;
  const float xc = fmaxf(x, -127.f);  // also maps -inf to a finite value
  const float tm = __fadd_rd(xc, kMagic);
  const float j = tm - kMagic;         // floor(xc), exact
  const float f = xc - j;              // exact, in [0, 1)
  const float p = fmaf(fmaf(fmaf(kC3, f, kC2), f, kC1), f, 1.f);
  const int e = __float_as_int(tm) - __float_as_int(kMagic);  // floor(xc) as int
  const float r = __int_as_float(__float_as_int(p) + static_cast<int>(static_cast<unsigned>(e) << 23));
  return xc < -126.f ? 0.f : r;
}

// Max / sum over the quad of lanes that share an accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A row reduction kept as N independent partial chains (1 or 4), combined pairwise: four short
// chains hide the FMNMX / FADD latency that one 32-deep chain exposes when few warps share a
// scheduler. The pairwise order is part of the numerics (sums round in this order).
template <int N>
__device__ __forceinline__ float chains_max(const float (&x)[N]) {
  static_assert(N == 1 || N == 4, "one chain or four");
  if constexpr (N == 4) {
    return fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  } else {
    return x[0];
  }
}
template <int N>
__device__ __forceinline__ float chains_sum(const float (&x)[N]) {
  static_assert(N == 1 || N == 4, "one chain or four");
  if constexpr (N == 4) {
    return (x[0] + x[1]) + (x[2] + x[3]);
  } else {
    return x[0];
  }
}

// Natural-log LSE of a row from its running max m (log2 domain) and row sum l > 0; the callers add
// their corrections (smoothing term, folded scales) after it, in this order.
constexpr float kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float lse_from_log2(float m_log2, float l) { return m_log2 * kLn2 + logf(l); }

}  // namespace sage_common
