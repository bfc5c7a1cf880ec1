// Host-only check (no GPU) that the experiment's layout tables are the hardware's swizzle patterns:
// CuTe's 16-bit K-major SW128 tiles (Q, dO, K, V) and INT8 K-major SW64 tiles (Q^T, dO'^T, K^T),
// read through a 1024-aligned smem pointer as binding.cu's layout_table does, against the formulas
// (16-byte chunk c of row r at c ^ (r % 8) in 128-byte rows, c ^ ((r / 2) % 4) in 64-byte rows).
//   nvcc -std=c++20 --expt-relaxed-constexpr -I$CUTLASS_INCLUDE -o /tmp/lab_layout bench/sm90_sagebwd/host_layout_check.cu && /tmp/lab_layout
#include <cstdio>

#include "dkdv_kernel.cuh"

using namespace sagebwd_sm90;

template <class Elem, class L>
long offset(L layout, int r, int c) {
  alignas(1024) static Elem buf[4 * 128 * 128];
  auto tile = cute::make_tensor(cute::make_smem_ptr(buf), layout);
  if constexpr (decltype(cute::rank(layout))::value == 3) {
    return &tile(r, c, 0) - buf;
  } else {
    return &tile(r, c) - buf;
  }
}

template <int D>
int check() {
  using C = Config<D, cute::bfloat16_t>;
  int bad = 0;
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c) {  // 16-bit elements: 64 per 128-byte row, 8 per chunk
      const long want = (c / 64) * 64 * 64 + r * 64 + ((((c % 64) / 8) ^ (r % 8)) * 8) + (c % 8);
      bad += offset<cute::bfloat16_t>(typename C::LayoutKV{}, r, c) != want;
      bad += offset<cute::bfloat16_t>(typename C::LayoutQ{}, r, c) != want;
    }
  for (int r = 0; r < D; ++r)
    for (int c = 0; c < 64; ++c) {  // INT8: 64-byte rows
      const long want = r * 64 + ((((c >> 4) ^ ((r >> 1) & 3)) << 4) | (c & 15));
      bad += offset<int8_t>(typename C::LayoutT8{}, r, c) != want;
    }
  std::printf("hd%d: %d mismatches\n", D, bad);
  return bad;
}

int main() { return check<64>() + check<128>() == 0 ? 0 : 1; }
