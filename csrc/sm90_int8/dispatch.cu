// The shipped runtime -> template variant: (head dim, dtype, causal, exp2 share, precision) picks
// the option set the regular build compiles for it (instantiations/variants.inc, written by
// generate_instantiations.py from policy.hpp: ShippedPolicy<D> for Precision::kFast, AccuratePolicy<D>
// for kAccurate). The table has both policies per key; the precision's flags pick one.
#define SAGE_SM90_TABLE "instantiations/variants.inc"
#include "policy.hpp"  // the table's option sets
#include "dispatch.cuh"

namespace sage_sm90 {

using dispatch_detail::kAnyFlags;
using dispatch_detail::variant_or_default;

namespace {

// The run-time key (FwdOptions::flags(), which leaves out the exp2 share) of the policy of a head dim
// and precision; any other head dim has no variant, whatever the flags.
template <int D>
int flags_of(Precision precision) {
  return (precision == Precision::kAccurate ? AccuratePolicy<D>::kOptions : ShippedPolicy<D>::kOptions).flags();
}

int policy_flags(int head_dim, Precision precision) {
  if (head_dim == 64) return flags_of<64>(precision);
  if (head_dim == 128) return flags_of<128>(precision);
  return kAnyFlags;
}

}  // namespace

bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every, Precision precision) {
  FwdOptions o;
  return dispatch_detail::find_fwd_variant(head_dim, causal, exp_poly_every, policy_flags(head_dim, precision), o);
}

int fwd_rows_per_cta(int head_dim, bool causal, int exp_poly_every, Precision precision) {
  return kQImageRows *
         variant_or_default(head_dim, causal, exp_poly_every, policy_flags(head_dim, precision)).consumer_warpgroups();
}

int fwd_tile_keys(int head_dim, bool causal, int exp_poly_every, Precision precision) {
  return variant_or_default(head_dim, causal, exp_poly_every, policy_flags(head_dim, precision)).tile_keys();
}

int fwd_kv_block(int head_dim, bool causal, int exp_poly_every, Precision precision) {
  return variant_or_default(head_dim, causal, exp_poly_every, policy_flags(head_dim, precision)).kv_block();
}

bool fwd_pv_16bit(int head_dim, bool causal, int exp_poly_every, Precision precision) {
  return variant_or_default(head_dim, causal, exp_poly_every, policy_flags(head_dim, precision)).pv_16bit;
}

cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every, Precision precision,
                    bool pdl, cudaStream_t stream) {
  return dispatch_detail::run_fwd(p, head_dim, dtype, causal, exp_poly_every, policy_flags(head_dim, precision), pdl,
                                  stream);
}

}  // namespace sage_sm90
