// Host-side kernel launch shared by the kernels' dispatch code.
#pragma once

#include <cuda_runtime.h>

namespace sage_common {

// Launch `kernel(p)` on `stream` with `smem` bytes of dynamic shared memory. The opt-in limit above
// 48 KiB is a per-device function attribute: set on every launch instead of cached, so a process
// that uses several GPUs gets it on each (the call is cheap).
template <class Kernel, class Params>
cudaError_t launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, cudaStream_t stream) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sage_common
