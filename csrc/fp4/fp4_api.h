// Host entry points of the FP4 kernels: raw pointers, element strides and a stream, no torch.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "../common/nonfinite.h"

namespace sage_fp4 {

enum class ElemType : int { kFloat16 = 0, kBFloat16 = 1 };
enum class PQuantMode : int { kTwoLevel = 0, kDirect = 1 };  // mirrors sage_diffusers.options.PQuant
// Microscaling format of Q, K, V and P~ (mirrors sage_diffusers.options.FP4Format). Both store E2M1
// codes two per byte (element 2j in the low nibble); they differ in the block scales:
//   kNvfp4: one E4M3 byte per 16 elements, scale = E4M3(absmax / 6);
//   kMxfp4: one E8M0 byte (biased exponent e, scale 2^(e - 127)) per 32 elements,
//           e = clamp(floor(log2(absmax)) - 2 + 127, 0, 254), 0 for an all-zero block.
enum class Fp4Format : int { kNvfp4 = 0, kMxfp4 = 1 };
// How the emulated sm_90a build runs its two GEMMs on the decoded 16-bit operands (a template
// axis of the kernel; the native atom always uses kMmaSync):
//   kMmaSync: per-warp mma.sync.m16n8k16, decoded fragments staged per MMA (mainloop.cuh);
//   kWgmma:   per-warpgroup wgmma (Q K^T from shared memory, P V with P~ from registers), K / V
//             decoded once per head by a pre-pass into GMMA-swizzled 16-bit tile images that a
//             producer warpgroup bulk-copies (kv_images_sm90.cuh, mainloop_wgmma_sm90.cuh).
enum class EmuGemm : int { kMmaSync = 0, kWgmma = 1 };

__host__ __device__ constexpr int fp4_block(Fp4Format f) { return f == Fp4Format::kNvfp4 ? 16 : 32; }

// Per-(batch, head) FP32 tensor scales (numerics contract, computed by kernels/fp4.py on the GPU):
// s = amax over the finite |x| of the operand (Q and K after smoothing, masked keys excluded) /
// (448 * 6), 1 where that amax is 0. The pre-pass and the Q prologue block-quantize x / s (IEEE
// division); s_q * s_k scale the scores, s_v the output.

// Pre-pass statistics, per (b, kv head) over the attended keys: K's token mean and V's finite
// per-channel absmax, by the 8-bit pre-pass's deterministic split reduction (common/token_stats.cuh:
// the same bits for the same K in both kernels, every run). The field names are those
// token_stats_block reads.
//   k, v: (B, Hkv, Skv, D), element strides, rows 16-byte aligned; key_mask: bool (B, Skv) or
//   nullptr (masked keys add nothing, NaN / Inf there included); D 64 or 128.
//   n_split, split_len: sage_common::stats_split(B * Hkv, Skv); partial: float32 (B * Hkv,
//   n_split, 2, D), split_count: int32 (B * Hkv, n_split), counter: int32 (B * Hkv) zero on entry.
//   k_mean, v_amax: float32 (B, Hkv, D) (0 for a batch row that attends no key).
struct KvStatsParams {
  const void* k;
  const void* v;
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  const uint8_t* key_mask;
  int B, Hkv, Skv, D;
  int n_split, split_len;
  float* partial;
  int* split_count;
  int* counter;
  float* k_mean;
  float* v_amax;
};
cudaError_t launch_kv_stats(const KvStatsParams& p, ElemType dtype, cudaStream_t stream);

// Pre-pass: (K - k_mean) / k_scale quantized along D, tokens permuted within each 64-key chunk (see
// tile_config.cuh), Skv padded with zeros to `skv_pad` (a multiple of 128). With blk =
// fp4_block(fmt):
//   k: (B, H, Skv, D) with element strides; k_mean: float32 (B, H, D) contiguous (the mean over
//   attended keys); k_scale: float32 (B, H); key_mask: bool (B, Skv) or nullptr: masked keys are
//   zero rows (codes 0, whatever k holds there, NaN included).
//   kq: uint8 (B, H, skv_pad, D/2); ksf: uint8 E4M3 or E8M0 (B, H, skv_pad, D/blk).
// k must be 16-byte aligned per token (last dim contiguous, strides multiples of 8 elements).
cudaError_t launch_quantize_k(const void* k, ElemType dtype, Fp4Format fmt, int64_t sb, int64_t sh, int64_t ss,
                              const float* k_mean, const float* k_scale, const uint8_t* key_mask, uint8_t* kq,
                              uint8_t* ksf, int B, int H, int skv, int skv_pad, int D, cudaStream_t stream);

// Pre-pass: V / v_scale quantized along tokens (blocks of blk), stored transposed. Masked keys and
// non-finite elements are zeros; the latter are recorded in v_first for the epilogue.
//   v: (B, H, Skv, D) with element strides; v_scale: float32 (B, H); key_mask as above;
//   vq: uint8 (B, H, D, skv_pad/2); vsf: uint8 (B, H, D, skv_pad/blk);
//   v_first: int32 (B, H, 3, D), every byte 0x7f on entry (kNoKey), atomicMin of the keys.
using sage_common::kNoKey;  // common/nonfinite.h
using sage_common::NonFinite;
cudaError_t launch_quantize_v(const void* v, ElemType dtype, Fp4Format fmt, int64_t sb, int64_t sh, int64_t ss,
                              const float* v_scale, const uint8_t* key_mask, uint8_t* vq, uint8_t* vsf,
                              int* v_first, int B, int H, int skv, int skv_pad, int D, cudaStream_t stream);

struct FwdParams {
  const void* q;  // (B, Hq, Sq, D), strides in elements, last dim contiguous
  int64_t q_sb, q_sh, q_ss;
  const uint8_t* kq;   // pre-pass outputs, per kv head
  const uint8_t* ksf;
  const uint8_t* vq;
  const uint8_t* vsf;
  const void* k_img;   // EmuGemm::kWgmma: decoded K / V^T tile images (launch_decode_kv_images)
  const void* v_img;
  const float* k_mean;      // (B, Hkv, D): the LSE's q . k_mean (and the non-finite-row flag)
  const float* q_scale;     // (B, Hq) tensor scale of q - qbar (see above)
  const float* k_scale;     // (B, Hkv) of the smoothed K (the pre-pass divided by it)
  const float* v_scale;     // (B, Hkv) of V
  // int32 (B, Hkv, 3, D) from launch_quantize_v: per channel the first attended key whose V is
  // +Inf, -Inf, NaN (kNoKey where none), written over the output rows that see it (epilogue.cuh).
  const int* v_first;
  const uint8_t* key_mask;  // bool (B, Skv) or nullptr; true = attend
  void* o;                  // (B, Hq, Sq, D), strides in elements
  int64_t o_sb, o_sh, o_ss;
  float* lse;  // float32 (B, Hq, Sq) contiguous or nullptr
  int B, Hq, Hkv, Sq, Skv, skv_pad, D;
  float scale;
  bool causal;
  PQuantMode p_quant;
  ElemType dtype;
  Fp4Format fmt;  // of the pre-pass outputs and of the in-kernel Q / P~ quantization
};

// Forward attention. One of the two is compiled per build: native needs sm_120a/sm_121a, emulated
// runs on sm_90a (and on sm_120a, to cross-check).
cudaError_t launch_fp4_attention_native(const FwdParams& p, cudaStream_t stream);
cudaError_t launch_fp4_attention_emulated(const FwdParams& p, cudaStream_t stream);
// The emulated atom with EmuGemm::kWgmma (sm_90a only: attention_fwd_emulated_wgmma.cu); needs
// p.k_img / p.v_img from launch_decode_kv_images.
cudaError_t launch_fp4_attention_emulated_wgmma(const FwdParams& p, cudaStream_t stream);

// Pre-pass of EmuGemm::kWgmma (sm_90a only): the quantized K / V^T (launch_quantize_k / _v
// outputs, BH = B * Hkv heads) decoded exactly (E2M1 x scale, fp16 for NVFP4, bf16 for MXFP4)
// into the GMMA K-major 128-byte-swizzled shared-memory images of each 128-key tile:
//   k_img, v_img: 16-bit (BH, skv_pad / 128, 128 * D), kv_image_elems(BH, skv_pad, D) each.
cudaError_t launch_decode_kv_images(Fp4Format fmt, const uint8_t* kq, const uint8_t* ksf, const uint8_t* vq,
                                    const uint8_t* vsf, void* k_img, void* v_img, int BH, int skv_pad, int D,
                                    cudaStream_t stream);
inline int64_t kv_image_elems(int64_t BH, int64_t skv_pad, int64_t D) { return BH * skv_pad * D; }

// Test GEMM of one MMA atom: d (M, N) float32 = deq(A) (M, K) . deq(B) (N, K)^T with
// a: uint8 (M, K/2), sfa: uint8 E4M3 or E8M0 (M, K/blk), b: uint8 (N, K/2), sfb (N, K/blk);
// M % 16 == 0, N % 8 == 0, K % 64 == 0. One warp per 16 x 8 output tile, fragments loaded exactly
// as the PTX ISA lays them out for mma.m16n8k64.
cudaError_t launch_mma_atom_gemm_native(Fp4Format fmt, const uint8_t* a, const uint8_t* sfa, const uint8_t* b,
                                       const uint8_t* sfb, float* d, int M, int N, int K,
                                       cudaStream_t stream);
cudaError_t launch_mma_atom_gemm_emulated(Fp4Format fmt, const uint8_t* a, const uint8_t* sfa, const uint8_t* b,
                                      const uint8_t* sfb, float* d, int M, int N, int K,
                                      cudaStream_t stream);

}  // namespace sage_fp4
