// Emulated build, EmuGemm::kWgmma (sm_90a only): the same FP4 numerics as
// attention_fwd_emulated.cu, with Q.K^T and P.V on warpgroup MMAs over K / V decoded once per head
// (kv_images_sm90.cuh, attention_fwd_wgmma_sm90.cuh). Format NVFP4/MXFP4 x head dim 64/128 x
// fp16/bf16 = 8 kernels, and the image pre-pass.
#include "attention_fwd.cuh"
#include "attention_fwd_wgmma_sm90.cuh"
#include "kv_images_sm90.cuh"
#include "mma_atoms.cuh"

namespace sage_fp4 {

// kernels/fp4.py decides where this variant can launch from this number (D = 128: the largest).
static_assert(WgmmaConfig<128, Fp4Format::kNvfp4>::kSmemBytes == 208536,
              "update _WGMMA_SMEM_BYTES in sage_diffusers/kernels/fp4.py");
static_assert(WgmmaConfig<128, Fp4Format::kMxfp4>::kSmemBytes <= WgmmaConfig<128, Fp4Format::kNvfp4>::kSmemBytes &&
                  WgmmaConfig<64, Fp4Format::kNvfp4>::kSmemBytes <= WgmmaConfig<128, Fp4Format::kNvfp4>::kSmemBytes &&
                  WgmmaConfig<64, Fp4Format::kMxfp4>::kSmemBytes <= WgmmaConfig<128, Fp4Format::kNvfp4>::kSmemBytes,
              "one number serves every instantiation");

template <class Atom>
struct WgmmaFmtDispatch {
  static cudaError_t run(const FwdParams& p, cudaStream_t stream) { return dispatch_fwd_wgmma_fmt<Atom>(p, stream); }
};

cudaError_t launch_fp4_attention_emulated_wgmma(const FwdParams& p, cudaStream_t stream) {
  if (p.k_img == nullptr || p.v_img == nullptr) return cudaErrorInvalidValue;
  return dispatch_fwd<AtomSm90Emulated, WgmmaFmtDispatch>(p, stream);
}

cudaError_t launch_decode_kv_images(Fp4Format fmt, const uint8_t* kq, const uint8_t* ksf, const uint8_t* vq,
                                    const uint8_t* vsf, void* k_img, void* v_img, int BH, int skv_pad, int D,
                                    cudaStream_t stream) {
  switch (fmt) {
    case Fp4Format::kNvfp4:
      return launch_decode_kv_images_fmt<Fp4Format::kNvfp4>(kq, ksf, vq, vsf, k_img, v_img, BH, skv_pad, D, stream);
    case Fp4Format::kMxfp4:
      return launch_decode_kv_images_fmt<Fp4Format::kMxfp4>(kq, ksf, vq, vsf, k_img, v_img, BH, skv_pad, D, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_fp4
