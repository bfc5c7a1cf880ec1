// Main-loop building blocks of the FP4 forward: K/V tile loads (cp.async, two stages), the
// Q.K^T and P.V MMA sweeps over shared memory, and the in-kernel smoothing correction qbar.K^T.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/smem.cuh"
#include "fp4_api.h"
#include "fp4_format.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

using sage_common::smem_addr;

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
template <int kBytes>  // 4 or 8
__device__ __forceinline__ void cp_async_small(void* dst, const void* src) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca sizes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(kBytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Global pointers of one kv head's pre-pass outputs.
struct KvHead {
  const uint8_t* kq;   // (skv_pad, D/2), permuted tokens
  const uint8_t* ksf;  // (skv_pad, D/blk)
  const uint8_t* vq;   // (D, skv_pad/2)
  const uint8_t* vsf;  // (D, skv_pad/blk)
  int skv_pad;
};

template <int kHeadDim, Fp4Format F>
struct StageView {
  using Cfg = FwdConfig<kHeadDim, F>;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* k() const { return base; }
  __device__ __forceinline__ uint8_t* ksf() const { return base + Cfg::kKBytes; }
  __device__ __forceinline__ uint8_t* v() const { return base + Cfg::kKBytes + Cfg::kKSfBytes; }
  __device__ __forceinline__ uint8_t* vsf() const {
    return base + Cfg::kKBytes + Cfg::kKSfBytes + Cfg::kVBytes;
  }
};

// All threads: issue the cp.async copies of key tile `tile` into `st` (caller commits).
template <int kHeadDim, Fp4Format F>
__device__ __forceinline__ void load_kv_tile(const StageView<kHeadDim, F>& st, const KvHead& kv, int tile) {
  using Cfg = FwdConfig<kHeadDim, F>;
  const int tid = static_cast<int>(threadIdx.x);
  constexpr int kKChunksPerRow = Cfg::kKRowBytes / 16;
  const uint8_t* kg = kv.kq + int64_t(tile) * Cfg::kKBytes;
  for (int c = tid; c < Cfg::kKBytes / 16; c += kThreads) {
    const int row = c / kKChunksPerRow, q = c % kKChunksPerRow;
    cp_async16(st.k() + swizzled_offset<Cfg::kKRowBytes>(row, q), kg + c * 16);
  }
  const uint8_t* ksg = kv.ksf + int64_t(tile) * Cfg::kKSfBytes;
  for (int c = tid; c < Cfg::kKSfBytes / 16; c += kThreads) cp_async16(st.ksf() + c * 16, ksg + c * 16);
  const int64_t v_row = kv.skv_pad / 2;
  for (int c = tid; c < Cfg::kVBytes / 16; c += kThreads) {
    const int d = c / 4, q = c % 4;
    cp_async16(st.v() + swizzled_offset<Cfg::kVRowBytes>(d, q),
               kv.vq + d * v_row + int64_t(tile) * Cfg::kVRowBytes + q * 16);
  }
  const int64_t vsf_row = kv.skv_pad / Cfg::kSfBlock;
  for (int d = tid; d < kHeadDim; d += kThreads)
    cp_async_small<Cfg::kVSfRowBytes>(st.vsf() + d * Cfg::kVSfRowBytes,
                                      kv.vsf + d * vsf_row + int64_t(tile) * Cfg::kVSfRowBytes);
}

// Raw FP4 B fragment of this lane: K column (stored key) `row` for Q.K^T, or V^T channel `row`
// for P.V, k64 step `c`. The scale word holds the step's kSfPerChunk bytes (4 E4M3 or 2 E8M0).
template <int kRowBytes, int kSfRowBytes, int kSfPerChunk>
__device__ __forceinline__ void load_raw_b(const uint8_t* tile, const uint8_t* sf, int row, int c, uint32_t& b0,
                                           uint32_t& b1, uint32_t& sfw) {
  const int t = static_cast<int>(threadIdx.x & 3);
  b0 = *reinterpret_cast<const uint32_t*>(tile + swizzled_offset<kRowBytes>(row, 2 * c) + 4 * t);
  b1 = *reinterpret_cast<const uint32_t*>(tile + swizzled_offset<kRowBytes>(row, 2 * c + 1) + 4 * t);
  if constexpr (kSfPerChunk == 4) {
    sfw = *reinterpret_cast<const uint32_t*>(sf + row * kSfRowBytes + 4 * c);
  } else {
    static_assert(kSfPerChunk == 2, "NVFP4 or MXFP4");
    sfw = *reinterpret_cast<const uint16_t*>(sf + row * kSfRowBytes + 2 * c);
  }
}

// Fragment f of the decoded staging area (the whole warp's; the atom picks the lane's slots);
// K fragments are f = c * 16 + j, V fragments follow at kKFrags + n * 2 + c.
template <class Atom>
__device__ __forceinline__ uint32_t* staged_frag(uint32_t* staged, int f) {
  return staged + f * 32 * Atom::kFragWords;
}

// Where the warp's decoded Q fragment of k64 step c waits (atoms with kStagesDecoded): the
// warp's own 16 rows of the prologue's Q tile, which nobody reads after the prologue.
template <class Atom, int kHeadDim>
__device__ __forceinline__ uint32_t* staged_q_frag(uint8_t* q_tile, int c) {
  const int warp = static_cast<int>(threadIdx.x >> 5);
  static_assert(32 * Atom::kFragAWords * 4 * (kHeadDim / 64) == 16 * kHeadDim * 2, "fits the warp's rows");
  return reinterpret_cast<uint32_t*>(q_tile + warp * 16 * kHeadDim * 2) + c * 32 * Atom::kFragAWords;
}

// One warp: s[j] = Q(16 rows) . K(columns 8j..8j+7 of the tile)^T for the 16 n-tiles. Q fragments
// come from registers (qf) or, with kStagesDecoded, from `q_tile` (qf is then unused).
template <class Atom, int kHeadDim>
__device__ __forceinline__ void qk_tile(float (&s)[kBlockN / 8][4],
                                        const typename Atom::FragA (&qf)[kHeadDim / 64], uint8_t* q_tile,
                                        const StageView<kHeadDim, Atom::kFormat>& st, uint32_t* staged) {
  using Cfg = FwdConfig<kHeadDim, Atom::kFormat>;
  const int g = static_cast<int>((threadIdx.x & 31) >> 2);
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
  }
#pragma unroll
  for (int c = 0; c < Cfg::kDChunks; ++c) {
    typename Atom::FragA a;
    if constexpr (Atom::kStagesDecoded) {
      a = Atom::load_a(staged_q_frag<Atom, kHeadDim>(q_tile, c));
    } else {
      a = qf[c];
    }
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      if constexpr (Atom::kStagesDecoded) {
        Atom::mma(s[j], a, Atom::load_b(staged_frag<Atom>(staged, c * (kBlockN / 8) + j)));
      } else {
        uint32_t b0, b1, sf;
        load_raw_b<Cfg::kKRowBytes, Cfg::kKSfRowBytes, Cfg::kSfPerChunk>(st.k(), st.ksf(), 8 * j + g, c, b0, b1, sf);
        Atom::mma(s[j], a, Atom::make_b(b0, b1, sf));
      }
    }
  }
}

