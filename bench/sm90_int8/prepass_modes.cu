// The benchmark build's pre-pass (never shipped): 128-key blocks in every pre-pass mode (prepass.cuh
// PrepassAllKernelModes; the shipped prepass.cu compiles kPrepassDefaultMode's only), so
// set_prepass_mode can pick any mode per call; 64-key blocks (the long_tile variants) go to
// prepass_long.cu, the 16-bit V image (the pv_16bit variants, kPrepassV16Image) to prepass_v16.cu.
// The same template code as the shipped pre-pass: its default-mode kernels are the shipped ones
// (bench/sass_diff.py: identical SASS).
#include "bench_dispatch.h"
#include "prepass.cuh"

namespace sage_sm90::bench {

cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  if (p.kv_block == 64) return run_prepass_long(p, head_dim, dtype, pdl, stream);
  if (p.kernel_mode & kPrepassV16Image) return run_prepass_v16(p, head_dim, dtype, pdl, stream);
  if (p.kv_block != kBlockKV) return cudaErrorInvalidValue;
  return dispatch_prepass<kBlockKV, PrepassAllKernelModes>(p, head_dim, dtype, pdl, stream);
}

}  // namespace sage_sm90::bench
