// Torch binding of the FP4 kernels: shape/dtype checks, allocation, launch on the current stream of
// the inputs' device (common/launch_context.h, the convention of every binding).
// Built for exactly one atom (SAGE_FP4_NATIVE = 1 native sm_120a, 0 emulated); see kernels/fp4.py.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <utility>

#include "../common/launch_context.h"
#include "../common/token_stats.h"
#include "fp4_api.h"

#ifndef SAGE_FP4_NATIVE
#error "define SAGE_FP4_NATIVE (1: native sm_120a atom, 0: emulated atom)"
#endif
// 1: the emulated build also holds the EmuGemm::kWgmma kernels (attention_fwd_emulated_wgmma.cu,
// sm_90a builds only).
#ifndef SAGE_FP4_WGMMA
#define SAGE_FP4_WGMMA 0
#endif

namespace {

using sage_fp4::ElemType;
using sage_fp4::Fp4Format;

Fp4Format fp4_format(int64_t code) {
  TORCH_CHECK(code == 0 || code == 1, "fmt: 0 NVFP4, 1 MXFP4, got ", code);
  return static_cast<Fp4Format>(code);
}

#define FP4_CHECK_CUDA(expr)                                                              \
  do {                                                                                    \
    const cudaError_t err_ = (expr);                                                      \
    TORCH_CHECK(err_ == cudaSuccess, #expr " failed: ", cudaGetErrorString(err_));        \
  } while (0)

ElemType elem_type(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kBFloat16,
              "expected float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == torch::kHalf ? ElemType::kFloat16 : ElemType::kBFloat16;
}

void check_bhsd_16b(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4, name, ": expected a 4-D CUDA tensor (B, H, S, D)");
  TORCH_CHECK(t.stride(3) == 1, name, ": last dim must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
                  t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0,
              name, ": rows must be 16-byte aligned");
}

// Every tensor a launch reads must live on the device it launches on (the inputs'): a pointer into
// another GPU's memory is an illegal access there, or a silent peer read.
void check_device(const torch::Tensor& t, const torch::Device& device, const char* name) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", the launch on ", device);
}

void check_f32(const torch::Tensor& t, torch::IntArrayRef sizes, const char* name, const torch::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.sizes() == sizes, name,
              ": expected a contiguous float32 CUDA tensor of shape ", sizes, ", got ", t.scalar_type(), " ",
              t.sizes());
  check_device(t, device, name);
}

const uint8_t* key_mask_ptr(const c10::optional<torch::Tensor>& key_mask, int64_t B, int64_t skv,
                            const torch::Device& device) {
  if (!key_mask.has_value()) return nullptr;
  const auto& m = *key_mask;
  TORCH_CHECK(m.scalar_type() == torch::kBool && m.is_contiguous() && m.dim() == 2 && m.size(0) == B && m.size(1) == skv,
              "key_mask: contiguous bool (B, Skv)");
  check_device(m, device, "key_mask");
  return reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
}

// k, v: (B, Hkv, Skv, D), D 64 or 128; key_mask bool (B, Skv) or None. Returns k_mean, v_amax:
// float32 (B, Hkv, D), K's token mean and V's finite absmax over the attended keys (fp4_api.h).
std::vector<torch::Tensor> kv_stats(const torch::Tensor& k, const torch::Tensor& v,
                                    const c10::optional<torch::Tensor>& key_mask) {
  check_bhsd_16b(k, "k");
  check_bhsd_16b(v, "v");
  const sage_common::LaunchContext ctx(k);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(), "v: shape and dtype of k");
  check_device(v, k.device(), "v");
  const auto B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3);
  TORCH_CHECK(D == 64 || D == 128, "kv_stats: head dims 64 and 128, got ", D);
  TORCH_CHECK(S >= 1 && S < (int64_t(1) << 30), "kv_stats: 1 <= Skv < 2^30, got ", S);
  const auto split = sage_common::stats_split(B * H, S);
  const auto f32 = k.options().dtype(torch::kFloat32), i32 = k.options().dtype(torch::kInt32);
  auto k_mean = torch::empty({B, H, D}, f32);
  auto v_amax = torch::empty({B, H, D}, f32);
  auto partial = torch::empty({B * H, split.n_split, 2, D}, f32);
  auto split_count = torch::empty({B * H, split.n_split}, i32);
  auto counter = torch::zeros({B * H}, i32);
  sage_fp4::KvStatsParams p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_ss = k.stride(2);
  p.v_sb = v.stride(0); p.v_sh = v.stride(1); p.v_ss = v.stride(2);
  p.key_mask = key_mask_ptr(key_mask, B, S, k.device());
  p.B = B; p.Hkv = H; p.Skv = S; p.D = D;
  p.n_split = static_cast<int>(split.n_split);
  p.split_len = static_cast<int>(split.split_len);
  p.partial = partial.data_ptr<float>();
  p.split_count = split_count.data_ptr<int>();
  p.counter = counter.data_ptr<int>();
  p.k_mean = k_mean.data_ptr<float>();
  p.v_amax = v_amax.data_ptr<float>();
  FP4_CHECK_CUDA(sage_fp4::launch_kv_stats(p, elem_type(k), ctx.stream()));
  return {k_mean, v_amax};
}

