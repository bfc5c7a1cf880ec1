// Asynchronous global -> shared copies (cp.async, sm_80+) shared by the kernels: the FP4 forward's
// K / V tile loads (fp4/mainloop.cuh) and the 8-bit pre-pass's pipelined quant launch
// (sm90_int8/prepass.cuh).
#pragma once

#include <cstdint>

#include "smem.cuh"

namespace sage_common {

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// 16 bytes from src when `pred`, else 16 zero bytes (nothing is read; src must still be a
// global address).
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(pred ? 16 : 0));
}
template <int kBytes>  // 4 or 8
__device__ __forceinline__ void cp_async_small(void* dst, const void* src) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca sizes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(kBytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace sage_common
