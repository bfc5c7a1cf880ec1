// Host-only check (no GPU) that the backward kernels' CuTe smem layouts are the swizzle patterns
// the image pre-pass writes (sage_diffusers/kernels/sagebwd_sm90.py, common/sm90/gmma_swizzle.cuh):
// 16-bit K-major SW128 tiles (Q, dO, K, V; Q and the smoothed K also read MN-major by the bf16 dK and
// dQ products) and INT8 K-major SW64 tiles (Q^T, dO'^T, K^T), read through a 1024-aligned smem
// pointer (CuTe swizzles these layouts on byte addresses), against the formulas (16-byte chunk c of
// row r at c ^ (r % 8) in 128-byte rows, c ^ ((r / 2) % 4) in 64-byte rows).
// csrc/compile_check.sh builds and runs it:
//   nvcc -std=c++20 --expt-relaxed-constexpr -I$CUTLASS_INCLUDE -o /tmp/sagebwd_layout csrc/sm90_sagebwd/host_layout_check.cu && /tmp/sagebwd_layout
#include <cstdio>

#include "../common/sm90/gmma_swizzle.cuh"
#include "dq_kernel.cuh"

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
  using Q = DqConfig<D, cute::bfloat16_t>;
  using Q16 = DqConfig<D, cute::bfloat16_t, DqAcc::kBf16InPlace>;
  using sage_common::sm90::sw128_elem16_offset;
  using sage_common::sm90::sw_byte_offset;
  int bad = 0;
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c) {  // 16-bit 64 x D tiles: K, V, Q, dO of both kernels
      const long want = sw128_elem16_offset<64, D>(r, c);
      bad += offset<cute::bfloat16_t>(typename C::LayoutKV{}, r, c) != want;
      bad += offset<cute::bfloat16_t>(typename C::LayoutQ{}, r, c) != want;
      bad += offset<cute::bfloat16_t>(typename Q::LayoutKV{}, r, c) != want;
      // DkAcc::kBf16InPlace reads the Q tile as dK's MN-major B operand: (channel, query) at the same bytes
      bad += offset<cute::bfloat16_t>(typename C::LayoutQmn{}, c, r) != want;
      // DqAcc::kBf16InPlace reads the smoothed K's 16-bit tile as dQ's MN-major B operand
      bad += offset<cute::bfloat16_t>(typename Q16::LayoutKsmn{}, c, r) != want;
    }
  for (int r = 0; r < D; ++r)
    for (int c = 0; c < 64; ++c) {  // INT8 D x 64 tiles (64-byte rows): Q^T, dO'^T, K^T
      const long want = sw_byte_offset<64>(r, c);
      bad += offset<int8_t>(typename C::LayoutT8{}, r, c) != want;
      bad += offset<int8_t>(typename Q::LayoutT8{}, r, c) != want;
    }
  std::printf("hd%d: %d mismatches\n", D, bad);
  return bad;
}

int main() { return check<64>() + check<128>() == 0 ? 0 : 1; }