// One warp: acc[n] = acc[n] * alpha + s1 * (P(16 rows) . V(tile, channels 8n..8n+7)).
// The per-row factors are applied per n-tile so the MMA result needs only 4 live registers.
template <class Atom, int kHeadDim>
__device__ __forceinline__ void pv_tile(float (&acc)[kHeadDim / 8][4],
                                        const typename Atom::FragA (&pf)[kBlockN / kKeyChunk],
                                        const float (&alpha)[2], const float (&s1)[2],
                                        const StageView<kHeadDim, Atom::kFormat>& st, uint32_t* staged) {
  using Cfg = FwdConfig<kHeadDim, Atom::kFormat>;
  const int g = static_cast<int>((threadIdx.x & 31) >> 2);
#pragma unroll
  for (int n = 0; n < kHeadDim / 8; ++n) {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < kBlockN / kKeyChunk; ++c) {
      if constexpr (Atom::kStagesDecoded) {
        Atom::mma(d, pf[c], Atom::load_b(staged_frag<Atom>(staged, Cfg::kKFrags + n * 2 + c)));
      } else {
        uint32_t b0, b1, sf;
        load_raw_b<Cfg::kVRowBytes, Cfg::kVSfRowBytes, Cfg::kSfPerChunk>(st.v(), st.vsf(), 8 * n + g, c, b0, b1,
                                                                         sf);  // channel row
        Atom::mma(d, pf[c], Atom::make_b(b0, b1, sf));
      }
    }
    acc[n][0] = fmaf(acc[n][0], alpha[0], s1[0] * d[0]);
    acc[n][1] = fmaf(acc[n][1], alpha[0], s1[0] * d[1]);
    acc[n][2] = fmaf(acc[n][2], alpha[1], s1[1] * d[2]);
    acc[n][3] = fmaf(acc[n][3], alpha[1], s1[1] * d[3]);
  }
}

