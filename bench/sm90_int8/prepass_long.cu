// The pre-pass with 64-key K blocks (prepass.cuh kKB = 64) for the long_tile forward variants of the
// benchmark build (binding_bench.cpp; never shipped): head dim 128, the variants' only, in every
// pre-pass mode (the benchmark's checks run the variants in several). bench::run_prepass
// (prepass_modes.cu) sends 64-key blocks here.
#include "bench_dispatch.h"
#include "prepass.cuh"

namespace sage_sm90::bench {

cudaError_t run_prepass_long(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream) {
  using Modes = PrepassAllKernelModes;
  if (head_dim != 128 || p.kv_block != 64) return cudaErrorInvalidValue;
  return dtype == DType::kF16 ? launch_prepass<128, DType::kF16, 64, Modes>(p, pdl, stream)
                              : launch_prepass<128, DType::kBF16, 64, Modes>(p, pdl, stream);
}

}  // namespace sage_sm90::bench
