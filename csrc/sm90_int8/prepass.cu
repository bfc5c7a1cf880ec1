// Instantiations of the quantization pre-pass (prepass.cuh) and its runtime dispatch, as shipped:
// 128-key blocks in kPrepassDefaultMode's kernel-side bits only, the one mode the shipped binding
// runs (another p.kernel_mode: cudaErrorInvalidValue). Every mode, and the 64-key blocks, are the
// benchmark build's: bench/sm90_int8/prepass_modes.cu, prepass_long.cu.
#include "prepass.cuh"

namespace sage_sm90 {

cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  using Modes = PrepassShippedKernelModes;
  if (p.kv_block != kBlockKV) return cudaErrorInvalidValue;  // 64-key blocks: bench/sm90_int8/prepass_long.cu
  if (head_dim == 64) {
    return dtype == DType::kF16 ? launch_prepass<64, DType::kF16, kBlockKV, Modes>(p, pdl, stream)
                                : launch_prepass<64, DType::kBF16, kBlockKV, Modes>(p, pdl, stream);
  }
  if (head_dim == 128) {
    return dtype == DType::kF16 ? launch_prepass<128, DType::kF16, kBlockKV, Modes>(p, pdl, stream)
                                : launch_prepass<128, DType::kBF16, kBlockKV, Modes>(p, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90