// k, v: (B, Hkv, Skv, D); k_mean float32 (B, Hkv, D) (over attended keys); k_scale, v_scale float32
// (B, Hkv) tensor scales; key_mask bool (B, Skv) or None (masked keys become zero rows); fmt 0
// NVFP4, 1 MXFP4. Returns kq, ksf, vq, vsf, v_first (see fp4_api.h).
std::vector<torch::Tensor> quantize_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_mean,
                                       const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                                       const c10::optional<torch::Tensor>& key_mask, int64_t skv_pad,
                                       int64_t fmt_code) {
  const Fp4Format fmt = fp4_format(fmt_code);
  const int64_t blk = sage_fp4::fp4_block(fmt);
  check_bhsd_16b(k, "k");
  const sage_common::LaunchContext ctx(k);
  TORCH_CHECK(v.is_cuda() && v.dim() == 4 && v.stride(3) == 1 && v.sizes() == k.sizes(), "v: shape of k, last dim contiguous");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v dtypes differ");
  check_device(v, k.device(), "v");
  const auto B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3);
  TORCH_CHECK(D % blk == 0, "head dim must be a multiple of ", blk, ", got ", D);
  TORCH_CHECK(skv_pad % 128 == 0 && skv_pad >= S, "skv_pad must be a multiple of 128 >= Skv");
  check_f32(k_mean, {B, H, D}, "k_mean", k.device());
  check_f32(k_scale, {B, H}, "k_scale", k.device());
  check_f32(v_scale, {B, H}, "v_scale", k.device());
  const uint8_t* mask = key_mask_ptr(key_mask, B, S, k.device());
  auto u8 = k.options().dtype(torch::kUInt8);
  auto kq = torch::empty({B, H, skv_pad, D / 2}, u8);
  auto ksf = torch::empty({B, H, skv_pad, D / blk}, u8);
  auto vq = torch::empty({B, H, D, skv_pad / 2}, u8);
  auto vsf = torch::empty({B, H, D, skv_pad / blk}, u8);
  auto v_first = torch::full({B, H, static_cast<int64_t>(sage_fp4::NonFinite::kCount), D}, sage_fp4::kNoKey,
                             k.options().dtype(torch::kInt32));
  const cudaStream_t stream = ctx.stream();
  const ElemType dt = elem_type(k);
  FP4_CHECK_CUDA(sage_fp4::launch_quantize_k(k.data_ptr(), dt, fmt, k.stride(0), k.stride(1), k.stride(2),
                                             k_mean.data_ptr<float>(), k_scale.data_ptr<float>(), mask,
                                             kq.data_ptr<uint8_t>(), ksf.data_ptr<uint8_t>(), B, H, S, skv_pad, D,
                                             stream));
  FP4_CHECK_CUDA(sage_fp4::launch_quantize_v(v.data_ptr(), dt, fmt, v.stride(0), v.stride(1), v.stride(2),
                                             v_scale.data_ptr<float>(), mask, vq.data_ptr<uint8_t>(),
                                             vsf.data_ptr<uint8_t>(), v_first.data_ptr<int>(), B, H, S, skv_pad, D,
                                             stream));
  return {kq, ksf, vq, vsf, v_first};
}

