// Offsets inside K-major GMMA shared-memory tiles with 128- / 64-byte swizzle atoms (CuTe's
// GMMA::Layout_K_SW128_Atom / Layout_K_SW64_Atom on a 1024-byte aligned base): 16-byte chunk c of
// row r is stored at chunk c ^ (r % 8) (SW128) or c ^ ((r / 2) % 4) (SW64). Used by the pre-passes
// that write tile images and by threads that read single elements of a tile; each kernel's host
// layout check proves them equal to the CuTe layout its wgmma descriptors use.
#pragma once

namespace sage_common::sm90 {

// Byte offset of (row r, byte column c) in a tile of 128-byte rows (SW128) or 64-byte rows (SW64).
template <int kRowBytes>
__host__ __device__ __forceinline__ int sw_byte_offset(int r, int c) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "swizzle atoms of 128 or 64 bytes");
  if constexpr (kRowBytes == 128) {
    return r * 128 + ((((c >> 4) ^ (r & 7)) << 4) | (c & 15));
  } else {
    return r * 64 + ((((c >> 4) ^ ((r >> 1) & 3)) << 4) | (c & 15));
  }
}

// Element offset of (row, col[, buffer]) in a SW128 tile of 16-bit elements, kRows x kCols per
// buffer: 64-element (128-byte) rows in 8-row atoms stacked along the rows (kRows of them per
// 64-column block); buffer b follows buffer b - 1.
template <int kRows, int kCols>
__host__ __device__ __forceinline__ constexpr int sw128_elem16_offset(int row, int col, int buf = 0) {
  return buf * kRows * kCols + (col >> 6) * kRows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) +
         (col & 7);
}

}  // namespace sage_common::sm90
