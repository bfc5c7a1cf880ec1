// Host check (no GPU) of the wgmma variant's shared-memory layouts (mainloop_wgmma_sm90.cuh):
// every decoded tile is a bijection onto its buffer, every 8-element group the decode writes with
// one 16-byte store (k = 8i .. 8i + 7 of a row) is contiguous and 16-byte aligned, the 4-byte Q
// pairs (k even) are contiguous, and buffer 1 follows buffer 0. Run by compile_check.sh.
#include <cstdio>
#include <vector>

#include "mainloop_wgmma_sm90.cuh"

namespace {

template <class Layout>
bool check(const char* name, int rows, int cols, int bufs) {
  constexpr Layout layout{};
  const int size = rows * cols * bufs;
  if (int(cute::cosize(layout)) != size) {
    std::printf("FAIL %s: cosize %d, expected %d\n", name, int(cute::cosize(layout)), size);
    return false;
  }
  std::vector<int> hit(size, 0);
  bool ok = true;
  for (int b = 0; b < bufs; ++b) {
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        int off;
        if constexpr (cute::rank(Layout{}) == 3) {
          off = int(layout(r, c, b));
        } else {
          off = int(layout(r, c));
        }
        if (off < 0 || off >= size) { ok = false; continue; }
        ++hit[off];
        const int base = (c & ~7);
        int off0;
        if constexpr (cute::rank(Layout{}) == 3) {
          off0 = int(layout(r, base, b));
        } else {
          off0 = int(layout(r, base));
        }
        if (off != off0 + (c & 7) || off0 % 8 != 0) ok = false;  // 16-byte groups of 8 elements
        if (off / (rows * cols) != b) ok = false;                // buffer b is the b-th block
      }
    }
  }
  for (int i = 0; i < size; ++i) ok &= hit[i] == 1;
  std::printf("%s %s (%d x %d x %d)\n", ok ? "ok  " : "FAIL", name, rows, cols, bufs);
  return ok;
}

template <int D, sage_fp4::Fp4Format F>
bool check_config() {
  using W = sage_fp4::WgmmaConfig<D, F>;
  bool ok = check<typename W::SmemLayoutQ>("Q", 64, D, 1);
  ok &= check<typename W::SmemLayoutK>("K", sage_fp4::kBlockN, D, 2);
  ok &= check<typename W::SmemLayoutVt>("V^T", D, sage_fp4::kBlockN, 2);
  return ok;
}

}  // namespace

int main() {
  // V^T k order: vt_position_key is a bijection within each 32-key group.
  bool ok = true;
  for (int kk = 0; kk < sage_fp4::kBlockN; ++kk) {
    int n = 0;
    for (int j = 0; j < sage_fp4::kBlockN; ++j) n += sage_fp4::vt_position_key(j) == kk;
    ok &= n == 1 && (sage_fp4::vt_position_key(kk) >> 5) == (kk >> 5);
  }
  std::printf("%s vt_position_key permutation\n", ok ? "ok  " : "FAIL");
  ok &= check_config<128, sage_fp4::Fp4Format::kNvfp4>();
  ok &= check_config<64, sage_fp4::Fp4Format::kMxfp4>();
  return ok ? 0 : 1;
}
