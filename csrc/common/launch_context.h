// The one launch convention of the torch bindings: kernels run on the current CUDA stream of the
// device that holds the inputs, with that device current for the call (a guard restores the
// caller's). Host-only (torch's c10/cuda headers); the .cu files receive the cudaStream_t.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace sage_common {

class LaunchContext {
 public:
  explicit LaunchContext(const at::Tensor& on) : guard_(on.device()), stream_(c10::cuda::getCurrentCUDAStream()) {}
  cudaStream_t stream() const { return stream_; }

 private:
  c10::cuda::CUDAGuard guard_;  // before stream_: the current stream is the guarded device's
  cudaStream_t stream_;
};

}  // namespace sage_common
