// Instantiations of the quantization pre-pass (prepass.cuh) and its runtime dispatch.
#include "prepass.cuh"

namespace sage_sm90 {

cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  if (p.kv_block != kBlockKV) return cudaErrorInvalidValue;  // 64-key blocks: bench/sm90_int8/prepass_long.cu
  if (head_dim == 64) {
    return dtype == DType::kF16 ? launch_prepass<64, DType::kF16>(p, pdl, stream)
                                : launch_prepass<64, DType::kBF16>(p, pdl, stream);
  }
  if (head_dim == 128) {
    return dtype == DType::kF16 ? launch_prepass<128, DType::kF16>(p, pdl, stream)
                                : launch_prepass<128, DType::kBF16>(p, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90
