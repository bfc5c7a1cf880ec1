// Native build (sm_120a / sm_121a): the block-scaled FP4 atom (NVFP4, MXFP4 x head dims 64, 128 x
// fp16, bf16). The MXFP4 instantiations (scale_vec::2X ue8m0) compile but have not run on hardware.
// Every instantiation fits sm_120's ~99 KiB (static_assert in FwdConfig).
#include "atom_gemm.cuh"
#include "attention_fwd.cuh"
#include "mma_atoms.cuh"

namespace sage_fp4 {

cudaError_t launch_fp4_attention_native(const FwdParams& p, cudaStream_t stream) {
  return dispatch_fwd<AtomSm120>(p, stream);
}

cudaError_t launch_mma_atom_gemm_native(Fp4Format fmt, const uint8_t* a, const uint8_t* sfa, const uint8_t* b,
                                       const uint8_t* sfb, float* d, int M, int N, int K, cudaStream_t stream) {
  return launch_atom_gemm<AtomSm120>(fmt, a, sfa, b, sfb, d, M, N, K, stream);
}

}  // namespace sage_fp4
