// Tile shapes, shared-memory layouts and the byte "images" the pre-pass writes.
//
// One place decides every size both the pre-pass and the attention kernel depend on. The
// pre-pass writes each quantized tile into global memory already laid out exactly as the
// swizzled shared-memory tile that wgmma reads, so the attention kernel moves a whole tile with
// one 1-D bulk copy (cp.async.bulk) and no per-thread address math. The image functions below
// (sw_byte_offset) and the CuTe layouts used for the wgmma descriptors must agree;
// host_layout_check.cu verifies that on the host for every coordinate.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
// N = 72 and 136 (tc_row_sum's PV atoms) are CUTLASS's extended GMMA shapes, included directly
// rather than through CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (which would pull them into every unit).
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>

#include "../common/sm90/gmma_swizzle.cuh"

namespace sage_sm90 {

// ---- constants fixed by the numerics spec (sage8) -------------------------------------------
constexpr int kBlockKV = 128;          // keys per online-softmax tile == K quantization block (the default)
// FwdOptions::long_tile (hd128 benchmarks): 192-key tiles made of three 64-key K quantization
// blocks. The pre-pass then writes 64-key images (K: 64 rows; V^T: D x 64 in the 64-byte swizzle),
// which lie back to back in memory, so one tile's three images are one contiguous copy that lands
// as the tile's smem layout (host_layout_check.cu proves it).
constexpr int kLongTileKeys = 192;
// Keys per K quantization block (one K scale) of a kKeys-key tile.
template <int kKeys>
constexpr int kKBlockKeys = kKeys == kBlockKV ? kBlockKV : 64;
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;       // E4M3 max; P~ is scaled by this before quantization

// ---- CTA shape ----------------------------------------------------------------------------
constexpr int kRowsPerWG = 64;         // wgmma M: one consumer warpgroup owns 64 query rows

// What the number of consumer warpgroups sizes: two by default; three with
// FwdOptions::three_consumers (192 query rows per CTA, a third more softmax work in flight per SM,
// FA3's hd64 shape; the hd64 default, a benchmark variant at hd128). kWGs comes from the options
// (FwdOptions::consumer_warpgroups()).
template <int kWGs>
struct CtaShape {
  static_assert(kWGs == 2 || kWGs == 3, "two or three consumer warpgroups");
  static constexpr int kConsumerWGs = kWGs;
  static constexpr int kBlockM = kRowsPerWG * kWGs;          // 128 or 192 query rows per CTA
  static constexpr int kConsumerThreads = 128 * kWGs;        // 256 or 384
  static constexpr int kProducerWarp = kConsumerThreads / 32;  // the warp after the consumers issues the bulk copies
  static constexpr int kThreads = kConsumerThreads + 32;      // with a producer warp only: 288 -> 168 regs/thread (ptxas caps as for 384)
  static constexpr int kQTilesPerCTA = kWGs;                  // Q image tiles are 64 rows (one per WG)
};

// The smem layout (N, K = keys, stage) of V's kStages stages for the PV wgmma's B operand, from its
// swizzle atom: K-major (V^T: rows of keys, N = D + ones rows), or kMN (a 16-bit V: the atoms stacked
// along the keys first, so each 64-channel block's kKeys key rows are one run: sw128_elem16_offset).
template <bool kMN, class Atom, int kN, int kKeys, int kStages>
constexpr auto vt_stage_layout() {
  using Shape = cute::Shape<cute::Int<kN>, cute::Int<kKeys>, cute::Int<kStages>>;
  if constexpr (kMN) {
    return cute::tile_to_shape(Atom{}, Shape{}, cute::Step<cute::_2, cute::_1, cute::_3>{});
  } else {
    return cute::tile_to_shape(Atom{}, Shape{});
  }
}

// kSumCols (FwdOptions::tc_row_sum: 8, else 0): rows of fp8 ones after the D channel rows of each
// V^T stage in smem, so the PV wgmma (N = D + kSumCols) also yields each row's sum of P~ in the
// accumulator columns D.. (the softmax then adds no p). The pre-pass image stays D x 128; the
// producer copies it into the first kVTileBytes of the stage and the ones stay as the kernel wrote
// them. kSumCols = 0 is every other variant, its sizes and layouts unchanged.
// kKeys: keys per tile, kBlockKV or (long_tile) kLongTileKeys.
// VElem: V's element type in smem, FP8 E4M3 (the quantized V^T image), or with FwdOptions::pv_16bit
// the input's 16-bit type (bf16 / fp16: V as given, for a 16-bit PV wgmma). The 16-bit image is
// MN-major (channels contiguous, V's own row order, no transpose) in 128-byte swizzle atoms of 64
// channels x 8 keys, per 64-channel block kKeys key rows: sw128_elem16_offset<kKeys, D>(key, channel)
// elements; 128-key tiles, no ones rows.
template <int D, int kWGs = 2, int kSumCols = 0, int kKeys = kBlockKV, class VElem = cute::float_e4m3_t>
struct TileConfig {
  static_assert(D == 64 || D == 128, "head dims 64 and 128 only");
  static_assert(kSumCols == 0 || kSumCols == 8, "no sum columns, or one 8-row swizzle atom of them");
  static_assert(kKeys == kBlockKV || kKeys == kLongTileKeys, "128-key tiles, or long_tile's 192");
  static constexpr bool kV16 = !std::is_same_v<VElem, cute::float_e4m3_t>;  // FwdOptions::pv_16bit
  static_assert(!kV16 || std::is_same_v<VElem, cute::bfloat16_t> || std::is_same_v<VElem, cute::half_t>,
                "V in FP8 E4M3, bf16 or fp16");
  static_assert(!kV16 || (kSumCols == 0 && kKeys == kBlockKV), "a 16-bit V: no ones rows, 128-key tiles");
  static constexpr int kVBytes = sizeof(VElem);  // bytes per V element
  static constexpr int kHeadDim = D;
  using Cta = CtaShape<kWGs>;