// q: (B, Hq, Sq, D) view; pre-pass outputs for (B, Hkv, ...) including v_first int32 (B, Hkv, 3, D);
// the float32 tensor scales q_scale (B, Hq), k_scale / v_scale (B, Hkv) (fp4_api.h). Returns out
// (like q) and lse (or empty).
std::vector<torch::Tensor> attention_fwd(const torch::Tensor& q, const torch::Tensor& kq, const torch::Tensor& ksf,
                                         const torch::Tensor& vq, const torch::Tensor& vsf, const torch::Tensor& k_mean,
                                         const torch::Tensor& q_scale, const torch::Tensor& k_scale,
                                         const torch::Tensor& v_scale, const torch::Tensor& v_first,
                                         const c10::optional<torch::Tensor>& key_mask, int64_t skv, double scale,
                                         bool causal, int64_t p_quant, int64_t fmt_code, bool return_lse,
                                         int64_t emu_gemm) {
  const Fp4Format fmt = fp4_format(fmt_code);
  const int64_t blk = sage_fp4::fp4_block(fmt);
  check_bhsd_16b(q, "q");
  const sage_common::LaunchContext ctx(q);
  const auto B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128, "FP4 kernel head dims are 64 and 128, got ", D);
  TORCH_CHECK(kq.dim() == 4 && kq.size(0) == B && kq.size(3) == D / 2 && kq.is_contiguous(), "kq shape");
  const auto Hkv = kq.size(1), skv_pad = kq.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(skv >= 1 && skv <= skv_pad && skv_pad % 128 == 0, "Skv / padding mismatch");
  TORCH_CHECK(ksf.is_contiguous() && vq.is_contiguous() && vsf.is_contiguous() && k_mean.is_contiguous(), "contiguity");
  TORCH_CHECK(ksf.dim() == 4 && ksf.size(2) == skv_pad && ksf.size(3) == D / blk && vsf.dim() == 4 &&
                  vsf.size(2) == D && vsf.size(3) == skv_pad / blk,
              "ksf / vsf shapes do not match fmt (scale per ", blk, " elements)");
  TORCH_CHECK(p_quant == 0 || p_quant == 1, "p_quant: 0 two-level, 1 direct");
  // EmuGemm (fp4_api.h): 0 mma.sync, 1 wgmma (emulated build only).
  TORCH_CHECK(emu_gemm == 0 || (emu_gemm == 1 && SAGE_FP4_WGMMA),
              "emu_gemm: 0 mma.sync, 1 wgmma (emulated atom on sm_90a only), got ", emu_gemm);
  for (const auto& [t, name] : {std::pair<const torch::Tensor*, const char*>{&kq, "kq"}, {&ksf, "ksf"}, {&vq, "vq"},
                                 {&vsf, "vsf"}, {&v_first, "v_first"}}) {
    check_device(*t, q.device(), name);
  }
  const uint8_t* mask_ptr = key_mask_ptr(key_mask, B, skv, q.device());
  check_f32(k_mean, {B, Hkv, D}, "k_mean", q.device());
  check_f32(q_scale, {B, Hq}, "q_scale", q.device());
  check_f32(k_scale, {B, Hkv}, "k_scale", q.device());
  check_f32(v_scale, {B, Hkv}, "v_scale", q.device());
  TORCH_CHECK(v_first.is_cuda() && v_first.scalar_type() == torch::kInt32 && v_first.is_contiguous() &&
                  v_first.sizes() == torch::IntArrayRef({B, Hkv, static_cast<int64_t>(sage_fp4::NonFinite::kCount), D}),
              "v_first: contiguous int32 (B, Hkv, 3, D) from quantize_kv");
  auto out = torch::empty_like(q);  // same memory layout as q: BSHD callers get a free transpose back
  TORCH_CHECK(out.stride(3) == 1, "output layout");
  torch::Tensor lse;
  if (return_lse) lse = torch::empty({B, Hq, Sq}, q.options().dtype(torch::kFloat32));

  sage_fp4::FwdParams p{};
  p.q = q.data_ptr();
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_ss = q.stride(2);
  p.kq = kq.data_ptr<uint8_t>(); p.ksf = ksf.data_ptr<uint8_t>();
  p.vq = vq.data_ptr<uint8_t>(); p.vsf = vsf.data_ptr<uint8_t>();
  p.k_mean = k_mean.data_ptr<float>();
  p.q_scale = q_scale.data_ptr<float>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.v_first = v_first.data_ptr<int>();
  p.key_mask = mask_ptr;
  p.o = out.data_ptr();
  p.o_sb = out.stride(0); p.o_sh = out.stride(1); p.o_ss = out.stride(2);
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  p.B = B; p.Hq = Hq; p.Hkv = Hkv; p.Sq = Sq; p.Skv = skv; p.skv_pad = skv_pad; p.D = D;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.p_quant = static_cast<sage_fp4::PQuantMode>(p_quant);
  p.dtype = elem_type(q);
  p.fmt = fmt;
  const cudaStream_t stream = ctx.stream();
