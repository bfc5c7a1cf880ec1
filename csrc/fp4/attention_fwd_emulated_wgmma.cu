// Emulated build, EmuGemm::kWgmma (sm_90a only): the same FP4 numerics as
// attention_fwd_emulated.cu, with Q.K^T and P.V on warpgroup MMAs over K / V decoded once per
// CTA (mainloop_wgmma_sm90.cuh). Format NVFP4/MXFP4 x head dim 64/128 x fp16/bf16 = 8 kernels.
#include "mainloop_wgmma_sm90.cuh"
#include "attention_fwd.cuh"
#include "mma_atoms.cuh"

namespace sage_fp4 {

// kernels/fp4.py decides where this variant can launch from this number (D = 128, NVFP4: the
// largest instantiation).
static_assert(FwdConfig<128, Fp4Format::kNvfp4>::kWgmmaSmemBytes == 204800,
              "update _WGMMA_SMEM_BYTES in sage_diffusers/kernels/fp4.py");
static_assert(FwdConfig<128, Fp4Format::kMxfp4>::kWgmmaSmemBytes <= FwdConfig<128, Fp4Format::kNvfp4>::kWgmmaSmemBytes &&
                  FwdConfig<64, Fp4Format::kNvfp4>::kWgmmaSmemBytes <= FwdConfig<128, Fp4Format::kNvfp4>::kWgmmaSmemBytes &&
                  FwdConfig<64, Fp4Format::kMxfp4>::kWgmmaSmemBytes <= FwdConfig<128, Fp4Format::kNvfp4>::kWgmmaSmemBytes,
              "one number serves every instantiation");

cudaError_t launch_fp4_attention_emulated_wgmma(const FwdParams& p, cudaStream_t stream) {
  return dispatch_fwd<AtomSm90Emulated, EmuGemm::kWgmma>(p, stream);
}

}  // namespace sage_fp4
