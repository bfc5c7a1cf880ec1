// The benchmark build's host interface (never shipped): launch.h's queries and launches with the
// run-time choices the shipped build fixes, the forward option set (`flags`, FwdOptions::flags(); -1 =
// the first compiled for the call), the pre-pass mode (PrepassParams::kernel_mode: every one is
// compiled here, the shipped build compiles kPrepassDefaultMode's) and the pre-pass's K block
// (PrepassParams::kv_block 64: the long_tile variants). dispatch_bench.cu holds the table
// (instantiations/variants_bench.inc, over the instantiations/bench_*.cu beside it), prepass_modes.cu
// the pre-pass in every mode, prepass_long.cu its 64-key blocks, prepass_v16.cu its 16-bit V image.
#pragma once

#include "launch.h"

namespace sage_sm90::bench {

bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every, int flags);
int fwd_rows_per_cta(int head_dim, bool causal, int exp_poly_every, int flags);
int fwd_tile_keys(int head_dim, bool causal, int exp_poly_every, int flags);
int fwd_kv_block(int head_dim, bool causal, int exp_poly_every, int flags);
bool fwd_pv_16bit(int head_dim, bool causal, int exp_poly_every, int flags);
cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every, int flags,
                    bool pdl, cudaStream_t stream);
// Any pre-pass mode; p.kv_block 128, or 64 (the long_tile variants', head dim 128: run_prepass_long);
// p.kernel_mode with kPrepassV16Image (the pv_16bit variants': run_prepass_v16).
cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream);
cudaError_t run_prepass_long(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream);
cudaError_t run_prepass_v16(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream);

}  // namespace sage_sm90::bench