#if SAGE_FP4_NATIVE
  FP4_CHECK_CUDA(sage_fp4::launch_fp4_attention_native(p, stream));
#else
#if SAGE_FP4_WGMMA
  if (emu_gemm == 1) {
    // K / V^T decoded once per kv head into the tiles' 16-bit shared-memory images (fp16 for
    // NVFP4, bf16 for MXFP4: 2 bytes either way); 2 * B * Hkv * skv_pad * D * 2 bytes, freed on return.
    const auto n_img = sage_fp4::kv_image_elems(B * Hkv, skv_pad, D);
    auto k_img = torch::empty({n_img}, q.options().dtype(torch::kInt16));
    auto v_img = torch::empty({n_img}, q.options().dtype(torch::kInt16));
    FP4_CHECK_CUDA(sage_fp4::launch_decode_kv_images(fmt, p.kq, p.ksf, p.vq, p.vsf, k_img.data_ptr(), v_img.data_ptr(),
                                                     static_cast<int>(B * Hkv), static_cast<int>(skv_pad),
                                                     static_cast<int>(D), stream));
    p.k_img = k_img.data_ptr();
    p.v_img = v_img.data_ptr();
    FP4_CHECK_CUDA(sage_fp4::launch_fp4_attention_emulated_wgmma(p, stream));
  } else {
    FP4_CHECK_CUDA(sage_fp4::launch_fp4_attention_emulated(p, stream));
  }
#else
  FP4_CHECK_CUDA(sage_fp4::launch_fp4_attention_emulated(p, stream));
#endif
#endif
  return {out, return_lse ? lse : torch::Tensor()};
}

// Test GEMM of the MMA atom: a (M, K/2) uint8, sfa (M, K/blk) uint8, b (N, K/2), sfb (N, K/blk) -> (M, N) fp32.
torch::Tensor atom_gemm(const torch::Tensor& a, const torch::Tensor& sfa, const torch::Tensor& b, const torch::Tensor& sfb,
                        int64_t fmt_code) {
  const Fp4Format fmt = fp4_format(fmt_code);
  const int64_t blk = sage_fp4::fp4_block(fmt);
  for (const auto* t : {&a, &sfa, &b, &sfb})
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->scalar_type() == torch::kUInt8 && t->dim() == 2, "uint8 2-D contiguous");
  const sage_common::LaunchContext ctx(a);
  const auto M = a.size(0), N = b.size(0), K = a.size(1) * 2;
  TORCH_CHECK(b.size(1) * 2 == K && sfa.size(0) == M && sfb.size(0) == N && sfa.size(1) == K / blk &&
                  sfb.size(1) == K / blk,
              "atom_gemm shapes");
  auto d = torch::empty({M, N}, a.options().dtype(torch::kFloat32));
  const cudaStream_t stream = ctx.stream();
#if SAGE_FP4_NATIVE
  FP4_CHECK_CUDA(sage_fp4::launch_mma_atom_gemm_native(fmt, a.data_ptr<uint8_t>(), sfa.data_ptr<uint8_t>(), b.data_ptr<uint8_t>(),
                                                      sfb.data_ptr<uint8_t>(), d.data_ptr<float>(), M, N, K, stream));
#else
  FP4_CHECK_CUDA(sage_fp4::launch_mma_atom_gemm_emulated(fmt, a.data_ptr<uint8_t>(), sfa.data_ptr<uint8_t>(), b.data_ptr<uint8_t>(),
                                                     sfb.data_ptr<uint8_t>(), d.data_ptr<float>(), M, N, K, stream));
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sage_diffusers FP4 microscaling attention kernels";
  m.attr("native") = bool(SAGE_FP4_NATIVE);
  m.attr("wgmma") = bool(SAGE_FP4_WGMMA);
  m.def("kv_stats", &kv_stats, "K token mean and V finite absmax over attended keys");
  m.def("quantize_kv", &quantize_kv, "K/V quantization pre-pass");
  m.def("attention_fwd", &attention_fwd, "FP4 attention forward");
  m.def("atom_gemm", &atom_gemm, "MMA atom test GEMM");
}
