// Emulated build (sm_90a; also buildable for sm_120a to cross-check the native atom): FP4
// fragments decoded to fp16 (NVFP4) or bf16 (MXFP4) and multiplied with mma.sync m16n8k16, same
// kernel source.
#include "atom_gemm.cuh"
#include "attention_fwd.cuh"
#include "mma_atoms.cuh"

namespace sage_fp4 {

// kernels/fp4.py decides where this build's attention kernel can launch from this number.
// (The double-buffered staging variant, SAGE_FP4_OPT bit 4, adds one more decoded tile.)
static_assert(FwdConfig<128, Fp4Format::kNvfp4>::smem_bytes<AtomSm90Emulated<Fp4Format::kNvfp4>>() ==
                  (kOptPipelinedStaging ? 141344 + 65536 : 141344),
              "update _EMULATED_SMEM_BYTES in sage_diffusers/kernels/fp4.py");
// MXFP4 stores half as many scale bytes and stages same-size (bf16) fragments: it fits wherever
// NVFP4 does, so one number serves both formats. Every instantiation within sm_90's 227 KiB:
static_assert(FwdConfig<128, Fp4Format::kMxfp4>::smem_bytes<AtomSm90Emulated<Fp4Format::kMxfp4>>() <=
                  FwdConfig<128, Fp4Format::kNvfp4>::smem_bytes<AtomSm90Emulated<Fp4Format::kNvfp4>>(),
              "MXFP4 must not need more shared memory than NVFP4");
static_assert(FwdConfig<64, Fp4Format::kNvfp4>::smem_bytes<AtomSm90Emulated<Fp4Format::kNvfp4>>() <= 227 * 1024 &&
                  FwdConfig<128, Fp4Format::kNvfp4>::smem_bytes<AtomSm90Emulated<Fp4Format::kNvfp4>>() <= 227 * 1024 &&
                  FwdConfig<64, Fp4Format::kMxfp4>::smem_bytes<AtomSm90Emulated<Fp4Format::kMxfp4>>() <= 227 * 1024,
              "shared memory budget of sm_90");

cudaError_t launch_fp4_attention_emulated(const FwdParams& p, cudaStream_t stream) {
  return dispatch_fwd<AtomSm90Emulated>(p, stream);
}

cudaError_t launch_mma_atom_gemm_emulated(Fp4Format fmt, const uint8_t* a, const uint8_t* sfa, const uint8_t* b,
                                      const uint8_t* sfb, float* d, int M, int N, int K, cudaStream_t stream) {
  return launch_atom_gemm<AtomSm90Emulated>(fmt, a, sfa, b, sfb, d, M, N, K, stream);
}

}  // namespace sage_fp4
