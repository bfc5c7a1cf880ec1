// Torch binding of the 8-bit kernel's benchmark build (never shipped: the wheel carries csrc/ only;
// sage_diffusers/kernels/int8_sm90.py builds it from a checkout when SAGE_DIFFUSERS_SM90_BENCH=1).
// The shipped entry points (fwd, prepass, has_variant: csrc/sm90_int8/binding.cpp) over the benchmark
// variants (instantiations/bench_*.cu), plus what only benchmarks need: the forward option set and the
// pre-pass mode chosen at run time (set_fwd_flags, set_prepass_mode: this process's state, here
// only), the two launches timed alone (bench_parts) and the phase_clock record (fwd_phase_clock).
#include "bench_dispatch.h"
#include "binding.h"
#include "policy.hpp"

namespace {

using sage_sm90::DType;
using sage_sm90_torch::FwdShape;
using sage_sm90_torch::Prepared;

// What the benchmark selects for the calls that follow (set_fwd_flags, set_prepass_mode).
struct Selection {
  int flags = -1;                                // FwdOptions::flags(); -1 = the first compiled for a call
  int prepass_mode = sage_sm90::kPrepassDefaultMode;
};
Selection g_selection;

// The benchmark policy (binding.h Variants): the benchmark table, the selected flags and mode.
struct BenchVariants {
  Selection s = g_selection;

  bool pdl() const { return (s.prepass_mode & sage_sm90::kPrepassPdl) != 0; }
  int prepass_mode() const { return s.prepass_mode; }
  bool has(int d, bool causal, int e) const { return sage_sm90::bench::has_fwd_variant(d, causal, e, s.flags); }
  FwdShape shape(int d, bool causal, int e) const {
    return {sage_sm90::bench::fwd_rows_per_cta(d, causal, e, s.flags), sage_sm90::bench::fwd_tile_keys(d, causal, e, s.flags),
            sage_sm90::bench::fwd_kv_block(d, causal, e, s.flags), sage_sm90::bench::fwd_pv_16bit(d, causal, e, s.flags)};
  }
  cudaError_t run_prepass(const sage_sm90::PrepassParams& p, int d, DType dtype, cudaStream_t stream) const {
    return sage_sm90::bench::run_prepass(p, d, dtype, pdl(), stream);
  }
  cudaError_t run_fwd(const sage_sm90::FwdParams& p, int d, DType dtype, bool causal, int e, cudaStream_t stream) const {
    return sage_sm90::bench::run_fwd(p, d, dtype, causal, e, s.flags, pdl(), stream);
  }
};

// The calls' variants: the selected option set, or where none is selected the shipped binding's
// choice for the precision (the first compiled option set, the defaults, or the accurate policy).
BenchVariants variants_for(int64_t head_dim, int64_t precision) {
  BenchVariants v;
  TORCH_CHECK(precision == 0 || precision == 1, "precision must be 0 (fast) or 1 (accurate), got ", precision);
  if (precision == 1 && v.s.flags == -1) {
    v.s.flags = head_dim == 64 ? sage_sm90::AccuratePolicy<64>::kOptions.flags()
                               : sage_sm90::AccuratePolicy<128>::kOptions.flags();
  }
  return v;
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& key_mask, bool is_causal, double scale,
                            bool return_lse, int64_t exp_poly_every, int64_t precision) {
  return sage_sm90_torch::forward(variants_for(q.size(3), precision), q, k, v, key_mask, is_causal, scale, return_lse,
                                  exp_poly_every);
}

// v16: V as the pv_16bit variants' 16-bit image (vt_img's bytes: 2 * 128 * D per block) instead of FP8 V^T.
std::vector<at::Tensor> prepass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& key_mask, double scale, int64_t kv_block, bool v16) {
  return sage_sm90_torch::prepass_outputs(BenchVariants{}, q, k, v, key_mask, scale, kv_block, v16);
}

bool has_variant(int64_t head_dim, bool causal, int64_t exp_poly_every, int64_t precision) {
  return variants_for(head_dim, precision).has(static_cast<int>(head_dim), causal, static_cast<int>(exp_poly_every));
}

// GPU time of the two parts of fwd alone, without host overheads (allocations, argument checks, the
// Python call): prepare once, then `reps` back-to-back launches of the pre-pass (with the memsets of
// its counters and V's record, as in every call) and of the attention kernel, timed with events on
// the current stream. Returns {pre-pass ms, attention-kernel ms} per call.
std::vector<double> bench_parts(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                int64_t exp_poly_every, int64_t reps) {
  const sage_common::LaunchContext launch(q);  // q's device and its current stream (common/launch_context.h)
  const BenchVariants variants;
  const int64_t D = q.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(exp_poly_every);
  TORCH_CHECK(reps > 0, "reps must be positive");
  TORCH_CHECK(variants.has(d, is_causal, e), "no compiled variant for this call");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // the pre-pass the dispatched variant needs (its rows per CTA, keys per tile and per K block)
  Prepared r = sage_sm90_torch::prepare(q, k, v, c10::nullopt, scale, /*want_qkm=*/false,
                                        variants.shape(d, is_causal, e), variants.prepass_mode());
  at::Tensor out = at::empty_like(q);
  const sage_sm90::FwdParams p = sage_sm90_torch::fwd_params(r, q, k, out, scale);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DType dt = sage_sm90_torch::dtype_of(q);
  cudaEvent_t ev[3];
  for (auto& ev_i : ev) TORCH_CHECK(cudaEventCreate(&ev_i) == cudaSuccess, "cudaEventCreate failed");
  auto prepass_once = [&] {
    cudaMemsetAsync(r.p.counter, 0, sizeof(int) * r.n_ints, stream);
    cudaMemsetAsync(r.p.v_first, sage_sm90_torch::kNoKeyByte,
                    sizeof(int) * sage_sm90_torch::v_record_ints(q.size(0), k.size(1), D), stream);
    return variants.run_prepass(r.p, d, dt, stream);
  };
  auto fwd_once = [&] { return variants.run_fwd(p, d, dt, is_causal, e, stream); };
  for (int i = 0; i < 3; ++i) {  // warm-up
    TORCH_CHECK(prepass_once() == cudaSuccess && fwd_once() == cudaSuccess, "bench launch failed");
  }
  cudaEventRecord(ev[0], stream);
  for (int64_t i = 0; i < reps; ++i) prepass_once();
  cudaEventRecord(ev[1], stream);
  for (int64_t i = 0; i < reps; ++i) fwd_once();
  cudaEventRecord(ev[2], stream);
  TORCH_CHECK(cudaEventSynchronize(ev[2]) == cudaSuccess, "bench sync failed");
  float t_pre = 0.f, t_fwd = 0.f;
  cudaEventElapsedTime(&t_pre, ev[0], ev[1]);
  cudaEventElapsedTime(&t_fwd, ev[1], ev[2]);
  for (auto& ev_i : ev) cudaEventDestroy(ev_i);
  return {t_pre / reps, t_fwd / reps};
}

