// Numerics both experiment kernels share (dkdv_kernel.cuh, dq_kernel.cuh): conversions on the ALU
// pipes, exp2, the dS codes, the INT8 A-fragment pack.
#pragma once

#include <cstdint>

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
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

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

}  // namespace sagebwd_sm90
