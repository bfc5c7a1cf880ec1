// Warp-level FP4 MMA atoms: the native sm_120a block-scaled instruction and an sm_90a emulation
// that consumes the very same register fragments. Both are templates over the microscaling format
// (Fp4Format, fp4_api.h): NVFP4 (E4M3 scale per 16) or MXFP4 (E8M0 scale per 32).
//
// Fragment layout of mma.m16n8k64 .e2m1 (PTX ISA; CuTe SM120_16x8x64_TN_VS traits agree), with
// g = lane / 4 and t = lane % 4, and nibble j of a 32-bit register = element j (low nibble first):
//   A (16 x 64, row-major): a0 = row g,   k 8t..8t+7      a1 = row g+8, k 8t..8t+7
//                            a2 = row g,   k 32+8t..+7     a3 = row g+8, k 32+8t..+7
//   B (64 x 8, "col"):       b0 = col g,   k 8t..8t+7      b1 = col g,   k 32+8t..+7
//   C/D (16 x 8, f32):       d0,d1 = row g, cols 2t,2t+1   d2,d3 = row g+8, cols 2t,2t+1
// Block scales. NVFP4, scale_vec::4X with ue4m3: one 32-bit register holds the 4 E4M3 scales of a
// row (A) or column (B), byte j for k = 16j..16j+15. MXFP4, scale_vec::2X with ue8m0: the low 16
// bits hold the 2 E8M0 scales, byte j for k = 32j..32j+31 (CuTe: SFBits = 16 for VS = 32, driven
// with byte-id 0). With byte-id 0 and thread-id 0 the hardware reads row g from lane 4g, row g+8
// from lane 4g+1 (CuTe SFALayout, the same for both vector sizes: lane bit 0 picks the row half,
// lane bit 1 is ignored) and column g from lane 4g (SFBLayout ignores lane % 4).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4_api.h"
#include "fp4_format.cuh"

namespace sage_fp4 {

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }

// ---------------------------------------------------------------------------------------------
// Native: one mma.sync kind::mxf4nvf4 per 16x8x64 step (scale_vec::4X ue4m3 for NVFP4,
// scale_vec::2X ue8m0 for MXFP4). The MXFP4 form compiles for sm_120a but has not run on hardware.
template <Fp4Format F>
struct AtomSm120 {
  static constexpr Fp4Format kFormat = F;
  static constexpr bool kNative = true;
  // Fragments stay FP4: B is read straight from the tile in shared memory, Q stays in registers.
  static constexpr bool kStagesDecoded = false;
  struct FragA {
    uint32_t r[4];
    uint32_t sf;  // this lane's row scales: row g on even lanes, row g+8 on odd lanes
  };
  struct FragB {
    uint32_t r[2];
    uint32_t sf;
  };

  // sf_lo / sf_hi: scale words of rows g and g+8 (every lane of the quad passes both).
  __device__ __forceinline__ static FragA make_a(const uint32_t r[4], uint32_t sf_lo, uint32_t sf_hi) {
    FragA f;
#pragma unroll
    for (int i = 0; i < 4; ++i) f.r[i] = r[i];
    f.sf = (lane_id() & 1) ? sf_hi : sf_lo;
    return f;
  }
  __device__ __forceinline__ static FragB make_b(uint32_t b0, uint32_t b1, uint32_t sf) {
    FragB f;
    f.r[0] = b0;
    f.r[1] = b1;
    f.sf = sf;
    return f;
  }

  // d += A . B with the block scales applied.
  __device__ __forceinline__ static void mma(float d[4], const FragA& a, const FragB& b) {
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)
    const uint16_t zero = 0;
    if constexpr (F == Fp4Format::kNvfp4) {
      asm volatile(
          "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, {%10}, {%11, %12}, {%13}, {%14, %15};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]),
            "r"(a.sf), "h"(zero), "h"(zero), "r"(b.sf), "h"(zero), "h"(zero));
    } else {
      asm volatile(
          "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::2X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue8m0 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, {%10}, {%11, %12}, {%13}, {%14, %15};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]),
            "r"(a.sf), "h"(zero), "h"(zero), "r"(b.sf), "h"(zero), "h"(zero));
    }
#else
    __trap();  // instantiated only for sm_120a / sm_121a builds
#endif
  }

  // The raw instruction contract: sfa/sfb laid out across lanes as the hardware reads them.
  __device__ __forceinline__ static void mma_raw(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                 uint32_t sfa, uint32_t sfb) {
    FragA fa;
#pragma unroll
    for (int i = 0; i < 4; ++i) fa.r[i] = a[i];
    fa.sf = sfa;
    mma(d, fa, make_b(b[0], b[1], sfb));
  }
};

