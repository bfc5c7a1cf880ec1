// What both backward kernels share (dkdv_kernel.cuh, dq_kernel.cuh): conversions on the ALU pipes,
// exp2, the dS tile scale and codes, the INT8 A-fragment pack, the pair of 16-bit score products.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "../common/softmax_utils.cuh"
#include "../common/sm90/named_barrier.cuh"
#include "../common/sm90/wgmma.cuh"

namespace sagebwd_sm90 {

// Conversions on the ALU pipes (as the Triton kernels do, sagebwd_triton.py _i2f / _f2i8): the
// conversion instructions share the pipe with exp2 (16 per clock per SM), and a step converts D
// int32 results and 2 x 32 codes per thread. kMagic = 1.5 * 2^23: a float in [2^23, 2^24) holds an
// integer in its low mantissa bits.
constexpr float kMagic = 12582912.f;
constexpr uint32_t kMagicBits = 0x4B400000u;
// int32 x -> float, exact for |x| < 2^22 (an INT8 product of 64 terms: 127 * 127 * 64 < 2^20).
__device__ __forceinline__ float i2f(uint32_t x) { return __uint_as_float(x + kMagicBits) - kMagic; }
// The low byte of rint(y) (half to even, two's complement) for |y| <= 127.5, from y + kMagic.
__device__ __forceinline__ uint32_t code_bits(float y_plus_magic) { return __float_as_uint(y_plus_magic); }

// 2^x on the MUFU with subnormal results flushed to 0 (exp2f also scales subnormal inputs and
// results: three more instructions per score). A P~ below 2^-126 has code 0 and a dS 2^94 times
// under the largest of any tile whose P~ reaches 2^-32.
using sage_common::exp2_mufu;

// dS is computed times kDsPrescale (host: vec's 1 / l carries it; the Triton kernels' DS_PRESCALE), so
// the quantization quotients stay out of float32's subnormal range, where the reciprocal residual
// step below would differ from IEEE division.
constexpr float kDsPrescale = 4294967296.f;  // 2^32

// INT8 code bits of x / s with x / s the IEEE quotient (|x| <= 127 s), from r = 1 / s: x r corrected
// by one FMA residual step (Markstein), the correctly rounded quotient here (the Triton kernels'
// _codes_by_reciprocal), then rounded half to even by the magic add.
__device__ __forceinline__ uint32_t code_by_reciprocal(float x, float s, float r) {
  const float y = x * r;
  return code_bits(fmaf(fmaf(-y, s, x), r, y) + kMagic);
}

// The INT8 A fragment of a 64 x 64 product (k: the accumulator's columns, queries for dV and dK, keys
// for dQ) from the accumulator-layout values of this thread: register 4 kb + r, byte i holds value
// 4 (4 kb + 2 (r >> 1) + (i >> 1)) + 2 (r & 1) + (i & 1) (the 8-bit forward's P pack; the B image
// stores its k positions permuted to match, sage_sm90::vt_position_to_key). bits_of(v): a 32-bit word
// whose low byte is value v's code.
template <class F>
__device__ __forceinline__ void pack_a(F&& bits_of, uint32_t (&a)[8]) {
#pragma unroll
  for (int kb = 0; kb < 2; ++kb) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int v0 = 4 * (4 * kb + 2 * (r >> 1)) + 2 * (r & 1);
      const uint32_t lo = __byte_perm(bits_of(v0), bits_of(v0 + 1), 0x0040);      // bytes: v0, v0 + 1
      const uint32_t hi = __byte_perm(bits_of(v0 + 4), bits_of(v0 + 5), 0x0040);  // v0 + 4, v0 + 5
      a[4 * kb + r] = __byte_perm(lo, hi, 0x5410);
    }
  }
}

// The largest |dS| of a warpgroup's 64 x 64 tile from each thread's own (amax), through red[4] (one
// float per warp, shared memory this warpgroup alone uses, alternated between steps so a warp's next
// write cannot meet a slower warp's read) and a barrier of the warpgroup's 128 threads. Then the
// reference's tile scale sds = (amax / kDsPrescale) / 127 (the first quotient exact), and
// s_big = sds * kDsPrescale, the divisor of the prescaled dS.
struct DsTileScale {
  float sds, s_big;
  __device__ __forceinline__ DsTileScale(float amax, float* red, int warp, int lane, int barrier_id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[warp] = amax;
    sage_common::sm90::named_barrier_sync<128>(barrier_id);
    amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    sds = (amax * (1.f / kDsPrescale)) / 127.f;
    s_big = sds * kDsPrescale;
  }
};

// Two 16-bit products over kSteps k-steps as one committed wgmma group, each from an A descriptor
// tensor (k-step) and a B descriptor tensor (k-step, stage): the scores and dP (S^T, dP^T in the
// dK/dV kernel; S, dP in the dQ kernel), which read the same k-steps of their stage.
template <class Mma, int kSteps, class A1, class B1, class A2, class B2, int N>
__device__ __forceinline__ void issue_pair(const A1& a1, const B1& b1, float (&acc1)[N], const A2& a2, const B2& b2,
                                           float (&acc2)[N], int stage) {
  using sage_common::sm90::fence_regs;
  using sage_common::sm90::wgmma_ss;
  fence_regs(acc1);
  fence_regs(acc2);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kb = 0; kb < kSteps; ++kb)
    wgmma_ss<Mma>(uint64_t(a1(0, 0, kb)), uint64_t(b1(0, 0, kb, stage)), acc1,
                  kb == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One, std::make_index_sequence<N>{});
#pragma unroll
  for (int kb = 0; kb < kSteps; ++kb)
    wgmma_ss<Mma>(uint64_t(a2(0, 0, kb)), uint64_t(b2(0, 0, kb, stage)), acc2,
                  kb == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One, std::make_index_sequence<N>{});
  cute::warpgroup_commit_batch();
}

}  // namespace sagebwd_sm90
