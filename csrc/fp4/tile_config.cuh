// Tile sizes, the key permutation and the shared-memory layout of the FP4 forward kernel; shared
// by the quantization pre-pass (which writes K in the permuted order) and the kernel.
#pragma once

#include <cstdint>

#include "fp4_api.h"
#include "kernel_options.h"  // KernelOptions and the default SAGE_FP4_OPT (generate_options.py)

namespace sage_fp4 {

// The option set of this build (one per build: -DSAGE_FP4_OPT, default SAGE_FP4_DEFAULT_OPT).
static_assert(SAGE_FP4_OPT >= 0 && SAGE_FP4_OPT < (1 << KernelOptions::kCount),
              "SAGE_FP4_OPT holds KernelOptions bits only");
constexpr KernelOptions kOptions = KernelOptions::from_bits(SAGE_FP4_OPT);
constexpr bool kOptHoistMask = kOptions.hoist_mask;
constexpr bool kOptTreeReduce = kOptions.tree_reduce;
constexpr bool kOptPipelinedStaging = kOptions.pipelined_staging;

constexpr int kBlockN = 128;     // keys per online-softmax tile (the spec's BLOCK_KV)
constexpr int kBlockM = 128;     // query rows per CTA = one Q smoothing block, so qbar is per CTA
constexpr int kWarps = kBlockM / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kKeyChunk = 64;    // keys per k64 step of the P.V MMA

// The QK^T accumulator gives lane t the score columns 8j + 2t + e (j = 0..7 within a 64-key chunk,
// e = 0, 1). As the A operand of P.V the same lane must hold keys 8t..8t+7 and 32+8t..+7. K is
// therefore stored permuted within each 64-key chunk: column `pos` holds real key `chunk_key(pos)`;
// V and P keep the real key order, so V's 16-token scale blocks are the spec's blocks.
__host__ __device__ __forceinline__ constexpr int chunk_key(int pos) {
  // pos = 8j + 2t + e  ->  key = 8t + 2j + e (j < 4) or 32 + 8t + 2(j - 4) + e (j >= 4)
  return (pos >> 5) * 32 + ((pos >> 1) & 3) * 8 + ((pos >> 3) & 3) * 2 + (pos & 1);
}
// Real key index of column `pos` of a kBlockN tile.
__host__ __device__ __forceinline__ constexpr int tile_key(int pos) {
  return (pos / kKeyChunk) * kKeyChunk + chunk_key(pos % kKeyChunk);
}

template <int kHeadDim, Fp4Format kFmt = Fp4Format::kNvfp4>
struct FwdConfig {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 are instantiated");
  static constexpr int kSfBlock = fp4_block(kFmt);     // elements per scale byte: 16 or 32
  static constexpr int kSfPerChunk = 64 / kSfBlock;    // scale bytes per k64 step: 4 or 2
  static constexpr int kDChunks = kHeadDim / 64;       // k64 steps of Q.K^T
  static constexpr int kKRowBytes = kHeadDim / 2;      // packed K token
  static constexpr int kKSfRowBytes = kHeadDim / kSfBlock;  // its scales
  static constexpr int kVRowBytes = kBlockN / 2;       // packed V^T channel within one tile
  static constexpr int kVSfRowBytes = kBlockN / kSfBlock;
  // One pipeline stage: K tile, its scales, V^T tile, its scales (18 KiB at D = 128 with NVFP4,
  // 17 KiB with MXFP4).
  static constexpr int kKBytes = kBlockN * kKRowBytes;
  static constexpr int kKSfBytes = kBlockN * kKSfRowBytes;
  static constexpr int kVBytes = kHeadDim * kVRowBytes;
  static constexpr int kVSfBytes = kHeadDim * kVSfRowBytes;
  static constexpr int kStageBytes = kKBytes + kKSfBytes + kVBytes + kVSfBytes;
  static constexpr int kStages = 2;
  // Besides the stages: the Q tile in 16-bit (prologue), qbar, the smoothing correction of each
  // column per stage, the key-valid bits per stage, q.k_mean per row (LSE).
  static constexpr int kQTileBytes = kBlockM * kHeadDim * 2;
  static constexpr int kOffQ = kStages * kStageBytes;
  static constexpr int kOffQbar = kOffQ + kQTileBytes;
  static constexpr int kOffCorr = kOffQbar + kHeadDim * 4;
  static constexpr int kOffValid = kOffCorr + kStages * kBlockN * 4;
  static constexpr int kOffQkMean = kOffValid + kStages * (kBlockN / 32) * 4;
  static constexpr int kSmemBytes = kOffQkMean + kBlockM * 4;
  static_assert(kSmemBytes % 16 == 0, "the decoded staging area that follows takes 16-byte accesses");
  // 70 KiB at D = 128 (NVFP4; MXFP4 less): under sm_120's ~99 KiB per block (the native atom
  // needs nothing more).
  static_assert(kSmemBytes <= 99 * 1024, "shared memory budget of sm_120");
  // Atoms that stage decoded fragments (the emulated one) add the qbar A fragments (hi/lo rows,
  // one per k64 step) and one decoded K tile and one V tile: a fragment per (n-tile, k64 step),
  // 32 lanes x kFragWords words each; 68 KiB at D = 128 with 16-bit fragments (fp16 for NVFP4,
  // bf16 for MXFP4: the same size), 138 KiB in all, within sm_90's 227 KiB.
  static constexpr int kKFrags = (kBlockN / 8) * kDChunks;
  static constexpr int kVFrags = (kHeadDim / 8) * (kBlockN / kKeyChunk);
  template <class Atom>
  static constexpr int qbar_frag_offset() { return kSmemBytes; }
  template <class Atom>
  static constexpr int staged_offset() {
    if constexpr (Atom::kStagesDecoded) {
      return kSmemBytes + kDChunks * 32 * Atom::kFragAWords * 4;
    } else {
      return kSmemBytes;  // nothing staged
    }
  }
  // Words of one decoded staging buffer (K and V fragments of one tile).
  template <class Atom>
  static constexpr int staged_words() { return (kKFrags + kVFrags) * 32 * Atom::kFragWords; }
  // Two buffers with kOptPipelinedStaging: 220 KiB at D = 128, under sm_90's 227 KiB.
  static constexpr int kStagedBuffers = kOptPipelinedStaging ? 2 : 1;
  template <class Atom>
  static constexpr int smem_bytes() {
    if constexpr (Atom::kStagesDecoded) {
      return staged_offset<Atom>() + kStagedBuffers * staged_words<Atom>() * 4;
    } else {
      return kSmemBytes;
    }
  }
  static_assert(kStageBytes % 16 == 0 && kKBytes % 16 == 0 && kKSfBytes % 16 == 0 && kVBytes % 16 == 0,
                "cp.async 16-byte destinations");
  static_assert(kVSfRowBytes == 4 || kVSfRowBytes == 8, "one cp.async (4 or 8 bytes) per V^T scale row");
  // The emulated atom's 227 KiB budget is checked in attention_fwd_emulated.cu (it needs the atom).
};

// 16-byte-chunk XOR swizzle of a packed row of `kRowBytes` (32 or 64). Lanes (g, t) read word t
// of chunk q of rows 8j + g; without the swizzle rows g and g + 128/kRowBytes share banks.
template <int kRowBytes>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  constexpr int kChunks = kRowBytes / 16;
  constexpr int kRowsPerLine = 128 / kRowBytes;
  return row * kRowBytes + ((chunk ^ ((row / kRowsPerLine) % kChunks)) * 16);
}

}  // namespace sage_fp4