// Threads 0..kBlockN-1: bitmask of the tile's columns whose real key exists and is not masked.
// `tid`: the thread's index within the threads that run this (default threadIdx.x).
__device__ __forceinline__ void key_valid_bits(uint32_t* valid_bits, int tile, int skv, const uint8_t* mask_row,
                                               int tid = static_cast<int>(threadIdx.x)) {
  if (tid < kBlockN) {
    const int key = tile * kBlockN + tile_key(tid);
    const bool ok = key < skv && (mask_row == nullptr || mask_row[key] != 0);
    const uint32_t bits = __ballot_sync(0xffffffffu, ok);
    if ((tid & 31) == 0) valid_bits[tid / 32] = bits;
  }
}

// All threads (atoms without decoded staging): the smoothing correction qbar . deq(K_pos) of
// every column on the CUDA cores, two lanes per column (halves of D). D/2 decodes and FMAs per
// thread per tile, instead of the (B, H, Sq/128, Skv) tensor the public kernel materialises.
template <int kHeadDim, Fp4Format F>
__device__ __forceinline__ void correction_cuda_cores(const StageView<kHeadDim, F>& st, const float* qbar, float* corr) {
  using Cfg = FwdConfig<kHeadDim, F>;
  const int tid = static_cast<int>(threadIdx.x);
  const int pos = tid >> 1, half = tid & 1;
  static_assert(kThreads == 2 * kBlockN, "two threads per column");
  constexpr int kChunksPerHalf = kHeadDim / 64;  // 16-byte chunks = 32 dims each
  float sum = 0.0f;
#pragma unroll
  for (int cc = 0; cc < kChunksPerHalf; ++cc) {
    const int q = half * kChunksPerHalf + cc;
    const uint4 w = *reinterpret_cast<const uint4*>(st.k() + swizzled_offset<Cfg::kKRowBytes>(pos, q));
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    if constexpr (F == Fp4Format::kNvfp4) {
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        const uint32_t sbyte = st.ksf()[pos * Cfg::kKSfRowBytes + 2 * q + wi / 2];
        uint32_t dec[4];
        decode8_half(words[wi], __half2half2(e4m3_to_half(sbyte)), dec);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&dec[i]));
          const int d = 32 * q + 8 * wi + 2 * i;
          sum = fmaf(qbar[d], f.x, sum);
          sum = fmaf(qbar[d + 1], f.y, sum);
        }
      }
    } else {
      // The chunk's 32 dims are one E8M0 block: decode the codes unscaled (bf16, exact), sum the
      // block's qbar . code in fp32, then apply 2^(e - 127) in fp32 (exact, subnormals included).
      const float scale = scale_byte_to_float<F>(st.ksf()[pos * Cfg::kKSfRowBytes + q]);
      float part = 0.0f;
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        uint32_t dec[4];
        decode8_bf16(words[wi], e8m0_bf16_pair(127u), dec);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dec[i]));
          const int d = 32 * q + 8 * wi + 2 * i;
          part = fmaf(qbar[d], f.x, part);
          part = fmaf(qbar[d + 1], f.y, part);
        }
      }
      sum = fmaf(part, scale, sum);
    }
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  if (half == 0) corr[pos] = sum;
}

