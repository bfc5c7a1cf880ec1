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
// cluster > 1: thread-block clusters of that many blocks along x (grid.x a multiple of it).
template <class Kernel, class Params>
cudaError_t launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, cudaStream_t stream,
                             LaunchKind kind = LaunchKind::kPlain, int cluster = 1) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if (kind == LaunchKind::kPlain && cluster <= 1) {
    kernel<<<grid, threads, smem, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n_attrs = 0;
  if (kind == LaunchKind::kPdl) {
    attr[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[n_attrs].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[n_attrs].val.clusterDim.y = 1;
    attr[n_attrs++].val.clusterDim.z = 1;
  }
  config.attrs = attr;
  config.numAttrs = n_attrs;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace sage_common
