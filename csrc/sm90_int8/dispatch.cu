// The shipped runtime -> template variant: (head dim, dtype, causal, exp2 share) picks
// the one option set the regular build compiles for it (instantiations/variants.inc, written by
// generate_instantiations.py: policy.hpp's ShippedPolicy<D>, one named policy per head dim). No
// run-time switch.
#define SAGE_SM90_TABLE "instantiations/variants.inc"
#include "policy.hpp"  // the table's option sets
#include "dispatch.cuh"

namespace sage_sm90 {

using dispatch_detail::kAnyFlags;
using dispatch_detail::variant_or_default;

bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every) {
  FwdOptions o;
  return dispatch_detail::find_fwd_variant(head_dim, causal, exp_poly_every, kAnyFlags, o);
}

int fwd_rows_per_cta(int head_dim, bool causal, int exp_poly_every) {
  return kQImageRows * variant_or_default(head_dim, causal, exp_poly_every, kAnyFlags).consumer_warpgroups();
}

int fwd_tile_keys(int head_dim, bool causal, int exp_poly_every) {
  return variant_or_default(head_dim, causal, exp_poly_every, kAnyFlags).tile_keys();
}

int fwd_kv_block(int head_dim, bool causal, int exp_poly_every) {
  return variant_or_default(head_dim, causal, exp_poly_every, kAnyFlags).kv_block();
}

bool fwd_pv_16bit(int head_dim, bool causal, int exp_poly_every) {
  return variant_or_default(head_dim, causal, exp_poly_every, kAnyFlags).pv_16bit;
}

cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every, bool pdl,
                    cudaStream_t stream) {
  return dispatch_detail::run_fwd(p, head_dim, dtype, causal, exp_poly_every, kAnyFlags, pdl, stream);
}

}  // namespace sage_sm90
