// Host check (no GPU) of the wgmma variant's shared-memory tiles (mainloop_wgmma_sm90.cuh): for
// every (row, col, buffer) of the decoded Q, K and V^T tiles, the address CuTe's layout gives
// (tile_elem: what the wgmma descriptors read) equals the kernel's sw128_elem16_offset and the
// GMMA K-major 128-byte-swizzle formula
//   buffer * tile bytes + (col / 64) * rows * 128 + row * 128 + (((col % 64) / 8) ^ (row % 8)) * 16
//   + (col % 8) * 2   (bytes, from a 1024-byte aligned base),
// so the image pre-pass's 16-byte stores (8 consecutive cols), the decoded Q pairs and the
// producer's ldmatrix rows land where wgmma looks.
// Also: vt_position_key is a permutation within 32-key groups. Run by compile_check.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kv_images_sm90.cuh"
#include "mainloop_wgmma_sm90.cuh"

namespace {

template <class Layout, class Elem, int kRows, int kCols>
bool check(const char* name, int bufs) {
  const int rows = kRows, cols = kCols;
  const int tile_bytes = rows * cols * 2;
  Elem* base = static_cast<Elem*>(std::aligned_alloc(1024, size_t(tile_bytes) * bufs));
  bool ok = int(cute::cosize(Layout{})) * 2 == tile_bytes * bufs;
  for (int b = 0; b < bufs; ++b) {
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        Elem* p;
        if constexpr (cute::rank(Layout{}) == 3) {
          p = sage_fp4::tile_elem<Layout>(base, r, c, b);
        } else {
          p = sage_fp4::tile_elem<Layout>(base, r, c);
        }
        if (p != base + sage_fp4::sw128_elem16_offset<kRows, kCols>(r, c, b) && ok) {
          std::printf("     %s (%d, %d, %d): CuTe and sw128_elem16_offset differ\n", name, r, c, b);
          ok = false;
        }
        const long got = reinterpret_cast<const char*>(p) - reinterpret_cast<const char*>(base);
        const long want = long(b) * tile_bytes + (c / 64) * rows * 128 + r * 128 +
                          (((c % 64) / 8) ^ (r % 8)) * 16 + (c % 8) * 2;
        if (got != want && ok) {
          std::printf("     %s (%d, %d, %d): byte %ld, expected %ld\n", name, r, c, b, got, want);
          ok = false;
        }
      }
    }
  }
  std::free(base);
  std::printf("%s %s (%d x %d x %d)\n", ok ? "ok  " : "FAIL", name, rows, cols, bufs);
  return ok;
}

template <int D, sage_fp4::Fp4Format F>
bool check_config() {
  using W = sage_fp4::WgmmaConfig<D, F>;
  using E = typename W::Elem;
  bool ok = check<typename W::SmemLayoutQ, E, 64, D>("Q", 1);
  ok &= check<typename W::SmemLayoutK, E, sage_fp4::kBlockN, D>("K", W::kStagesK);
  ok &= check<typename W::SmemLayoutVt, E, D, sage_fp4::kBlockN>("V^T", W::kStagesV);
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  for (int kk = 0; kk < sage_fp4::kBlockN; ++kk) {
    int n = 0;
    for (int j = 0; j < sage_fp4::kBlockN; ++j) n += sage_fp4::vt_position_key(j) == kk;
    ok &= n == 1 && (sage_fp4::vt_position_key(kk) >> 5) == (kk >> 5);
  }
  std::printf("%s vt_position_key permutation\n", ok ? "ok  " : "FAIL");
  ok &= check_config<128, sage_fp4::Fp4Format::kNvfp4>();
  ok &= check_config<64, sage_fp4::Fp4Format::kNvfp4>();
  ok &= check_config<128, sage_fp4::Fp4Format::kMxfp4>();
  ok &= check_config<64, sage_fp4::Fp4Format::kMxfp4>();
  return ok ? 0 : 1;
}
