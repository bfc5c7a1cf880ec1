// The lookup from a call (head dim, dtype, causal, exp2 share) to a compiled forward
// variant, over a table of SAGE_SM90_VARIANT(D, DTYPE, CAUSAL, OPTIONS) lines: the file that includes
// this header names it in SAGE_SM90_TABLE (a path relative to this folder or to an include path).
// dispatch.cu: the shipped table (instantiations/variants.inc, one option set per key and precision);
// bench/sm90_int8/dispatch_bench.cu: the benchmark table (bench/sm90_int8/instantiations/), where
// `flags` (FwdOptions::flags()) picks one of several option sets per key.
#pragma once

#include "launch.h"

#ifndef SAGE_SM90_TABLE
#error "define SAGE_SM90_TABLE (the variant table) before including dispatch.cuh"
#endif

namespace sage_sm90 {

template <int D, DType kOut, bool kCausal, FwdOptions kOpt>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream, bool pdl);  // instantiations/*.cu

namespace dispatch_detail {

constexpr int kAnyFlags = -1;  // the first option set of the table for the key
constexpr bool flags_match(int want, int flags) { return want == kAnyFlags || want == flags; }

// The options of the first table entry run_fwd would match (every dtype compiles the same option
// sets), or false where none does: the one lookup behind the queries of launch.h.
inline bool find_fwd_variant(int head_dim, bool causal, int exp_poly_every, int flags, FwdOptions& found) {
#define SAGE_SM90_VARIANT(D, DT, CAUSAL, OPT)                                                   \
  if (head_dim == D && causal == CAUSAL && exp_poly_every == (OPT).exp2_poly_every &&           \
      flags_match(flags, (OPT).flags())) {                                                      \
    found = (OPT);                                                                              \
    return true;                                                                                \
  }
#include SAGE_SM90_TABLE
#undef SAGE_SM90_VARIANT
  return false;
}

inline cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every, int flags,
                           bool pdl, cudaStream_t stream) {
#define SAGE_SM90_VARIANT(D, DT, CAUSAL, OPT)                                                   \
  if (head_dim == D && dtype == DT && causal == CAUSAL && exp_poly_every == (OPT).exp2_poly_every && \
      flags_match(flags, (OPT).flags()))                                                         \
    return launch_fwd<D, DT, CAUSAL, (OPT)>(p, stream, pdl);
#include SAGE_SM90_TABLE
#undef SAGE_SM90_VARIANT
  return cudaErrorInvalidValue;
}

// The variant's shape queries (launch.h); no variant: the default shape (run_fwd refuses the call anyway).
inline FwdOptions variant_or_default(int head_dim, bool causal, int exp_poly_every, int flags) {
  FwdOptions o;
  find_fwd_variant(head_dim, causal, exp_poly_every, flags, o);
  return o;
}

}  // namespace dispatch_detail
}  // namespace sage_sm90
