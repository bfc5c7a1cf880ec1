// Host-only proof that the layouts the kernels rely on are the ones CuTe builds (no GPU needed).
//
// Checks, for both head dims:
//   1. every (row, col, stage) of the Q/K/V^T smem layouts maps to stage*tile + sw_byte_offset(row,
//      col): the pre-pass writes those images, the wgmma descriptors read them through CuTe;
//   2. the wgmma accumulator (C) and register-A fragment maps of the TiledMMAs are the ones the
//      softmax indexes by hand (see softmax.hpp);
//   3. (pv_16bit) the 16-bit V layout is the pre-pass's image, sw128_elem16_offset per stage, and the
//      16-bit A fragment of P holds the S accumulator values the softmax packs into it.
// Exit status 0 when everything matches. Built and run by compile_check.sh.
#include <cstdio>

#include "tile_config.hpp"

using namespace cute;
using namespace sage_sm90;

static int g_fail = 0;
#define CHECK_EQ(a, b, what)                                                                  \
  do {                                                                                        \
    long _a = (long)(a), _b = (long)(b);                                                      \
    if (_a != _b) {                                                                           \
      if (g_fail < 20) std::printf("MISMATCH %s: %ld vs %ld\n", what, _a, _b);                \
      ++g_fail;                                                                               \
    }                                                                                         \
  } while (0)

// block_cols: the columns of one image (the pre-pass writes one per K block): a stage holds
// cols / block_cols images of rows x block_cols bytes back to back (long_tile's V^T: three D x 64
// images; every other layout one image per stage).
template <class Layout3>
void check_staged(Layout3 layout, int rows, int cols, int stages, int tile_bytes, const char* name, int block_cols = 0) {
  auto sw = get_swizzle_portion(layout);
  auto base = get_nonswizzle_portion(layout);
  const int bc = block_cols > 0 ? block_cols : cols;
  for (int s = 0; s < stages; ++s)
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        long got = sw(base(r, c, s));
        const int cb = c % bc;
        long want = (long)s * tile_bytes + (long)(c / bc) * rows * bc +
                    (bc == 128 ? sw_byte_offset<128>(r, cb) : sw_byte_offset<64>(r, cb));
        CHECK_EQ(got, want, name);
      }
}

template <class Layout2>
void check_single(Layout2 layout, int rows, int cols, const char* name) {
  auto sw = get_swizzle_portion(layout);
  auto base = get_nonswizzle_portion(layout);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      long got = sw(base(r, c));
      long want = cols == 128 ? sw_byte_offset<128>(r, c) : sw_byte_offset<64>(r, c);
      CHECK_EQ(got, want, name);
    }
}

