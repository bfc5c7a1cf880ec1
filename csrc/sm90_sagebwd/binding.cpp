// Torch binding of SageBwd's sm_90a backward kernels as shipped (launch.cuh ShippedPolicy): dK/dV and
// dQ over the operand images the Triton image pre-pass writes (sage_diffusers/kernels/sagebwd_sm90.py).
// Each call checks its tensors and launches on the current stream of their device; no state.
#include <torch/extension.h>

#include "../common/launch_context.h"
#include "api.h"

namespace {

using namespace sagebwd_sm90;

// t: a contiguous tensor of `dtype` and `numel` elements on `device`.
void expect(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel, const at::Device& device) {
  TORCH_CHECK(t.device() == device && t.is_contiguous(), name, ": a contiguous tensor on ", device, ", got ",
              t.device(), t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.numel() == numel, name, ": expected ", numel, " elements, got ", t.numel());
}

// api.h Visibility without the dQ kernel's block list, from key_bits: empty (every key visible) or
// (B, Skv / 64) int64 words, bit k of word j for key 64 j + k.
Visibility visibility(const at::Tensor& key_bits, bool causal, int64_t batch, int64_t skv, const at::Device& device) {
  Visibility vis{nullptr, nullptr, causal ? 1 : 0};
  if (key_bits.numel() > 0) {
    expect(key_bits, "key_bits", at::kLong, batch * (skv / kKeysPerWG), device);
    vis.key_bits = reinterpret_cast<const uint64_t*>(key_bits.data_ptr<int64_t>());
  }
  return vis;
}

// dk, dv (B, Hkv, Skv, D) float32 outputs; images (uint8): k, v (B, Hkv, Skv / 64 tiles of 64 x D 16-bit),
// q, dO (B, H, Sq / 64 tiles), qt, dot (B, H, Sq / 64 INT8 tiles of D x 64) with H a multiple of Hkv
// (GQA); vec (B, H, Sq / 64, kVecFloats);
// dv_channel_scale: empty (dV scaled per query block by vec's factor), or (B, H, D) float32, P~'s 1/127
// times each channel's dO' scale, dot's codes per channel: dV in place (bf16, Sq <= kDvInPlaceMaxQueries);
// key_bits, causal: visibility() (a key mask's words, or empty).
void dkdv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q, const at::Tensor& dO, const at::Tensor& qt,
          const at::Tensor& dot, const at::Tensor& vec, const at::Tensor& dv_channel_scale, const at::Tensor& key_bits,
          bool causal, const at::Tensor& dk, const at::Tensor& dv, bool bf16, double qk_scale, double sm_scale) {
  TORCH_CHECK(dk.is_cuda() && dk.dim() == 4, "dk: a (B, Hkv, Skv, D) CUDA tensor");
  const int64_t batch = dk.size(0), heads = dk.size(1), skv = dk.size(2), d = dk.size(3);
  TORCH_CHECK(d == 64 || d == 128, "head dim 64 or 128, got ", d);
  TORCH_CHECK(heads > 0 && vec.dim() == 4 && vec.size(0) == batch && vec.size(1) % heads == 0 &&
                  vec.size(3) == kVecFloats,
              "vec: (", batch, ", a multiple of ", heads, " query heads, Sq / ", kBlockM, ", ", kVecFloats, "), got ",
              vec.sizes());
  const int64_t sq = vec.size(2) * kBlockM, hq = vec.size(1), group = hq / heads;
  TORCH_CHECK(skv % kBlockN == 0 && skv > 0 && sq > 0, "Skv a positive multiple of ", kBlockN, ", got ", skv);
  const auto dev = dk.device();
  const auto u8 = at::kByte;
  expect(dk, "dk", at::kFloat, batch * heads * skv * d, dev);
  expect(dv, "dv", at::kFloat, dk.numel(), dev);
  expect(vec, "vec", at::kFloat, batch * hq * (sq / kBlockM) * kVecFloats, dev);
  expect(k, "k image", u8, batch * heads * skv * d * 2, dev);
  expect(v, "v image", u8, k.numel(), dev);
  expect(q, "q image", u8, batch * hq * sq * d * 2, dev);
  expect(dO, "dO image", u8, q.numel(), dev);
  expect(qt, "q^T image", u8, batch * hq * sq * d, dev);
  expect(dot, "dO'^T image", u8, qt.numel(), dev);
  const bool in_place = dv_channel_scale.numel() > 0;
  if (in_place) {
    expect(dv_channel_scale, "dv_channel_scale", at::kFloat, batch * heads * d, dev);
    TORCH_CHECK(bf16 && sq <= kDvInPlaceMaxQueries && group == 1, "dV in place: bf16 operands, Sq <= ",
                kDvInPlaceMaxQueries, " and no GQA, got ", bf16 ? "bf16" : "fp16", ", ", sq, " and ", group,
                " query heads per KV head");
  }
  Params p{k.data_ptr<uint8_t>(), v.data_ptr<uint8_t>(), q.data_ptr<uint8_t>(), dO.data_ptr<uint8_t>(),
           qt.data_ptr<uint8_t>(), dot.data_ptr<uint8_t>(), vec.data_ptr<float>(), dk.data_ptr<float>(),
           dv.data_ptr<float>(), in_place ? dv_channel_scale.data_ptr<float>() : nullptr, static_cast<int>(heads),
           static_cast<int>(sq), static_cast<int>(skv),
           static_cast<float>(qk_scale), static_cast<float>(sm_scale),
           visibility(key_bits, causal, batch, skv, dev), static_cast<int>(group)};
  const sage_common::LaunchContext ctx(dk);
  const cudaError_t err = run_dkdv(p, static_cast<int>(batch), static_cast<int>(d), bf16, in_place, ctx.stream());
  TORCH_CHECK(err == cudaSuccess, "SageBwd sm90 dK/dV launch: ", cudaGetErrorString(err));
}

