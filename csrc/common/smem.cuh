// Shared-memory addressing shared by the kernels.
#pragma once

#include <cstdint>

namespace sage_common {

// 32-bit shared-window address of a generic pointer into shared memory (PTX operands).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Bytes to add to shared-memory address `addr` to reach the next kAlign-byte boundary: the GMMA
// swizzle atoms repeat every 1024 bytes of *address*, and `__align__` on the extern array does not
// guarantee it. Use as `raw + smem_align_pad(smem_addr(raw))`; callers reserve kAlign bytes of
// slack in their shared-memory size. (An aligning function that returns the pointer instead
// compiled the 8-bit kernel to different SASS.)
template <uint32_t kAlign = 1024>
__device__ __forceinline__ uint32_t smem_align_pad(uint32_t addr) {
  static_assert((kAlign & (kAlign - 1)) == 0, "power-of-two alignment");
  return (kAlign - (addr & (kAlign - 1))) & (kAlign - 1);
}

}  // namespace sage_common
