// The lab binding of the backward kernels (csrc/sm90_sagebwd/): every variant of launch.cuh by
// name, and the layout tables the lab script writes its operand images with (each the CuTe smem
// layout the wgmma descriptors read, evaluated on the host, so images and descriptors agree by
// construction; the shipped image pre-pass uses the same patterns as formulas, proven equal by
// csrc/sm90_sagebwd/host_layout_check.cu).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "launch.cuh"

namespace {

using namespace sagebwd_sm90;

// Element offset of (row, col) in one tile of a 2-mode (or the first stage of a 3-mode) layout. CuTe
// swizzles these layouts on byte addresses (for 16-bit elements the swizzle functor alone, applied to
// element offsets, is not the hardware's pattern): read them through a 1024-aligned smem pointer, as
// csrc/sm90_int8/host_layout_check.cu does.
template <class Elem, class Layout>
torch::Tensor table_of(Layout layout, int rows, int cols) {
  alignas(1024) static Elem buf[4 * 128 * 128];  // a stage of the largest tile is 128 x 128
  auto tile = cute::make_tensor(cute::make_smem_ptr(buf), layout);
  auto out = torch::empty({rows, cols}, torch::kInt64);
  auto* o = out.data_ptr<int64_t>();
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      if constexpr (decltype(cute::rank(layout))::value == 3) {
        o[r * cols + c] = &tile(r, c, 0) - buf;
      } else {
        o[r * cols + c] = &tile(r, c) - buf;
      }
    }
  return out;
}

// kind: "kv16" (64 x D, 16-bit), "q16" (64 x D, 16-bit, one stage), "t8" (D x 64, int8, one stage).
torch::Tensor layout_table(const std::string& kind, int64_t d) {
  auto pick = [&](auto dd) {
    constexpr int D = decltype(dd)::value;
    using C = Config<D, cute::bfloat16_t>;  // the layouts depend on the element size only
    if (kind == "kv16") return table_of<cute::bfloat16_t>(typename C::LayoutKV{}, kKeysPerWG, D);
    if (kind == "q16") return table_of<cute::bfloat16_t>(typename C::LayoutQ{}, kBlockM, D);
    if (kind == "t8") return table_of<int8_t>(typename C::LayoutT8{}, D, kBlockM);
    TORCH_CHECK(false, "layout_table: kind must be kv16, q16 or t8, got ", kind);
  };
  TORCH_CHECK(d == 64 || d == 128, "layout_table: head dim 64 or 128, got ", d);
  return d == 64 ? pick(std::integral_constant<int, 64>{}) : pick(std::integral_constant<int, 128>{});
}