// dq (B, H, Sq, D) float32 output; images (uint8): q, dO (B, H, Sq / 64 tiles of 64 x D 16-bit), k, v
// (B, Hkv, Skv / 64 tiles), kt (B, Hkv, Skv / 64 INT8 tiles of D x 64); k_scale (B, Hkv, Skv / 64,
// kKScaleFloats), H a multiple of Hkv (GQA);
// m, inv_l, delta (B, H, Sq) float32; key_blocks: empty (every key block) or (B, Skv / 64) int32, the blocks
// with a visible key ascending, then Skv / 64; causal: top-left. k_scale's entries carry each block's
// index and visibility word (api.h kKScale*).
void dq(const at::Tensor& q, const at::Tensor& dO, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kt,
        const at::Tensor& k_scale, const at::Tensor& m, const at::Tensor& inv_l, const at::Tensor& delta,
        const at::Tensor& key_blocks, bool causal, const at::Tensor& dq, bool bf16,
        double qk_scale, double sm_scale) {
  TORCH_CHECK(dq.is_cuda() && dq.dim() == 4, "dq: a (B, H, Sq, D) CUDA tensor");
  const int64_t batch = dq.size(0), heads = dq.size(1), sq = dq.size(2), d = dq.size(3);
  TORCH_CHECK(d == 64 || d == 128, "head dim 64 or 128, got ", d);
  TORCH_CHECK(k_scale.dim() == 4 && k_scale.size(0) == batch && k_scale.size(1) > 0 && heads % k_scale.size(1) == 0 &&
                  k_scale.size(3) == kKScaleFloats,
              "k_scale: (", batch, ", KV heads dividing ", heads, ", Skv / ", kKeysPerWG, ", ", kKScaleFloats, "), got ",
              k_scale.sizes());
  const int64_t skv = k_scale.size(2) * kKeysPerWG, hkv = k_scale.size(1);
  TORCH_CHECK(sq % kBlockN == 0 && sq > 0 && skv > 0, "Sq a positive multiple of ", kBlockN, ", got ", sq);
  const auto dev = dq.device();
  const auto u8 = at::kByte;
  expect(dq, "dq", at::kFloat, batch * heads * sq * d, dev);
  expect(k_scale, "k_scale", at::kFloat, batch * hkv * (skv / kKeysPerWG) * kKScaleFloats, dev);
  for (const auto* t : {&m, &inv_l, &delta}) expect(*t, "m / inv_l / delta", at::kFloat, batch * heads * sq, dev);
  expect(q, "q image", u8, batch * heads * sq * d * 2, dev);
  expect(dO, "dO image", u8, q.numel(), dev);
  expect(k, "k image", u8, batch * hkv * skv * d * 2, dev);
  expect(v, "v image", u8, k.numel(), dev);
  expect(kt, "k^T image", u8, batch * hkv * skv * d, dev);
  DqParams p{q.data_ptr<uint8_t>(), dO.data_ptr<uint8_t>(), k.data_ptr<uint8_t>(), v.data_ptr<uint8_t>(),
             kt.data_ptr<uint8_t>(), k_scale.data_ptr<float>(), m.data_ptr<float>(), inv_l.data_ptr<float>(),
             delta.data_ptr<float>(), dq.data_ptr<float>(), static_cast<int>(heads), static_cast<int>(sq),
             static_cast<int>(skv), static_cast<float>(qk_scale), static_cast<float>(sm_scale),
             Visibility{nullptr, nullptr, causal ? 1 : 0}, static_cast<int>(heads / hkv)};
  if (key_blocks.numel() > 0) {
    expect(key_blocks, "key_blocks", at::kInt, batch * (skv / kKeysPerWG), dev);
    p.vis.key_blocks = key_blocks.data_ptr<int32_t>();
  }
  const sage_common::LaunchContext ctx(dq);
  const cudaError_t err = run_dq(p, static_cast<int>(batch), static_cast<int>(d), bf16, ctx.stream());
  TORCH_CHECK(err == cudaSuccess, "SageBwd sm90 dQ launch: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dkdv", &dkdv, "SageBwd dK, dV (sm_90a) from the image pre-pass's operands");
  m.def("dq", &dq, "SageBwd dQ (sm_90a) from the image pre-pass's operands");
  m.attr("vec_floats") = kVecFloats;
  m.attr("k_scale_floats") = kKScaleFloats;
  m.attr("dv_in_place_max_queries") = kDvInPlaceMaxQueries;
}
