// The pre-pass with 64-key K blocks (prepass.cuh kKB = 64) for the long_tile forward variants of
// benchmark builds (-DSAGE_SM90_BENCH=1; sage_diffusers/kernels/int8_sm90.py lists this file only
// there): head dim 128, the variants' only, in every pre-pass mode (the benchmark's checks run the
// variants in several). A file of its own, so it compiles beside prepass.cu.
#include "prepass.cuh"

namespace sage_sm90 {

cudaError_t run_prepass_long(const PrepassParams& p, int head_dim, DType dtype, cudaStream_t stream) {
  if (head_dim != 128 || p.kv_block != 64) return cudaErrorInvalidValue;
  return dtype == DType::kF16 ? launch_prepass<128, DType::kF16, 64>(p, stream)
                              : launch_prepass<128, DType::kBF16, 64>(p, stream);
}

}  // namespace sage_sm90