// Images as uint8 / float32 tensors laid out as Params says; dk, dv (B, H, Skv, D) float32 outputs.
// overlap: Schedule::kOverlap (hd64); dv_channel_scale (B, H, D) float32: DvAcc::kInPlace (bf16; dot's
// codes then carry dO' per channel), or an empty tensor; dk16: DkAcc::kBf16InPlace (bf16; qt unread).
void dkdv(torch::Tensor k, torch::Tensor v, torch::Tensor q, torch::Tensor dO, torch::Tensor qt, torch::Tensor dot,
          torch::Tensor vec, torch::Tensor dk, torch::Tensor dv, bool bf16, double qk_scale, double sm_scale,
          bool overlap, torch::Tensor dv_channel_scale, bool dk16) {
  for (auto* t : {&k, &v, &q, &dO, &qt, &dot, &vec, &dk, &dv, &dv_channel_scale}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "dkdv: CUDA contiguous tensors");
  }
  TORCH_CHECK(dk.dim() == 4 && dk.scalar_type() == torch::kFloat32 && dv.sizes() == dk.sizes(), "dk, dv (B, H, Skv, D) float32");
  const int batch = dk.size(0), heads = dk.size(1), skv = dk.size(2), d = dk.size(3);
  const int sq = vec.size(-2) * kBlockM;  // vec (B, H, Sq / 64, kVecFloats)
  TORCH_CHECK(vec.dim() == 4 && vec.size(-1) == kVecFloats, "vec (B, H, Sq / 64, ", kVecFloats, ")");
  TORCH_CHECK(skv % kBlockN == 0, "Skv must be a multiple of ", kBlockN);
  TORCH_CHECK(k.numel() == int64_t(batch) * heads * skv * d * 2 && v.numel() == k.numel(), "K / V images");
  TORCH_CHECK(q.numel() == int64_t(batch) * heads * sq * d * 2 && dO.numel() == q.numel(), "Q / dO images");
  TORCH_CHECK(qt.numel() == int64_t(batch) * heads * sq * d && dot.numel() == qt.numel(), "Q^T / dO'^T images");
  const bool in_place = dv_channel_scale.numel() > 0;
  TORCH_CHECK(!in_place || (dv_channel_scale.numel() == int64_t(batch) * heads * d && bf16 &&
                            dv_channel_scale.scalar_type() == torch::kFloat32),
              "dkdv: dv_channel_scale (B, H, D) float32, bf16 inputs");
  TORCH_CHECK(!overlap || d == 64, "dkdv: the overlapped schedule is built at head dim 64 only");
  TORCH_CHECK(!in_place || overlap || d == 128, "dkdv: dV in place is built with the overlapped schedule at hd64");
  TORCH_CHECK(!dk16 || (bf16 && (d == 128 || overlap)),
              "dkdv: the bf16 dK product is built for bf16, with the overlapped schedule at hd64");
  Params p{k.data_ptr<uint8_t>(), v.data_ptr<uint8_t>(), q.data_ptr<uint8_t>(), dO.data_ptr<uint8_t>(),
           qt.data_ptr<uint8_t>(), dot.data_ptr<uint8_t>(), vec.data_ptr<float>(), dk.data_ptr<float>(),
           dv.data_ptr<float>(), in_place ? dv_channel_scale.data_ptr<float>() : nullptr, heads, sq, skv,
           static_cast<float>(qk_scale), static_cast<float>(sm_scale), Visibility{}, /*group=*/1};
  const c10::cuda::CUDAGuard guard(dk.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  using S = Schedule;
  using A = DvAcc;
  using bf = cute::bfloat16_t;
  using hf = cute::half_t;
  using K = DkAcc;
  if (dk16) {
    if (d == 128) {
      err = in_place ? launch_dkdv<128, bf, S::kSerial, A::kInPlace, K::kBf16InPlace>(p, batch, stream)
                     : launch_dkdv<128, bf, S::kSerial, A::kScaledPerStep, K::kBf16InPlace>(p, batch, stream);
    } else {
      err = in_place ? launch_dkdv<64, bf, S::kOverlap, A::kInPlace, K::kBf16InPlace>(p, batch, stream)
                     : launch_dkdv<64, bf, S::kOverlap, A::kScaledPerStep, K::kBf16InPlace>(p, batch, stream);
    }
  } else if (d == 128 && in_place) {
    err = launch_dkdv<128, bf, S::kSerial, A::kInPlace>(p, batch, stream);
  } else if (d == 128) {
    err = bf16 ? launch_dkdv<128, bf, S::kSerial, A::kScaledPerStep>(p, batch, stream)
               : launch_dkdv<128, hf, S::kSerial, A::kScaledPerStep>(p, batch, stream);
  } else if (d == 64 && in_place) {
    err = launch_dkdv<64, bf, S::kOverlap, A::kInPlace>(p, batch, stream);
  } else if (d == 64 && overlap) {
    err = bf16 ? launch_dkdv<64, bf, S::kOverlap, A::kScaledPerStep>(p, batch, stream)
               : launch_dkdv<64, hf, S::kOverlap, A::kScaledPerStep>(p, batch, stream);
  } else if (d == 64) {
    err = bf16 ? launch_dkdv<64, bf, S::kSerial, A::kScaledPerStep>(p, batch, stream)
               : launch_dkdv<64, hf, S::kSerial, A::kScaledPerStep>(p, batch, stream);
  } else {
    TORCH_CHECK(false, "dkdv: head dim 64 or 128, got ", d);
  }
  TORCH_CHECK(err == cudaSuccess, "launch: ", cudaGetErrorString(err));
}

