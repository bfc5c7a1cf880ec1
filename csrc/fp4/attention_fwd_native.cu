// Native build (sm_120a / sm_121a): the block-scaled FP4 atom (head dims 64, 128 x fp16, bf16).
#include "atom_gemm.cuh"
#include "attention_fwd.cuh"
#include "mma_atoms.cuh"

namespace sage_fp4 {

cudaError_t launch_fp4_attention_native(const FwdParams& p, cudaStream_t stream) {
  return dispatch_fwd<AtomSm120>(p, stream);
}

cudaError_t launch_mma_atom_gemm_native(const uint8_t* a, const uint8_t* sfa, const uint8_t* b, const uint8_t* sfb,
                                       float* d, int M, int N, int K, cudaStream_t stream) {
  return launch_atom_gemm<AtomSm120>(a, sfa, b, sfb, d, M, N, K, stream);
}

}  // namespace sage_fp4