// kSumCols (tc_row_sum): the V^T stage layout has kSumCols more rows, the image's D rows at the
// image's offsets and the ones rows in the stage's last kSumCols * 128 bytes (fill_sum_rows), and
// the PV accumulator kPVRegs values of the same rule (columns D.. the row sums).
// kKeys (long_tile: 192): the K tile is kScaleBlocks 64-row images in a row (the 8-row swizzle
// period makes that the same offsets as one tall image), the V^T tile kScaleBlocks D x 64 images.
template <int D, int kSumCols = 0, int kKeys = kBlockKV>
void check_config() {
  using C = TileConfig<D, 2, kSumCols, kKeys>;
  check_single(typename C::SmemLayoutQ{}, kRowsPerWG, D, "Q image");
  check_staged(typename C::SmemLayoutK{}, kKeys, D, C::kStages, C::kKTileBytes, "K image");
  for (int b = 0; b < C::kScaleBlocks; ++b)  // each K block's rows: its own image's offsets
    for (int r = 0; r < C::kKBlock; ++r)
      for (int c = 0; c < D; ++c)
        CHECK_EQ(b * C::kKBlockBytes + sw_byte_offset<D>(r, c), sw_byte_offset<D>(b * C::kKBlock + r, c),
                 "K tile = its blocks' images");
  check_staged(typename C::SmemLayoutVt{}, D + kSumCols, kKeys, C::kStages, C::kVStageBytes, "Vt image", C::kKBlock);
  CHECK_EQ(C::kVStageBytes - C::kVTileBytes, kSumCols * kKeys, "Vt stage: image + ones rows");
  CHECK_EQ(C::kScaleBlocks * C::kVBlockBytes, C::kVTileBytes, "Vt tile = its blocks' images");

  // Accumulator of S (64 x 128): value v of thread tid is row 16*warp + g + 8*((v>>1)&1),
  // column 8*(v>>2) + 2*t + (v&1).
  auto cS = typename C::TiledMmaQK{}.get_layoutC_TV();
  for (int tid = 0; tid < 128; ++tid)
    for (int v = 0; v < C::kSRegs; ++v) {
      int idx = cS(tid, v);
      int m = idx % 64, n = idx / 64;
      int g = (tid & 31) >> 2, t = tid & 3, w = tid >> 5;
      CHECK_EQ(m, 16 * w + g + 8 * ((v >> 1) & 1), "S acc row");
      CHECK_EQ(n, 8 * (v >> 2) + 2 * t + (v & 1), "S acc col");
    }
  // Accumulator of O (64 x D, + kSumCols): same rule.
  auto cO = typename C::TiledMmaPV{}.get_layoutC_TV();
  for (int tid = 0; tid < 128; ++tid)
    for (int v = 0; v < C::kPVRegs; ++v) {
      int idx = cO(tid, v);
      int m = idx % 64, n = idx / 64;
      int g = (tid & 31) >> 2, t = tid & 3, w = tid >> 5;
      CHECK_EQ(m, 16 * w + g + 8 * ((v >> 1) & 1), "O acc row");
      CHECK_EQ(n, 8 * (v >> 2) + 2 * t + (v & 1), "O acc col");
    }
  // Register A of the PV wgmma (64 x 32 per k-block): byte v of thread tid is row
  // 16*warp + g + 8*((v>>2)&1), k = 4*t + (v&3) + 16*(v>>3).
  auto aP = typename C::TiledMmaPV{}.get_layoutA_TV();
  for (int tid = 0; tid < 128; ++tid)
    for (int v = 0; v < 16; ++v) {
      int idx = aP(tid, v);
      int m = idx % 64, k = idx / 64;
      int g = (tid & 31) >> 2, t = tid & 3, w = tid >> 5;
      CHECK_EQ(m, 16 * w + g + 8 * ((v >> 2) & 1), "P A-frag row");
      CHECK_EQ(k, 4 * t + (v & 3) + 16 * (v >> 3), "P A-frag k");
    }
  // Register A of the INT8 RS QK^T wgmma (FwdOptions::q_in_registers; mainloop.hpp load_q_frag): same rule, byte
  // i of register r = row 16*warp + g + 8*(r&1), k = 16*(r>>1) + 4*t + i.
  auto aQ = decltype(cute::make_tiled_mma(typename C::MmaQKRS{})){}.get_layoutA_TV();
  for (int tid = 0; tid < 128; ++tid)
    for (int v = 0; v < 16; ++v) {
      int idx = aQ(tid, v);
      int m = idx % 64, k = idx / 64;
      int g = (tid & 31) >> 2, t = tid & 3, w = tid >> 5, r = v >> 2;
      CHECK_EQ(m, 16 * w + g + 8 * (r & 1), "Q A-frag row");
      CHECK_EQ(k, 16 * (r >> 1) + 4 * t + (v & 3), "Q A-frag k");
    }
  // End to end: the byte the softmax packs into A register (4*kb + r), byte i (softmax.hpp) is the
  // accumulator value v it names; that value's S coordinate (row, key column) must equal the A
  // fragment's (row, k position) once the position is mapped to the key V^T stores there.
  for (int tid = 0; tid < 128; ++tid)
    for (int kb = 0; kb < kKeys / 32; ++kb)
      for (int r = 0; r < 4; ++r)
        for (int i = 0; i < 4; ++i) {
          const int v = 4 * (4 * kb + 2 * (r >> 1) + (i >> 1)) + 2 * (r & 1) + (i & 1);
          const int s_idx = cS(tid, v);
          const int a_idx = aP(tid, 4 * r + i);
          const int pos = 32 * kb + a_idx / 64;
          CHECK_EQ(s_idx % 64, a_idx % 64, "P fragment row");
          CHECK_EQ(s_idx / 64, vt_position_to_key(pos), "P fragment key");
        }
  // The permutation is a bijection on each 32-key group.
  int seen[32] = {0};
  for (int p = 0; p < 32; ++p) seen[vt_position_to_key(p)]++;
  for (int p = 0; p < 32; ++p) CHECK_EQ(seen[p], 1, "perm bijective");
  std::printf("hd%d%s, %d-key tiles: smem Q %d B, K %d B, V %d B, total %d B, stages %d\n", D,
              kSumCols ? " (sum rows)" : "", kKeys, C::kSmemQ, C::kSmemK, C::kSmemV, C::kSmemBytes, C::kStages);
}