  static constexpr int kTileKeys = kKeys;
  static constexpr int kKBlock = kKBlockKeys<kKeys>;   // keys per K scale
  static constexpr int kScaleBlocks = kKeys / kKBlock;  // K scales per tile: 1, or 3 (long_tile)
  static constexpr int kQTileBytes = kRowsPerWG * D;   // int8, 64 rows x D
  static constexpr int kKTileBytes = kKeys * D;        // int8, kKeys keys x D
  static constexpr int kVTileBytes = D * kKeys * kVBytes;  // D channels x kKeys keys (fp8 V^T, or 16-bit V): the image
  // One K block's images (the pre-pass writes one per K scale; a tile is kScaleBlocks of them in a row).
  static constexpr int kKBlockBytes = kKBlock * D;
  static constexpr int kVBlockBytes = D * kKBlock * kVBytes;
  static constexpr int kSumColumns = kSumCols;
  static constexpr int kPVCols = D + kSumCols;         // N of the PV wgmma
  static constexpr int kVStageBytes = kPVCols * kKeys * kVBytes;  // one V^T stage in smem: image + ones rows
  // A V^T stage is kVChunks columns of swizzle atoms (one at 128 keys: SW128 spans them; long_tile:
  // three SW64 columns of 64 keys, one per K block), each D image rows then kSumCols ones rows. So
  // with ones rows a long tile's image lands as three copies, one per chunk (mainloop.hpp).
  static constexpr int kVChunks = kKeys % 128 == 0 ? 1 : kKeys / 64;
  static constexpr int kVChunkKeys = kKeys / kVChunks;
  static constexpr int kVChunkImageBytes = D * kVChunkKeys * kVBytes;   // the pre-pass image part of a chunk
  static constexpr int kVChunkBytes = kPVCols * kVChunkKeys * kVBytes;  // the chunk in smem, ones rows included
  // The producer's V^T copies per tile: one where the stage's image rows are one run of bytes (one
  // chunk, or no ones rows between the chunks), else one per chunk, kVChunkBytes apart in smem.
  static constexpr int kVCopies = kSumCols == 0 ? 1 : kVChunks;
  static constexpr int kVCopyBytes = kVTileBytes / kVCopies;
  static constexpr int kSmemQ = kQTileBytes * kWGs;

