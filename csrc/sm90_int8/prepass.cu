// Instantiations of the quantization pre-pass (prepass.cuh) and its runtime dispatch, as shipped:
// 128-key blocks in kPrepassDefaultMode's kernel-side bits only, the one mode the shipped binding
// runs, with V's FP8 image (the fast policy) or its 16-bit image (kPrepassV16Image: the accurate
// policy); another p.kernel_mode: cudaErrorInvalidValue. Every mode, and the 64-key blocks, are the
// benchmark build's: bench/sm90_int8/prepass_modes.cu, prepass_long.cu, prepass_v16.cu.
#include "prepass.cuh"

namespace sage_sm90 {

cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  if (p.kv_block != kBlockKV) return cudaErrorInvalidValue;  // 64-key blocks: bench/sm90_int8/prepass_long.cu
  if (p.kernel_mode & kPrepassV16Image) {
    return dispatch_prepass<kBlockKV, PrepassShippedV16KernelModes>(p, head_dim, dtype, pdl, stream);
  }
  return dispatch_prepass<kBlockKV, PrepassShippedKernelModes>(p, head_dim, dtype, pdl, stream);
}

}  // namespace sage_sm90
