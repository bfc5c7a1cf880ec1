// Runtime (head dim, dtype, causal, poly) -> compiled template variant. The table comes from
// instantiations/variants.inc, written by generate_instantiations.py next to the variant files.
#include "launch.h"

namespace sage_sm90 {

template <int D, DType kOut, bool kCausal, int kPoly>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream);  // instantiations/*.cu

bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every) {
#define SAGE_SM90_VARIANT(D, DT, CAUSAL, POLY) \
  if (head_dim == D && causal == CAUSAL && exp_poly_every == POLY) return true;
#include "instantiations/variants.inc"
#undef SAGE_SM90_VARIANT
  return false;
}

cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every,
                    cudaStream_t stream) {
#define SAGE_SM90_VARIANT(D, DT, CAUSAL, POLY)                                              \
  if (head_dim == D && dtype == DT && causal == CAUSAL && exp_poly_every == POLY) \
    return launch_fwd<D, DT, CAUSAL, POLY>(p, stream);
#include "instantiations/variants.inc"
#undef SAGE_SM90_VARIANT
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90
