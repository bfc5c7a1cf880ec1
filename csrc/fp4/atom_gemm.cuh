// A tiny GEMM that drives one MMA atom through its raw-register contract (fragments and scale
// registers loaded exactly as the PTX ISA lays them out), for unit tests against torch.
#pragma once

#include <cstdint>

#include "fp4_api.h"

namespace sage_fp4 {

template <class Atom>
__global__ void mma_atom_gemm_kernel(const uint8_t* a, const uint8_t* sfa, const uint8_t* b, const uint8_t* sfb,
                                     float* d, int M, int N, int K) {
  const int lane = static_cast<int>(threadIdx.x & 31), g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * 16, n0 = blockIdx.y * 8;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  constexpr int kBlock = fp4_block(Atom::kFormat);
  const int row_bytes = K / 2, sf_bytes = K / kBlock;
  for (int k0 = 0; k0 < K; k0 += 64) {
    const uint8_t* a_lo = a + int64_t(m0 + g) * row_bytes + k0 / 2;
    const uint8_t* a_hi = a + int64_t(m0 + g + 8) * row_bytes + k0 / 2;
    const uint8_t* b_col = b + int64_t(n0 + g) * row_bytes + k0 / 2;
    const uint32_t ra[4] = {
        *reinterpret_cast<const uint32_t*>(a_lo + 4 * t), *reinterpret_cast<const uint32_t*>(a_hi + 4 * t),
        *reinterpret_cast<const uint32_t*>(a_lo + 16 + 4 * t), *reinterpret_cast<const uint32_t*>(a_hi + 16 + 4 * t)};
    const uint32_t rb[2] = {*reinterpret_cast<const uint32_t*>(b_col + 4 * t),
                            *reinterpret_cast<const uint32_t*>(b_col + 16 + 4 * t)};
    // Scale registers as the hardware reads them (byte/thread id 0): lane 4g -> row g,
    // lane 4g+1 -> row g+8 (lanes 4g+2, 4g+3 mirror them); column g on every lane of quad g.
    // NVFP4: 4 E4M3 bytes (k 16j..); MXFP4: 2 E8M0 bytes (k 32j..) in the low half, high half 0.
    const int sf_row = m0 + g + 8 * (lane & 1);
    const uint8_t* pa = sfa + int64_t(sf_row) * sf_bytes + k0 / kBlock;
    const uint8_t* pb = sfb + int64_t(n0 + g) * sf_bytes + k0 / kBlock;
    uint32_t rsa, rsb;
    if constexpr (kBlock == 16) {
      rsa = *reinterpret_cast<const uint32_t*>(pa);
      rsb = *reinterpret_cast<const uint32_t*>(pb);
    } else {
      rsa = *reinterpret_cast<const uint16_t*>(pa);
      rsb = *reinterpret_cast<const uint16_t*>(pb);
    }
    Atom::mma_raw(acc, ra, rb, rsa, rsb);
  }
  d[int64_t(m0 + g) * N + n0 + 2 * t] = acc[0];
  d[int64_t(m0 + g) * N + n0 + 2 * t + 1] = acc[1];
  d[int64_t(m0 + g + 8) * N + n0 + 2 * t] = acc[2];
  d[int64_t(m0 + g + 8) * N + n0 + 2 * t + 1] = acc[3];
}

template <template <Fp4Format> class Atom>
cudaError_t launch_atom_gemm(Fp4Format fmt, const uint8_t* a, const uint8_t* sfa, const uint8_t* b,
                             const uint8_t* sfb, float* d, int M, int N, int K, cudaStream_t stream) {
  if (M % 16 || N % 8 || K % 64) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  const dim3 grid(M / 16, N / 8);
  if (fmt == Fp4Format::kNvfp4) {
    mma_atom_gemm_kernel<Atom<Fp4Format::kNvfp4>><<<grid, 32, 0, stream>>>(a, sfa, b, sfb, d, M, N, K);
  } else {
    mma_atom_gemm_kernel<Atom<Fp4Format::kMxfp4>><<<grid, 32, 0, stream>>>(a, sfa, b, sfb, d, M, N, K);
  }
  return cudaGetLastError();
}

}  // namespace sage_fp4