// ---------------------------------------------------------------------------------------------
// Emulated: decode to 16-bit floats and run four mma.sync.m16n8k16 with fp32 accumulation.
//  NVFP4: E2M1 x E4M3 decoded to fp16 (exact: at most 6 significant bits, magnitudes within
//    [2^-10, 2688], so no subnormal ever reaches the tensor core); fp16 rather than bf16 because
//    the E2M1 table then has zero low bytes and decodes with one PRMT per pair.
//  MXFP4: E2M1 x E8M0 spans 2^-128 .. 1.5 * 2^127, beyond fp16, so it decodes to bf16 (fp32's
//    exponent range, 8 significant bits: E2M1 x 2^k is exact) and runs m16n8k16.bf16. Exact for
//    every decoded value in bf16's normal range. Not exact, by design, only at the bottom of the
//    range: a block whose scale is 2^-127 (byte 0, absmax < 2^-124) decodes to zeros, and code 0.5
//    under scale 2^-126 (2^-127, a bf16 subnormal) is exact only if HMUL2.BF16 keeps subnormals.
//    Such values are below 2^-126; next to any normal-range term of the same fp32 dot product
//    they are below its rounding error. (The native atom reads byte 0 as 2^-127.)
//
// The FP4 layout gives lane (g, t) 16 k-values (8t..8t+7 and 32+8t..+7) for A rows g, g+8 and B
// column g. The k16 mma gives lane t the k-slots {2t, 2t+1, 2t+8, 2t+9}. Any bijection between
// k-values and slots that depends only on t is a valid reordering of the dot product, because A
// row and B column slots of the same k come from lanes with the same t. Step j = 2h + q uses
// half h (registers 0/1 or 2/3 of A, register h of B) and nibbles 4q..4q+3: slots 2t, 2t+1 take
// nibbles 4q, 4q+1 and slots 2t+8, 2t+9 take nibbles 4q+2, 4q+3.
template <Fp4Format F>
struct AtomSm90Emulated {
  static constexpr Fp4Format kFormat = F;
  static constexpr bool kNative = false;
  static constexpr bool kBf16 = F == Fp4Format::kMxfp4;  // decoded element type (else fp16)
  // The smoothing correction runs as an MMA of decoded K against qbar split into kQbarTerms rows
  // of the decoded element type (hi, remainder, ...): 2 fp16 terms (22 bits) or 3 bf16 terms (24).
  static constexpr int kQbarTerms = kBf16 ? 3 : 2;
  // Every warp needs every K/V fragment of a tile, so the kernel decodes each fragment once per
  // CTA into shared memory (kFragWords words per lane) instead of once per warp in registers; the
  // decoded Q fragments (4x the FP4 size) wait in shared memory too, which keeps the main loop
  // within 255 registers.
  static constexpr bool kStagesDecoded = true;
  static constexpr int kFragWords = 8;
  static constexpr int kFragAWords = 16;
  struct FragA {
    uint32_t h[4][4];  // [step][a0..a3] fp16x2 or bf16x2
  };
  struct FragB {
    uint32_t h[4][2];  // [step][b0, b1] fp16x2 or bf16x2
  };

  // Lane t's values of register half h (k = 32h + 8t .. +7) times their block scale, decoded:
  // NVFP4 block 2h + t/2 of the scale word, MXFP4 block h.
  __device__ __forceinline__ static void decode(uint32_t x, uint32_t sf_word, int h, uint32_t out[4]) {
    if constexpr (kBf16) {
      decode8_bf16(x, e8m0_bf16_pair(sf_word >> (8 * h)), out);
    } else {
      const int byte = 2 * h + ((lane_id() & 3) >> 1);
      decode8_half(x, __half2half2(e4m3_to_half(sf_word >> (8 * byte))), out);
    }
  }

