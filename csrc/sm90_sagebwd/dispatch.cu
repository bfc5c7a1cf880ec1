// Call (head dim, dtype) -> the shipped kernels' instantiation (hd64.cu, hd128.cu).
#include "api.h"
#include "launch.cuh"

namespace sagebwd_sm90 {

cudaError_t run_dkdv(const Params& p, int batch, int head_dim, bool bf16, bool dv_in_place, cudaStream_t stream) {
  using bf = cute::bfloat16_t;
  using hf = cute::half_t;
  switch (head_dim) {
    case 64:
      return bf16 ? launch_shipped_dkdv<64, bf>(p, batch, dv_in_place, stream)
                  : launch_shipped_dkdv<64, hf>(p, batch, dv_in_place, stream);
    case 128:
      return bf16 ? launch_shipped_dkdv<128, bf>(p, batch, dv_in_place, stream)
                  : launch_shipped_dkdv<128, hf>(p, batch, dv_in_place, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t run_dq(const DqParams& p, int batch, int head_dim, bool bf16, cudaStream_t stream) {
  using bf = cute::bfloat16_t;
  using hf = cute::half_t;
  switch (head_dim) {
    case 64: return bf16 ? launch_shipped_dq<64, bf>(p, batch, stream) : launch_shipped_dq<64, hf>(p, batch, stream);
    case 128: return bf16 ? launch_shipped_dq<128, bf>(p, batch, stream) : launch_shipped_dq<128, hf>(p, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sagebwd_sm90
