// Torch binding of the sm_90a 8-bit attention as shipped: the forward, the pre-pass alone (tests) and
// the variant query. Every call takes its variant from its arguments through ShippedVariants: the
// option set the regular build compiles for its head dim and precision (instantiations/variants.inc)
// and the default pre-pass mode; no process-wide state. The torch side of a call is
// binding.h; the benchmark build (bench/sm90_int8/binding_bench.cpp) adds its entry points there.
#include "binding.h"

namespace {

using sage_sm90::DType;
using sage_sm90_torch::FwdShape;

// The shipped policy (binding.h Variants): launch.h's dispatch over the regular build's table and
// kPrepassDefaultMode.
struct ShippedVariants {
  static constexpr int kMode = sage_sm90::kPrepassDefaultMode;
  static constexpr bool kPdl = (kMode & sage_sm90::kPrepassPdl) != 0;
  sage_sm90::Precision precision = sage_sm90::Precision::kFast;

  int prepass_mode() const { return kMode; }
  bool has(int d, bool causal, int e) const { return sage_sm90::has_fwd_variant(d, causal, e, precision); }
  FwdShape shape(int d, bool causal, int e) const {
    return {sage_sm90::fwd_rows_per_cta(d, causal, e, precision), sage_sm90::fwd_tile_keys(d, causal, e, precision),
            sage_sm90::fwd_kv_block(d, causal, e, precision), sage_sm90::fwd_pv_16bit(d, causal, e, precision)};
  }
  cudaError_t run_prepass(const sage_sm90::PrepassParams& p, int d, DType dtype, cudaStream_t stream) const {
    return sage_sm90::run_prepass(p, d, dtype, kPdl, stream);
  }
  cudaError_t run_fwd(const sage_sm90::FwdParams& p, int d, DType dtype, bool causal, int e, cudaStream_t stream) const {
    return sage_sm90::run_fwd(p, d, dtype, causal, e, precision, kPdl, stream);
  }
};

// The Python side's precision number (int8_sm90.Precision): 0 fast, 1 accurate.
sage_sm90::Precision precision_of(int64_t precision) {
  TORCH_CHECK(precision == 0 || precision == 1, "precision must be 0 (fast) or 1 (accurate), got ", precision);
  return static_cast<sage_sm90::Precision>(precision);
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& key_mask, bool is_causal, double scale,
                            bool return_lse, int64_t exp_poly_every, int64_t precision) {
  return sage_sm90_torch::forward(ShippedVariants{precision_of(precision)}, q, k, v, key_mask, is_causal, scale,
                                  return_lse, exp_poly_every);
}

// kv_block 128 only: the 64-key pre-pass of the long_tile variants is the benchmark build's. v16: V as
// the accurate policy's 16-bit image.
std::vector<at::Tensor> prepass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& key_mask, double scale, int64_t kv_block, bool v16) {
  TORCH_CHECK(kv_block == 128, "kv_block must be 128 (64: the benchmark build's long_tile pre-pass), got ", kv_block);
  return sage_sm90_torch::prepass_outputs(ShippedVariants{}, q, k, v, key_mask, scale, kv_block, v16);
}

bool has_variant(int64_t head_dim, bool causal, int64_t exp_poly_every, int64_t precision) {
  return sage_sm90::has_fwd_variant(static_cast<int>(head_dim), causal, static_cast<int>(exp_poly_every),
                                    precision_of(precision));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sage_diffusers sm_90a 8-bit attention (see csrc/sm90_int8/)";
  m.def("fwd", &fwd, "8-bit attention forward -> [out, lse (empty unless return_lse)]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_mask"), py::arg("is_causal"),
        py::arg("scale"), py::arg("return_lse"), py::arg("exp_poly_every"), py::arg("precision") = 0);
  m.def("prepass", &prepass,
        "quantization pre-pass -> [q_img, sq, qkm, k_img, sk, vt_img, sv, kmean, kv_len, mask_bits, v_first, v_summary]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_mask"), py::arg("scale"), py::arg("kv_block") = 128,
        py::arg("v16") = false);
  m.def("has_variant", &has_variant, py::arg("head_dim"), py::arg("causal"), py::arg("exp_poly_every"),
        py::arg("precision") = 0);
}