  // Stages of the K/V ring: the deepest ring, up to kMaxStages, that leaves room for the region
  // after the barriers, smem_o_every's fp32 O sum (kBlockM x D floats, the largest user; the staged
  // epilogue's tile is smaller) and the 1024-byte base slack. One CTA per SM (the register file is
  // full), so shared memory is not shared with a second CTA: use it for depth.
  //   hd128, 2 WGs: Q 16 KB + 4 * (K 16 KB + V^T 16 KB) + O sum  64 KB = 208 KB: 4 stages
  //   hd128, 3 WGs: Q 24 KB + 3 * 32 KB                 + O sum  96 KB = 216 KB: 3 stages
  //                 (4 stages would be 248 KB > 227 KB)
  //   hd64,  2 WGs: Q  8 KB + 4 * (K  8 KB + V^T  8 KB) + O sum  32 KB = 104 KB: 4 stages
  //   hd64,  3 WGs: Q 12 KB + 4 * 16 KB                 + O sum  48 KB = 124 KB: 4 stages
  //   tc_row_sum (V^T stages of 17 / 9 KB, O sum of D + 8 columns) keeps these depths: hd128 2 WGs
  //   217 KB, 3 WGs 226 KB.
  //   A 16-bit V (pv_16bit, never with smem_o_every) leaves room for the staged epilogue's 16-bit O
  //   tile instead (kBlockM x D x 2 bytes, epilogue.hpp StagedOut) and has V stages of 32 / 16 KB:
  //   hd128 2 WGs Q 16 KB + 3 * 48 KB + O tile 32 KB = 193 KB: 3 stages (4: 241 KB),
  //         3 WGs Q 24 KB + 3 * 48 KB + 48 KB = 217 KB: 3 stages;
  //   hd64  2 WGs Q  8 KB + 4 * 24 KB + 16 KB = 121 KB, 3 WGs 133 KB: 4 stages.
  // The ring depth changes no math (same results bit for bit at any depth).
  static constexpr int kMaxStages = 4;
  static constexpr int kSmemBudget = 227 * 1024;
  // mainloop.hpp kSmemOSumBytes (FP8 V), epilogue.hpp StagedOut::kBytes (16-bit V)
  static constexpr int kSmemAfterBarriers = kV16 ? Cta::kBlockM * D * 2 + 16 : Cta::kBlockM * kPVCols * 4 + 16;
  static constexpr int stages_that_fit() {
    int n = kMaxStages;
    while (n > 2 && kSmemQ + n * (kKTileBytes + kVStageBytes) + 8 * (2 * n + 1) + 1024 + kSmemAfterBarriers > kSmemBudget) --n;
    return n;
  }
  static constexpr int kStages = stages_that_fit();
  //   long_tile (hd128, 2 WGs, 192 keys): Q 16 KB + 3 * (K 24 KB + V^T 24 KB) + O sum 64 KB = 224 KB: 3 stages;
  //   with tc_row_sum (V^T stages of 25.5 KB, O sum of 136 columns) 3 stages need 234 KB: 2 stages
  static_assert(kStages == (D == 128 && (kWGs == 3 || kKeys == kLongTileKeys || kV16) ? (kKeys == kLongTileKeys && kSumCols ? 2 : 3) : 4),
                "the ring depths the budget above works out");

  static constexpr int kSmemK = kKTileBytes * kStages;
  static constexpr int kSmemV = kVStageBytes * kStages;
  static constexpr int kSmemBarriers = 8 * (2 * kStages + 1);
  // +1024: the dynamic smem base is rounded up to the 1024-byte swizzle period in the kernel.
  static constexpr int kSmemBytes = kSmemQ + kSmemK + kSmemV + kSmemBarriers + 1024;
  static_assert(kSmemBytes + kSmemAfterBarriers <= kSmemBudget, "shared memory budget of one sm_90 CTA");
  static_assert(kQTileBytes % 1024 == 0 && kKTileBytes % 1024 == 0 && kVTileBytes % 1024 == 0 &&
                    kVStageBytes % (kVChunks == 1 ? 1024 : 512) == 0 && kVChunkBytes % (kVChunks == 1 ? 1024 : 512) == 0,
                "every tile (and V^T chunk) must start on its swizzle period: 1024 bytes for SW128, 512 for SW64");