// A 16-bit V (FwdOptions::pv_16bit; T = bf16 / fp16): element (channel, key, stage) of the V layout
// at stage * kVStageBytes + 2 * sw128_elem16_offset<128, D>(key, channel) bytes (quant_v16_block's
// image, copied whole per stage), and P's A fragment in natural key order: register 4kb + r, half e
// of k-step kb is S accumulator value 8kb + 2r + e (softmax.hpp pack_p_frag, kP16).
// CuTe swizzles the 16-bit layout on byte addresses: read it through a (1024-aligned) smem pointer.
template <int D, int kWGs, class T>
void check_config_v16() {
  using C = TileConfig<D, kWGs, 0, kBlockKV, T>;
  static_assert(C::kV16 && C::kPVK == 16 && C::kPRegs == 32 && C::kVStageBytes == 2 * D * kBlockKV,
                "16-bit V: 16-key k-steps, 32 P registers, D x 128 16-bit elements per stage");
  CHECK_EQ(C::kStages, D == 128 ? 3 : 4, "16-bit V ring depth");
  CHECK_EQ(C::kSmemBytes + C::kSmemAfterBarriers <= C::kSmemBudget, 1, "16-bit V smem budget");
  alignas(1024) static T buf[D * kBlockKV * 4];  // the largest ring: 4 stages
  auto tile = make_tensor(make_smem_ptr(buf), typename C::SmemLayoutVt{});
  for (int s = 0; s < C::kStages; ++s)
    for (int key = 0; key < kBlockKV; ++key)
      for (int ch = 0; ch < D; ++ch) {
        const long got = 2 * (&tile(ch, key, s) - buf);
        const long want = (long)s * C::kVStageBytes + 2L * sw128_elem16_offset<kBlockKV, D>(key, ch);
        CHECK_EQ(got, want, "16-bit V image");
      }
  auto cS = typename C::TiledMmaQK{}.get_layoutC_TV();
  auto cO = typename C::TiledMmaPV{}.get_layoutC_TV();
  auto aP = typename C::TiledMmaPV{}.get_layoutA_TV();
  for (int tid = 0; tid < 128; ++tid) {
    const int g = (tid & 31) >> 2, t = tid & 3, w = tid >> 5;
    for (int v = 0; v < C::kPVRegs; ++v) {  // O: the same accumulator rule as the FP8 product's
      const int idx = cO(tid, v);
      CHECK_EQ(idx % 64, 16 * w + g + 8 * ((v >> 1) & 1), "16-bit O acc row");
      CHECK_EQ(idx / 64, 8 * (v >> 2) + 2 * t + (v & 1), "16-bit O acc col");
    }
    for (int kb = 0; kb < kBlockKV / 16; ++kb)
      for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 2; ++e) {
          const int s_idx = cS(tid, 8 * kb + 2 * r + e);
          const int a_idx = aP(tid, 2 * r + e);  // one k-step's fragment: 8 values of 16 keys
          CHECK_EQ(s_idx % 64, a_idx % 64, "16-bit P fragment row");
          CHECK_EQ(s_idx / 64, 16 * kb + a_idx / 64, "16-bit P fragment key");
        }
  }
  std::printf("hd%d, %d WGs, 16-bit V (%s): V stage %d B, stages %d, total %d B + %d B after the barriers\n", D, kWGs,
              std::is_same_v<T, cute::bfloat16_t> ? "bf16" : "fp16", C::kVStageBytes, C::kStages, C::kSmemBytes,
              C::kSmemAfterBarriers);
}

int main() {
  check_config<64>();
  check_config<128>();
  check_config<64, 8>();
  check_config<128, 8>();
  check_config<128, 0, kLongTileKeys>();
  check_config<128, 8, kLongTileKeys>();
  check_config_v16<128, 2, cute::bfloat16_t>();
  check_config_v16<128, 2, cute::half_t>();
  check_config_v16<128, 3, cute::bfloat16_t>();
  check_config_v16<64, 2, cute::bfloat16_t>();
  check_config_v16<64, 3, cute::half_t>();
  if (g_fail) {
    std::printf("host_layout_check: %d mismatches\n", g_fail);
    return 1;
  }
  std::printf("host_layout_check: all layouts match\n");
  return 0;
}