// dQ (dq_kernel.cuh): images q, dO (B, H, Sq / 64 tiles), k, v, kt (B, H, Skv / 64 tiles), k_scale
// (B, H, Skv / 64, 4); rows m, inv_l (kDsPrescale / l), delta (B, H, Sq) float32; dq (B, H, Sq, D) float32.
// dq16: DqAcc::kBf16InPlace (bf16, overlapped schedule), kt then the smoothed K's 16-bit images.
void dq(torch::Tensor q, torch::Tensor dO, torch::Tensor k, torch::Tensor v, torch::Tensor kt, torch::Tensor k_scale,
        torch::Tensor m, torch::Tensor inv_l, torch::Tensor delta, torch::Tensor dq, bool bf16, double qk_scale,
        double sm_scale, bool overlap, bool dq16) {
  for (auto* t : {&q, &dO, &k, &v, &kt, &k_scale, &m, &inv_l, &delta, &dq}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "dq: CUDA contiguous tensors");
  }
  TORCH_CHECK(dq.dim() == 4 && dq.scalar_type() == torch::kFloat32, "dq (B, H, Sq, D) float32");
  const int batch = dq.size(0), heads = dq.size(1), sq = dq.size(2), d = dq.size(3);
  const int skv = k_scale.size(2) * kKeysPerWG;
  TORCH_CHECK(sq % (kConsumerWGs * kBlockM) == 0, "Sq must be a multiple of ", kConsumerWGs * kBlockM);
  TORCH_CHECK(q.numel() == int64_t(batch) * heads * sq * d * 2 && dO.numel() == q.numel(), "Q / dO images");
  TORCH_CHECK(k.numel() == int64_t(batch) * heads * skv * d * 2 && v.numel() == k.numel(), "K / V images");
  TORCH_CHECK(kt.numel() == int64_t(batch) * heads * skv * d * (dq16 ? 2 : 1), dq16 ? "smoothed K image" : "K^T image");
  TORCH_CHECK(!dq16 || (bf16 && overlap), "dq: the bf16 dQ product is built for bf16 with the overlapped schedule");
  TORCH_CHECK(m.numel() == int64_t(batch) * heads * sq && inv_l.numel() == m.numel() && delta.numel() == m.numel(),
              "m, inv_l, delta (B, H, Sq)");
  sagebwd_sm90::DqParams p{q.data_ptr<uint8_t>(), dO.data_ptr<uint8_t>(), k.data_ptr<uint8_t>(), v.data_ptr<uint8_t>(),
                           kt.data_ptr<uint8_t>(), k_scale.data_ptr<float>(), m.data_ptr<float>(), inv_l.data_ptr<float>(),
                           delta.data_ptr<float>(), dq.data_ptr<float>(), heads, sq, skv,
                           static_cast<float>(qk_scale), static_cast<float>(sm_scale), sagebwd_sm90::Visibility{},
                           /*group=*/1};
  const c10::cuda::CUDAGuard guard(dq.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  using S = sagebwd_sm90::Schedule;
  using bf = cute::bfloat16_t;
  using hf = cute::half_t;
  TORCH_CHECK(!overlap || bf16, "dq: the overlapped schedule is built for bf16");
  using Acc = sagebwd_sm90::DqAcc;
  if (dq16) {
    TORCH_CHECK(d == 64 || d == 128, "dq: head dim 64 or 128, got ", d);
    err = d == 128 ? launch_dq<128, bf, S::kOverlap, Acc::kBf16InPlace>(p, batch, stream)
                   : launch_dq<64, bf, S::kOverlap, Acc::kBf16InPlace>(p, batch, stream);
  } else if (d == 128 && overlap) {
    err = launch_dq<128, bf, S::kOverlap>(p, batch, stream);
  } else if (d == 128) {
    err = bf16 ? launch_dq<128, bf, S::kSerial>(p, batch, stream) : launch_dq<128, hf, S::kSerial>(p, batch, stream);
  } else if (d == 64 && overlap) {
    err = launch_dq<64, bf, S::kOverlap>(p, batch, stream);
  } else if (d == 64) {
    err = bf16 ? launch_dq<64, bf, S::kSerial>(p, batch, stream) : launch_dq<64, hf, S::kSerial>(p, batch, stream);
  } else {
    TORCH_CHECK(false, "dq: head dim 64 or 128, got ", d);
  }
  TORCH_CHECK(err == cudaSuccess, "launch: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dkdv", &dkdv, "SageBwd dK/dV, a variant by name (lab, sm_90a)");
  m.def("dq", &dq, "SageBwd dQ, a variant by name (lab, sm_90a)");
  m.def("layout_table", &layout_table, "element offsets of a tile's smem layout, (rows, cols)");
  m.attr("vec_floats") = kVecFloats;
}
