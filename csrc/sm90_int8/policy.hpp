// The shipped forward policies: the option sets (FwdOptions, launch.h) the regular build compiles per
// head dim, named once here (in the spirit of FlashAttention-3's tile_size.h): ShippedPolicy, the fast
// one and the default, and AccuratePolicy (Precision::kAccurate). The generated shipped instantiations
// (instantiations/fwd_*.cu) and dispatch table (instantiations/variants.inc) refer to their kOptions;
// generate_instantiations.py reads this file (DEFAULTS, ACCURATE) to write them, the benchmark build's
// variants (each a change of the defaults) and the Python side. After an edit: python
// csrc/sm90_int8/generate_instantiations.py. Each choice says why in one line (H200, attention kernel
// alone unless said otherwise); the A/B runs behind them: generate_instantiations.py's comments,
// DESIGN.md and eval/results/. The pre-pass's shipped mode is launch.h's kPrepassDefaultMode.
#pragma once

#include "launch.h"

namespace sage_sm90 {

template <int D>
struct ShippedPolicy;  // head dims 64 and 128

template <>
struct ShippedPolicy<128> {
  static constexpr FwdOptions kOptions{
      .lean_softmax = true,        // fewer instructions per score; O's rescale skipped where no row max moved
      .overlap_softmax_pv = true,  // the softmax under the previous tile's PV wgmma (FA3's intra-warpgroup overlap)
      .pingpong = true,            // one warpgroup's softmax under the other's wgmmas (FA3's inter-warpgroup order)
      .q_in_registers = true,      // Q K^T as an RS wgmma: a third less smem operand traffic
      .split_reductions = true,    // row max / sum as four chains of 8: one chain of 32 left its latency exposed
      .smem_o_every = 4,           // O's fp32 sum in smem, flushed every 4 tiles: O stops shrinking in the FP8
                                   // accumulator (fp32_pv_tiles spills here); within 1.4 % of the uncorrected speed
      .epilogue_summary = true,    // V's non-finite lookup skipped where there is none: 0.424 -> 0.379 ms (4608 keys)
      .epilogue_staged = true,     // O staged in smem, 16-byte row stores: 0.383 -> 0.357 ms at 1x24x4608x128
      .tc_row_sum = true,          // row sums from the PV wgmma (N = D + 8): 0.370 -> 0.360 ms at 1x24x4608x128
      .seeded_scores = true,       // S accumulated onto the float bias, no add per score: 4.029 -> 3.990 ms (16384)
  };
  // Not here: three_consumers (only the plain loop fits its 160 registers: 1.22x the kernel time at
  // 1x24x4608x128), tile_sums and long_tile (not yet run on a GPU); persistent (no faster) and
  // late_pv_wait (1.03x slower) are deleted (DESIGN.md).
};

template <>
struct ShippedPolicy<64> {
  static constexpr FwdOptions kOptions{
      .lean_softmax = true,      // fewer instructions per score; O's rescale skipped where no row max moved
      .q_in_registers = true,    // Q K^T as an RS wgmma: a third less smem operand traffic
      .fp32_pv_tiles = true,     // each tile's P V added to O in fp32 registers: O stops shrinking in the FP8 wgmma
      .epilogue_summary = true,  // V's non-finite lookup skipped where there is none: 0.495 -> 0.466 ms at 1x38x4429x64
      .epilogue_staged = true,   // O staged in smem, 16-byte row stores (the epilogue 5.2 -> 1.0 us per CTA at hd128)
      .three_consumers = true,   // 192 rows per CTA, 3 warps per scheduler for a latency-bound loop: 0.469 -> 0.422 ms
      .tc_row_sum = true,        // row sums from the PV wgmma (N = D + 8): 7.476 -> 7.013 ms at 1x48x17776x64
      .fused_rescale = true,     // O = alpha O + tile, one FFMA after the PV: 6.414 -> 6.274 ms at 1x48x17776x64
  };
  // Not here: overlap_softmax_pv (its second P array does not fit three warpgroups' 160 registers),
  // pingpong and split_reductions (slower at hd64), seeded_scores (6.327 -> 6.501 ms), every 8th exp2 on
  // the FMA polynomial (2-4 % slower; compiled besides: with_exp2_poly, SAGE_DIFFUSERS_EXP_POLY=8).
};

// The shipped options with another exp2 polynomial share (the extra shares the regular build compiles,
// generate_instantiations.EXTRA_EXP_POLY; SAGE_DIFFUSERS_EXP_POLY picks one per process).
constexpr FwdOptions with_exp2_poly(FwdOptions o, int exp2_poly_every) {
  o.exp2_poly_every = exp2_poly_every;
  return o;
}

// The accuracy policy per head dim (Precision::kAccurate, picked per call): the fast policy with P~ V as
// a 16-bit wgmma in the input dtype instead of FP8 x FP8, and without what that replaces. Measured on
// the H100 (eval/results/int8_pv16_ab_h100.md): rel-L1 against fp32 SDPA 0.0116 / 0.0110 (hd128 / hd64)
// against 0.0383, attention kernel 1.05x-1.12x the fast policy's at hd128 and 1.17x-1.18x at hd64.
template <int D>
struct AccuratePolicy;  // head dims 64 and 128

template <>
struct AccuratePolicy<128> {
  static constexpr FwdOptions kOptions{
      .lean_softmax = true,        // as the fast policy
      .overlap_softmax_pv = true,  // as the fast policy (fits with the consumers at 240 registers)
      .pingpong = true,            // as the fast policy
      .q_in_registers = true,      // as the fast policy: Q from smem was slower (1.078x against 1.051x, 4608 keys)
      .split_reductions = true,    // as the fast policy
      .epilogue_summary = true,    // as the fast policy
      .epilogue_staged = true,     // as the fast policy
      .seeded_scores = true,       // as the fast policy
      .pv_16bit = true,            // P~ V in 16 bits, fp32 accumulation: a third of the error; no smem_o_every
                                   // (O no longer shrinks in an FP8 accumulator), no tc_row_sum (its ones are FP8)
  };
};

template <>
struct AccuratePolicy<64> {
  static constexpr FwdOptions kOptions{
      .lean_softmax = true,      // as the fast policy
      .q_in_registers = true,    // as the fast policy
      .epilogue_summary = true,  // as the fast policy
      .epilogue_staged = true,   // as the fast policy
      .three_consumers = true,   // as the fast policy: the two-warpgroup overlap loop was slower (1.27x against 1.17x)
      .pv_16bit = true,          // P~ V in 16 bits, fp32 accumulation: a third of the error; no fp32_pv_tiles or
                                 // fused_rescale (the accumulator is fp32), no tc_row_sum (its ones are FP8)
  };
};

static_assert(ShippedPolicy<64>::kOptions.valid() && ShippedPolicy<128>::kOptions.valid() &&
                  AccuratePolicy<64>::kOptions.valid() && AccuratePolicy<128>::kOptions.valid(),
              "the shipped option sets are combinations the kernel implements");

}  // namespace sage_sm90