  // Rounds x to the decoded element type (the qbar split terms).
  __device__ __forceinline__ static float round_elem(float x) {
    if constexpr (kBf16) {
      return __bfloat162float(__float2bfloat16_rn(x));
    } else {
      return __half2float(__float2half_rn(x));
    }
  }
  __device__ __forceinline__ static uint32_t pack_pair(float lo, float hi) {
    if constexpr (kBf16) {
      __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&h);
    } else {
      __half2 h = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&h);
    }
  }

  __device__ __forceinline__ static FragA make_a(const uint32_t r[4], uint32_t sf_lo, uint32_t sf_hi) {
    FragA f;
#pragma unroll
    for (int reg = 0; reg < 4; ++reg) {
      const int h = reg >> 1;       // k half
      const int row_hi = reg & 1;   // row g or g+8
      uint32_t dec[4];
      decode(r[reg], row_hi ? sf_hi : sf_lo, h, dec);
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        f.h[2 * h + q][row_hi + 0] = dec[2 * q];      // a0 / a1: slots 2t, 2t+1
        f.h[2 * h + q][row_hi + 2] = dec[2 * q + 1];  // a2 / a3: slots 2t+8, 2t+9
      }
    }
    return f;
  }

  __device__ __forceinline__ static FragB make_b(uint32_t b0, uint32_t b1, uint32_t sf) {
    FragB f;
    const uint32_t r[2] = {b0, b1};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t dec[4];
      decode(r[h], sf, h, dec);
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        f.h[2 * h + q][0] = dec[2 * q];
        f.h[2 * h + q][1] = dec[2 * q + 1];
      }
    }
    return f;
  }

  // Staged fragments in shared memory: a fragment of the whole warp is kFragWords / 4 (B) or
  // kFragAWords / 4 (A) parts of 32 lanes x 16 bytes, lane-contiguous within a part, so each
  // quarter-warp's 16-byte accesses cover 128 contiguous bytes (no bank conflicts).
  __device__ __forceinline__ static void store_b(uint32_t* frag, const FragB& f) {
    uint4* p = reinterpret_cast<uint4*>(frag) + lane_id();
    p[0] = make_uint4(f.h[0][0], f.h[0][1], f.h[1][0], f.h[1][1]);
    p[32] = make_uint4(f.h[2][0], f.h[2][1], f.h[3][0], f.h[3][1]);
  }
  __device__ __forceinline__ static FragB load_b(const uint32_t* frag) {
    const uint4* p = reinterpret_cast<const uint4*>(frag) + lane_id();
    const uint4 lo = p[0], hi = p[32];
    FragB f;
    f.h[0][0] = lo.x; f.h[0][1] = lo.y; f.h[1][0] = lo.z; f.h[1][1] = lo.w;
    f.h[2][0] = hi.x; f.h[2][1] = hi.y; f.h[3][0] = hi.z; f.h[3][1] = hi.w;
    return f;
  }
  __device__ __forceinline__ static void store_a(uint32_t* frag, const FragA& f) {
    uint4* p = reinterpret_cast<uint4*>(frag) + lane_id();
#pragma unroll
    for (int j = 0; j < 4; ++j) p[32 * j] = make_uint4(f.h[j][0], f.h[j][1], f.h[j][2], f.h[j][3]);
  }
  __device__ __forceinline__ static FragA load_a(const uint32_t* frag) {
    const uint4* p = reinterpret_cast<const uint4*>(frag) + lane_id();
    FragA f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 w = p[32 * j];
      f.h[j][0] = w.x; f.h[j][1] = w.y; f.h[j][2] = w.z; f.h[j][3] = w.w;
    }
    return f;
  }

  __device__ __forceinline__ static void mma(float d[4], const FragA& a, const FragB& b) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kBf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a.h[j][0]), "r"(a.h[j][1]), "r"(a.h[j][2]), "r"(a.h[j][3]), "r"(b.h[j][0]),
              "r"(b.h[j][1]));
      } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a.h[j][0]), "r"(a.h[j][1]), "r"(a.h[j][2]), "r"(a.h[j][3]), "r"(b.h[j][0]),
              "r"(b.h[j][1]));
      }
    }
  }

  // The native instruction's contract, scale registers included: row g's scales come from lane
  // 4g, row g+8's from lane 4g+1, column g's from lane 4g.
  __device__ __forceinline__ static void mma_raw(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                 uint32_t sfa, uint32_t sfb) {
    const int quad0 = lane_id() & ~3;
    const uint32_t sf_lo = __shfl_sync(0xffffffffu, sfa, quad0);
    const uint32_t sf_hi = __shfl_sync(0xffffffffu, sfa, quad0 + 1);
    const uint32_t sf_b = __shfl_sync(0xffffffffu, sfb, quad0);
    mma(d, make_a(a, sf_lo, sf_hi), make_b(b[0], b[1], sf_b));
  }
};

}  // namespace sage_fp4