  // Q/K rows are D bytes: one 128-byte swizzle atom per row at hd128, a 64-byte one at hd64.
  using SmemAtomQK = std::conditional_t<D == 128, cute::GMMA::Layout_K_SW128_Atom<int8_t>,
                                        cute::GMMA::Layout_K_SW64_Atom<int8_t>>;
  // V^T rows are 128 keys = 128 bytes of fp8 at every head dim; long_tile's 192 keys are three
  // 64-byte swizzle atoms per row (atoms of one 64-key block first: the pre-pass's 64-key images).
  // A 16-bit V: MN-major atoms of 64 channels (128 bytes) x 8 keys (vt_stage_layout).
  using SmemAtomV = std::conditional_t<kV16, cute::GMMA::Layout_MN_SW128_Atom<VElem>,
                                       std::conditional_t<kKeys % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<cute::float_e4m3_t>,
                                                          cute::GMMA::Layout_K_SW64_Atom<cute::float_e4m3_t>>>;

  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtomQK{}, cute::Shape<cute::Int<kRowsPerWG>, cute::Int<D>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtomQK{}, cute::Shape<cute::Int<kKeys>, cute::Int<D>, cute::Int<kStages>>{}));
  // (N = channels (+ ones rows), K = keys, stage)
  using SmemLayoutVt = decltype(vt_stage_layout<kV16, SmemAtomV, kPVCols, kKeys, kStages>());

  // S = Q K^T: INT8 x INT8 -> INT32, both operands K-major in smem (N = the tile's keys).
  using MmaQK = std::conditional_t<kKeys == kBlockKV, cute::SM90::GMMA::MMA_64x128x32_S32S8S8_SS_TN,
                                   cute::SM90::GMMA::MMA_64x192x32_S32S8S8_SS_TN>;
  // Same product with Q from registers (q_in_registers): B descriptors are those of the SS atom.
  using MmaQKRS = std::conditional_t<kKeys == kBlockKV, cute::SM90::GMMA::MMA_64x128x32_S32S8S8_RS_TN,
                                     cute::SM90::GMMA::MMA_64x192x32_S32S8S8_RS_TN>;
  // O += P V: FP8 x FP8 -> FP32, P from registers, V^T K-major (keys contiguous) in smem; N = D,
  // or D + 8 with the ones rows (kSumCols).
  template <int kN>
  using MmaPVofN = std::conditional_t<
      kN == 128, cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_RS_TN<>,
      std::conditional_t<kN == 64, cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_RS_TN<>,
                         std::conditional_t<kN == 136, cute::SM90::GMMA::MMA_64x136x32_F32E4M3E4M3_RS_TN<>,
                                            cute::SM90::GMMA::MMA_64x72x32_F32E4M3E4M3_RS_TN<>>>>;
  // pv_16bit: O += P V as a 16-bit wgmma, P (bf16 / fp16, = V's type) from registers, V MN-major in
  // smem (the MN-major B operand exists for 16-bit types only): k = 16 keys per instruction.
  using MmaPV16 = std::conditional_t<
      std::is_same_v<VElem, cute::bfloat16_t>,
      std::conditional_t<D == 128, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>,
                         cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>>,
      std::conditional_t<D == 128, cute::SM90::GMMA::MMA_64x128x16_F32F16F16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>,
                         cute::SM90::GMMA::MMA_64x64x16_F32F16F16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>>>;
  using MmaPV = std::conditional_t<kV16, MmaPV16, MmaPVofN<kPVCols>>;
  static constexpr int kPVK = kV16 ? 16 : 32;  // keys per PV k-step (4 A registers of P each)
  using TiledMmaQK = decltype(cute::make_tiled_mma(MmaQK{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(MmaPV{}));

  static constexpr int kSRegs = kRowsPerWG * kKeys / 128;  // 64 int32 per thread (96 with long_tile)
  static constexpr int kORegs = kRowsPerWG * D / 128;         // D/2 fp32 per thread
  // The PV accumulator: O's values, then (kSumCols) 4 more per thread, each its row's sum of P~
  // (values kORegs + 2x and + 2x + 1 of row half x: columns D + 2t + {0, 1}, all ones in V^T).
  static constexpr int kPVRegs = kRowsPerWG * kPVCols / 128;
  // 16 x (4 fp8) per thread (24 with long_tile); 32 x (2 16-bit) with a 16-bit V
  static constexpr int kPRegs = kRowsPerWG * kKeys / 128 / (4 / kVBytes);
};

// ---- byte images of the swizzled tiles (shared by the pre-pass and host_layout_check) ----------
// Q/K tiles have D-byte rows (SW128 at hd128, SW64 at hd64), V^T tiles 128-byte rows:
// sw_byte_offset<row bytes>(row, byte column) of common/sm90/gmma_swizzle.cuh. A 16-bit V tile
// (pv_16bit): element sw128_elem16_offset<128, D>(key, channel).
using sage_common::sm90::sw128_elem16_offset;
using sage_common::sm90::sw_byte_offset;

// ---- key order inside the stored V^T tile -------------------------------------------------------
// The fp32 accumulator of S gives a thread (lane = 4*g + t) the key columns 8j + 2t + {0,1}; the
// 8-bit A operand of the PV wgmma wants k columns 4t..4t+3 and 16+4t..16+4t+3 of each 32-wide
// k-block. Storing V^T with k position p holding key perm(p) makes the accumulator registers the
// A fragment as they are (no shuffles):  within a 16-key half, position 4t+i holds key
// 2t + (i & 1) + 8 * (i >> 1). Masks always use the real key index (the S column).
__host__ __device__ __forceinline__ int vt_position_to_key(int p) {
  const int q = p & 15, t = q >> 2, i = q & 3;
  return (p & ~15) + 2 * t + (i & 1) + 8 * (i >> 1);
}

}  // namespace sage_sm90
