// Instantiations of the quantization pre-pass (prepass.cuh) and its runtime dispatch.
#include "prepass.cuh"

namespace sage_sm90 {

namespace {
int g_mode = kPrepassDefaultMode;  // bit set of kPrepass*; benchmarks flip it (set_prepass_mode)
}  // namespace

void set_prepass_mode(int mode) { g_mode = mode; }
int prepass_mode() { return g_mode; }
bool pdl_launches() { return (g_mode & kPrepassPdl) != 0; }

cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, cudaStream_t stream) {
  if (p.kv_block != kBlockKV) {
#if SAGE_SM90_BENCH
    return p.kv_block == 64 ? run_prepass_long(p, head_dim, dtype, stream) : cudaErrorInvalidValue;
#else
    return cudaErrorInvalidValue;  // 64-key K blocks: the long_tile variants of benchmark builds only
#endif
  }
  if (head_dim == 64) {
    return dtype == DType::kF16 ? launch_prepass<64, DType::kF16>(p, stream)
                                : launch_prepass<64, DType::kBF16>(p, stream);
  }
  if (head_dim == 128) {
    return dtype == DType::kF16 ? launch_prepass<128, DType::kF16>(p, stream)
                                : launch_prepass<128, DType::kBF16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90
