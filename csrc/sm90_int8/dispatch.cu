// Runtime (head dim, dtype, causal, exp2 poly share, option flags) -> compiled template variant.
// The table comes from instantiations/variants.inc (regular build: one option set per head dim)
// or instantiations/variants_bench.inc (-DSAGE_SM90_BENCH=1: a few shapes, several option sets),
// both written by generate_instantiations.py next to the variant files.
#include "launch.h"

namespace sage_sm90 {

template <int D, DType kOut, bool kCausal, FwdOptions kOpt>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream);  // instantiations/*.cu

namespace {
int g_flags = -1;  // set_fwd_flags (benchmarks); -1 = any (the regular table has one per key)
bool flags_match(int flags) { return g_flags < 0 || g_flags == flags; }
// q_in_kernel variants compute no LSE (FwdOptions::q_in_kernel): never picked for a call that wants it.
constexpr bool serves_lse(const FwdOptions& o, bool lse) { return !lse || !o.q_in_kernel; }
}  // namespace

void set_fwd_flags(int flags) { g_flags = flags; }

#if SAGE_SM90_BENCH
#define SAGE_SM90_TABLE "instantiations/variants_bench.inc"
#else
#define SAGE_SM90_TABLE "instantiations/variants.inc"
#endif

namespace {
// The options of the first table entry run_fwd would match (every dtype compiles the same option
// sets), or false where none does: the one lookup behind the queries below.
bool find_fwd_variant(int head_dim, bool causal, int exp_poly_every, bool lse, FwdOptions& found) {
#define SAGE_SM90_VARIANT(D, DT, CAUSAL, OPT)                                                   \
  if (head_dim == D && causal == CAUSAL && exp_poly_every == (OPT).exp2_poly_every &&           \
      flags_match((OPT).flags()) && serves_lse(OPT, lse)) {                                      \
    found = (OPT);                                                                              \
    return true;                                                                                \
  }
#include SAGE_SM90_TABLE
#undef SAGE_SM90_VARIANT
  return false;
}
}  // namespace

bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every, bool lse) {
  FwdOptions o;
  return find_fwd_variant(head_dim, causal, exp_poly_every, lse, o);
}

bool fwd_quantizes_q(int head_dim, bool causal, int exp_poly_every, bool lse) {
  FwdOptions o;
  return find_fwd_variant(head_dim, causal, exp_poly_every, lse, o) && o.q_in_kernel;
}

int fwd_rows_per_cta(int head_dim, bool causal, int exp_poly_every, bool lse) {
  FwdOptions o;  // no variant: the default shape (run_fwd refuses the call anyway)
  find_fwd_variant(head_dim, causal, exp_poly_every, lse, o);
  return kQImageRows * o.consumer_warpgroups();
}

int fwd_tile_keys(int head_dim, bool causal, int exp_poly_every, bool lse) {
  FwdOptions o;
  find_fwd_variant(head_dim, causal, exp_poly_every, lse, o);
  return o.tile_keys();
}

int fwd_kv_block(int head_dim, bool causal, int exp_poly_every, bool lse) {
  FwdOptions o;
  find_fwd_variant(head_dim, causal, exp_poly_every, lse, o);
  return o.kv_block();
}

cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every,
                    cudaStream_t stream) {
#define SAGE_SM90_VARIANT(D, DT, CAUSAL, OPT)                                                   \
  if (head_dim == D && dtype == DT && causal == CAUSAL && exp_poly_every == (OPT).exp2_poly_every && \
      flags_match((OPT).flags()) && serves_lse(OPT, p.lse != nullptr))                           \
    return launch_fwd<D, DT, CAUSAL, (OPT)>(p, stream);
#include SAGE_SM90_TABLE
#undef SAGE_SM90_VARIANT
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90
