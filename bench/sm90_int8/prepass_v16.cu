// The pre-pass of the pv_16bit forward variants of the benchmark build (binding_bench.cpp; never
// shipped): 128-key blocks with V written as its 16-bit image (launch.h kPrepassV16Image, prepass.cuh
// quant_v16_block) instead of FP8 V^T, in every pre-pass mode (the benchmark's checks run the variants
// in several). bench::run_prepass (prepass_modes.cu) sends the calls with that bit here; a unit of its
// own, so the benchmark build compiles it beside prepass_modes.cu.
#include "bench_dispatch.h"
#include "prepass.cuh"

namespace sage_sm90::bench {

cudaError_t run_prepass_v16(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  if (p.kv_block != kBlockKV || (p.kernel_mode & kPrepassV16Image) == 0) return cudaErrorInvalidValue;
  return dispatch_prepass<kBlockKV, PrepassV16KernelModes>(p, head_dim, dtype, pdl, stream);
}

}  // namespace sage_sm90::bench