// phase_clock variants (selected with set_fwd_flags): the pre-pass and one forward with a phase
// record. Returns int64 (CTAs, kPhaseSlots, kPhaseWords): per CTA and phase point (launch.h
// ConsumerPhase for warpgroups 0 and 1, then ProducerPhase) {%globaltimer ns, %clock64 cycles}; 0 where
// nothing was recorded (a variant without phase_clock writes nothing).
at::Tensor fwd_phase_clock(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                           int64_t exp_poly_every) {
  const sage_common::LaunchContext launch(q);  // q's device and its current stream (common/launch_context.h)
  const BenchVariants variants;
  const int64_t D = q.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(exp_poly_every);
  TORCH_CHECK(variants.has(d, is_causal, e), "no compiled variant for this call");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const FwdShape shape = variants.shape(d, is_causal, e);
  Prepared r = sage_sm90_torch::prepare_and_launch(variants, q, k, v, c10::nullopt, scale, /*want_qkm=*/false, shape);
  at::Tensor out = at::empty_like(q);
  sage_sm90::FwdParams p = sage_sm90_torch::fwd_params(r, q, k, out, scale);
  const int64_t ctas = r.p.n_q_tiles / (shape.rows_per_cta / sage_sm90_torch::kQTileRows) * q.size(1) * q.size(0);
  at::Tensor rec = at::zeros({ctas, sage_sm90::kPhaseSlots, sage_sm90::kPhaseWords}, q.options().dtype(at::kLong));
  p.phase_clock = reinterpret_cast<unsigned long long*>(rec.data_ptr<int64_t>());
  const cudaError_t err = variants.run_fwd(p, d, sage_sm90_torch::dtype_of(q), is_causal, e,
                                           c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "sage sm90 attention launch failed: ", cudaGetErrorString(err));
  return rec;
}

void set_prepass_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= sage_sm90::kPrepassModeMax,
              "pre-pass mode is a bit set: 1 = Q in the stats launch, 2 = batched loads, "
              "4 = one workspace allocation, 8 = programmatic dependent launches, 16 = L2 reuse "
              "of K and V, 32 = one reciprocal per scale");
  g_selection.prepass_mode = static_cast<int>(mode);
}

int64_t prepass_mode() { return g_selection.prepass_mode; }

void set_fwd_flags(int64_t flags) { g_selection.flags = static_cast<int>(flags); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sage_diffusers sm_90a 8-bit attention, benchmark build (see bench/sm90_int8/)";
  m.def("fwd", &fwd, "8-bit attention forward -> [out, lse (empty unless return_lse)]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_mask"), py::arg("is_causal"),
        py::arg("scale"), py::arg("return_lse"), py::arg("exp_poly_every"), py::arg("precision") = 0);
  m.def("prepass", &prepass,
        "quantization pre-pass -> [q_img, sq, qkm, k_img, sk, vt_img, sv, kmean, kv_len, mask_bits, v_first, v_summary]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_mask"), py::arg("scale"), py::arg("kv_block") = 128,
        py::arg("v16") = false);
  m.def("has_variant", &has_variant, py::arg("head_dim"), py::arg("causal"), py::arg("exp_poly_every"),
        py::arg("precision") = 0);
  m.def("bench_parts", &bench_parts,
        "[pre-pass ms, attention-kernel ms] per call, back-to-back launches, no host work",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("is_causal"), py::arg("exp_poly_every"),
        py::arg("reps"));
  m.def("fwd_phase_clock", &fwd_phase_clock,
        "pre-pass + one forward with a phase record -> int64 (CTAs, slots, {globaltimer ns, clock64})",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("is_causal"), py::arg("exp_poly_every"));
  m.def("set_prepass_mode", &set_prepass_mode,
        "pre-pass bit set (launch.h kPrepass*) of the calls that follow: 0 = original, 1 = Q in the stats "
        "launch (no LSE), 2 = batched loads, 4 = one workspace allocation (no LSE), 8 = programmatic "
        "dependent launches, 16 = L2 reuse of K and V between the launches, 32 = one reciprocal per "
        "scale instead of a division per element",
        py::arg("mode"));
  m.def("prepass_mode", &prepass_mode, "the current pre-pass mode bit set");
  m.def("set_fwd_flags", &set_fwd_flags,
        "forward option set (FwdOptions::flags()) of the calls that follow (-1 = the first compiled for a call)",
        py::arg("flags"));
}
