// Host-side kernel launch shared by the kernels' dispatch code.
#pragma once

#include <cuda_runtime.h>

namespace sage_common {

// Launch kinds: kPdl starts the kernel with programmatic stream serialization (common/sm90/pdl.cuh:
// the kernel must pdl_wait() before it reads what the previous kernel on the stream wrote).
enum class LaunchKind : int { kPlain = 0, kPdl = 1 };

// Launch `kernel(p)` on `stream` with `smem` bytes of dynamic shared memory. The opt-in limit above
// 48 KiB is a per-device function attribute: set on every launch instead of cached, so a process
// that uses several GPUs gets it on each (the call is cheap).
template <class Kernel, class Params>
cudaError_t launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, cudaStream_t stream,
                             LaunchKind kind = LaunchKind::kPlain) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if (kind == LaunchKind::kPlain) {
    kernel<<<grid, threads, smem, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace sage_common