// Warp 0 (atoms with decoded staging), once: A fragments whose rows 0 .. kQbarTerms-1 split qbar
// into terms of the decoded element type (row 0 = round(qbar), row i = round of the remainder;
// the other rows zero), so an MMA against a decoded K fragment gives the smoothing correction to
// ~2^-22 (two fp16 terms) or ~2^-24 (three bf16 terms) relative in kQbarTerms accumulator rows.
template <class Atom, int kHeadDim>
__device__ __forceinline__ void build_qbar_frags(const float* qbar, uint32_t* frags) {
  const int lane = static_cast<int>(threadIdx.x & 31), g = lane >> 2, t = lane & 3;
  auto part = [&](int d) -> float {
    if constexpr (Atom::kQbarTerms == 2) {
      const float hi = Atom::round_elem(qbar[d]);
      return g == 0 ? hi : (g == 1 ? qbar[d] - hi : 0.0f);
    } else {
      float rest = qbar[d], term = 0.0f;
#pragma unroll
      for (int i = 0; i < Atom::kQbarTerms; ++i) {
        const float r = Atom::round_elem(rest);
        if (g == i) term = r;
        rest -= r;
      }
      return term;  // lanes of rows >= kQbarTerms keep 0
    }
  };
  auto pair = [&](int d) -> uint32_t { return Atom::pack_pair(part(d), part(d + 1)); };
#pragma unroll
  for (int c = 0; c < kHeadDim / 64; ++c) {
    typename Atom::FragA f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int d = 64 * c + 32 * h + 8 * t + 4 * q;  // the emulated slot order, see mma_atoms.cuh
        f.h[2 * h + q][0] = pair(d);      // row g, slots 2t, 2t+1
        f.h[2 * h + q][1] = 0u;           // row g+8
        f.h[2 * h + q][2] = pair(d + 2);  // row g, slots 2t+8, 2t+9
        f.h[2 * h + q][3] = 0u;
      }
    }
    Atom::store_a(frags + c * 32 * Atom::kFragAWords, f);
  }
}

// All threads (atoms with kStagesDecoded): decode every B fragment of the tile once into `staged`
// and compute the smoothing correction on the tensor cores. Warp w decodes fragments w + 8 i,
// each lane its own slots, so the lane that decodes a slot is the lane that will read it (the
// scales follow the lane's k range). Those are the K fragments of n-tiles w and w + 8 for every
// k64 step: exactly what the warp needs for those columns' qbar . deq(K).
template <class Atom, int kHeadDim>
__device__ __forceinline__ void stage_decoded_b(const StageView<kHeadDim, Atom::kFormat>& st, uint32_t* staged,
                                                const uint32_t* qbar_frags, float* corr) {
  using Cfg = FwdConfig<kHeadDim, Atom::kFormat>;
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int g = lane >> 2, t = lane & 3;
  static_assert(kThreads / 32 == kBlockN / 16, "warp w owns K n-tiles w and w + 8");
  float dc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int i = 0; i < Cfg::kKFrags / 8; ++i) {  // fragment f = warp + 8 i = (c = i / 2, j = warp + 8 (i % 2))
    const int c = i / 2, j = warp + 8 * (i % 2);
    uint32_t b0, b1, sf;
    load_raw_b<Cfg::kKRowBytes, Cfg::kKSfRowBytes, Cfg::kSfPerChunk>(st.k(), st.ksf(), 8 * j + g, c, b0, b1, sf);
    const typename Atom::FragB fb = Atom::make_b(b0, b1, sf);
    Atom::store_b(staged_frag<Atom>(staged, c * (kBlockN / 8) + j), fb);
    Atom::mma(dc[i % 2], Atom::load_a(qbar_frags + c * 32 * Atom::kFragAWords), fb);
  }
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    // Term i (row i) sits on lanes 4i..4i+3, columns 2t, 2t + 1; summed smallest first.
    float c0 = __shfl_down_sync(0xffffffffu, dc[jj][0], 4 * (Atom::kQbarTerms - 1));
    float c1 = __shfl_down_sync(0xffffffffu, dc[jj][1], 4 * (Atom::kQbarTerms - 1));
#pragma unroll
    for (int i = Atom::kQbarTerms - 2; i >= 1; --i) {
      c0 += __shfl_down_sync(0xffffffffu, dc[jj][0], 4 * i);
      c1 += __shfl_down_sync(0xffffffffu, dc[jj][1], 4 * i);
    }
    if (lane < 4) {
      const int col = 8 * (warp + 8 * jj) + 2 * t;
      corr[col] = dc[jj][0] + c0;
      corr[col + 1] = dc[jj][1] + c1;
    }
  }
  for (int f = Cfg::kKFrags + warp; f < Cfg::kKFrags + Cfg::kVFrags; f += kThreads / 32) {
    const int n = (f - Cfg::kKFrags) / 2, c = (f - Cfg::kKFrags) % 2;
    uint32_t b0, b1, sf;
    load_raw_b<Cfg::kVRowBytes, Cfg::kVSfRowBytes, Cfg::kSfPerChunk>(st.v(), st.vsf(), 8 * n + g, c, b0, b1, sf);
    Atom::store_b(staged_frag<Atom>(staged, f), Atom::make_b(b0, b1, sf));
  }
}

}  // namespace sage_fp4
