// The benchmark build's runtime -> template variant (bench_dispatch.h): the table of the bench_*.cu
// instantiations (instantiations/variants_bench.inc beside this file, generate_instantiations.BENCH_VARIANTS),
// several option sets per key, picked by the caller's flags. dispatch.cuh includes the table, so the
// build names this folder as an include path (int8_sm90.build_bench, bench/sass_diff.py, compile_check.sh).
#define SAGE_SM90_TABLE "instantiations/variants_bench.inc"
#include "bench_dispatch.h"
#include "dispatch.cuh"

namespace sage_sm90::bench {

using dispatch_detail::variant_or_default;

bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every, int flags) {
  FwdOptions o;
  return dispatch_detail::find_fwd_variant(head_dim, causal, exp_poly_every, flags, o);
}

int fwd_rows_per_cta(int head_dim, bool causal, int exp_poly_every, int flags) {
  return kQImageRows * variant_or_default(head_dim, causal, exp_poly_every, flags).consumer_warpgroups();
}

int fwd_tile_keys(int head_dim, bool causal, int exp_poly_every, int flags) {
  return variant_or_default(head_dim, causal, exp_poly_every, flags).tile_keys();
}

int fwd_kv_block(int head_dim, bool causal, int exp_poly_every, int flags) {
  return variant_or_default(head_dim, causal, exp_poly_every, flags).kv_block();
}

bool fwd_pv_16bit(int head_dim, bool causal, int exp_poly_every, int flags) {
  return variant_or_default(head_dim, causal, exp_poly_every, flags).pv_16bit;
}

cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every, int flags,
                    bool pdl, cudaStream_t stream) {
  return dispatch_detail::run_fwd(p, head_dim, dtype, causal, exp_poly_every, flags, pdl, stream);
}

}  // namespace sage_sm90::bench
