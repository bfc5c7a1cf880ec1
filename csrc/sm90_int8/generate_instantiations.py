#!/usr/bin/env python3
"""The one source of the 8-bit kernel's variants; the defaults (the shipped option set per head dim)
are read from policy.hpp (ShippedPolicy<D>::kOptions). Writes:

* one .cu per compiled forward variant (one file each so ninja/nvcc compile them in parallel and a
  slim build can drop files), named by what it is: the shipped ones (fwd_*.cu) into instantiations/,
  the benchmark build's (bench_*.cu, lab only, never shipped) into bench/sm90_int8/instantiations/;
* the dispatch tables beside them: instantiations/variants.inc (dispatch.cu) and
  bench/sm90_int8/instantiations/variants_bench.inc (bench/sm90_int8/dispatch_bench.cu);
* sage_diffusers/kernels/_sm90_int8_variants.py, the same defaults and variant lists for Python
  (the binding's exp2 default, the benchmark's variant names).

Variant axes: head dim, output dtype, causal, and the kernel options (FwdOptions in launch.h,
explained in DESIGN.md), the exp2 polynomial share among them (0 = every exp2 on MUFU; N =
every N-th exp2 from the FMA polynomial; only hd64 is bound by the exp unit). The defaults per head
dim are the fastest correct option sets of the H200 variant benchmark (variants_bench.py; the
tables are in eval/results/). Re-run after editing this file or policy.hpp:
    python csrc/sm90_int8/generate_instantiations.py
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICY = HERE / "policy.hpp"  # the shipped option set per head dim (ShippedPolicy<D>::kOptions)
PY_OUT = HERE.parents[1] / "sage_diffusers" / "kernels" / "_sm90_int8_variants.py"
# The benchmark build's instantiations and table: the checkout's lab (bench/), which no wheel carries.
BENCH_OUT = HERE.parents[1] / "bench" / "sm90_int8" / "instantiations"


# The first bools' flag bits (FwdOptions::flags() in launch.h spells the same positions).
_LOW_BITS = {"lean_softmax": 0, "overlap_softmax_pv": 1, "pingpong": 2, "q_in_registers": 3,
             "split_reductions": 5, "fp32_pv_tiles": 6}
# Bools added after smem_o_every take flag bits above its five (FwdOptions::kFlagsHighShift), so
# the flags of the older option sets (in eval/results/) stay what they were.
_HIGH_SHIFT = 12
# name -> bit above _HIGH_SHIFT (FwdOptions::flags() in launch.h spells the same positions)
_HIGH_BITS = {"phase_clock": 2, "epilogue_summary": 3,
              "epilogue_staged": 5, "three_consumers": 6, "tc_row_sum": 8, "tile_sums": 9,
              "fused_rescale": 10, "seeded_scores": 12, "long_tile": 13, "pv_16bit": 14}
# Bits of deleted options, left unused so that no other option set's flags (or kernel name) change:
# low bit 4 (fp16_exp2), high bits 0 (seed_reductions), 1 (persistent), 4 (q_in_kernel), 7
# (late_pv_wait) and 11 (fma_convert). DESIGN.md.
_RESERVED_LOW_BITS = (4,)
_RESERVED_HIGH_BITS = (0, 1, 4, 7, 11)


@dataclass(frozen=True)
class FwdOptions:
    """Mirror of the C++ FwdOptions (launch.h): field names, order and flag bits must match."""

    lean_softmax: bool = False        # bit 1
    overlap_softmax_pv: bool = False  # bit 2
    pingpong: bool = False            # bit 4
    q_in_registers: bool = False      # bit 8
    split_reductions: bool = False    # bit 32, needs lean_softmax
    fp32_pv_tiles: bool = False       # bit 64
    exp2_poly_every: int = 0
    smem_o_every: int = 0             # flags bits 7-11 (FwdOptions::kFlagsIntShift)
    phase_clock: bool = False         # bit 1 << 14 (kFlagsHighShift + 2), benchmarks: timestamps per phase
    epilogue_summary: bool = False    # bit 1 << 15 (kFlagsHighShift + 3)
    epilogue_staged: bool = False     # bit 1 << 17 (kFlagsHighShift + 5), O staged in smem, 16-byte stores
    three_consumers: bool = False     # bit 1 << 18 (kFlagsHighShift + 6), no pingpong / phase_clock; hd128: no overlap
    tc_row_sum: bool = False          # bit 1 << 20 (kFlagsHighShift + 8), row sums on the tensor cores
    tile_sums: bool = False           # bit 1 << 21 (kFlagsHighShift + 9), tc_row_sum's sums into fp32 per tile
    fused_rescale: bool = False       # bit 1 << 22 (kFlagsHighShift + 10), O = alpha O + tile (fp32_pv_tiles, plain loop)
    seeded_scores: bool = False       # bit 1 << 24 (kFlagsHighShift + 12), S accumulated onto the bias bits
    long_tile: bool = False           # bit 1 << 25 (kFlagsHighShift + 13), 192-key tiles of three 64-key K blocks
    pv_16bit: bool = False            # bit 1 << 26 (kFlagsHighShift + 14), P~ V as a 16-bit wgmma (V unquantized)

    def __post_init__(self):
        if self.split_reductions and not self.lean_softmax:
            raise ValueError(f"{self}: split_reductions is a variant of the lean softmax")
        n = self.smem_o_every
        if n < 0 or n > 16 or n & (n - 1) or (n and self.fp32_pv_tiles):
            raise ValueError(f"{self}: smem_o_every is a power of 2 up to 16, not with fp32_pv_tiles")
        if self.tile_sums and not (self.tc_row_sum and not self.fp32_pv_tiles):
            raise ValueError(f"{self}: tile_sums takes tc_row_sum's sums out of an accumulator that spans tiles "
                             "(tc_row_sum, not fp32_pv_tiles)")
        if self.fused_rescale and not (self.fp32_pv_tiles and not self.overlap_softmax_pv and not self.pingpong):
            raise ValueError(f"{self}: fused_rescale folds O's rescale into fp32_pv_tiles' O += tile, in the plain "
                             "loop (no overlap_softmax_pv, no pingpong)")
        if self.long_tile and not (self.lean_softmax and not self.three_consumers):
            raise ValueError(f"{self}: long_tile has per-block K scales in the lean fp32 steps and two consumer "
                             "warpgroups")
        if self.three_consumers and (self.pingpong or self.phase_clock):
            raise ValueError(f"{self}: three_consumers has no ping-pong schedule or phase record (two warpgroups)")
        if self.pv_16bit and (self.tc_row_sum or self.fp32_pv_tiles or self.smem_o_every or self.long_tile):
            raise ValueError(f"{self}: pv_16bit takes the row sums from the softmax (no tc_row_sum), accumulates "
                             "O in fp32 in the tensor core (no fp32_pv_tiles, smem_o_every) and 128-key tiles "
                             "(no long_tile)")

    @property
    def flags(self) -> int:
        """The run-time key of the option set (FwdOptions::flags(), set_fwd_flags)."""
        low = sum(1 << bit for name, bit in _LOW_BITS.items() if getattr(self, name))
        high = sum(1 << (_HIGH_SHIFT + bit) for name, bit in _HIGH_BITS.items() if getattr(self, name))
        return low | (self.smem_o_every << 7) | high

    @property
    def name(self) -> str:
        short = {"lean_softmax": "lean", "overlap_softmax_pv": "overlap", "pingpong": "pingpong",
                 "q_in_registers": "qregs", "split_reductions": "split",
                 "fp32_pv_tiles": "fp32pv"}
        parts = [v for k, v in short.items() if getattr(self, k)] or ["plain"]
        if self.smem_o_every:
            parts.append(f"smemo{self.smem_o_every}")
        parts += [v for k, v in _HIGH_SHORT.items() if getattr(self, k)]
        if self.exp2_poly_every:
            parts.append(f"exp2poly{self.exp2_poly_every}")
        return "_".join(parts)

    def cpp(self) -> str:
        """C++20 designated initializer of the same option set."""
        set_fields = [f".{f.name} = {str(getattr(self, f.name)).lower()}" for f in fields(self)
                      if getattr(self, f.name) != f.default]
        return "FwdOptions{" + ", ".join(set_fields) + "}"


# name parts of the high bools, in this order after smemo<N>
_HIGH_SHORT = {"epilogue_summary": "esum", "phase_clock": "clock",
               "epilogue_staged": "stage", "three_consumers": "wg3",
               "tc_row_sum": "tcsum", "tile_sums": "tilesum",
               "fused_rescale": "fusedrescale", "seeded_scores": "seeded", "long_tile": "long",
               "pv_16bit": "pv16"}

HEAD_DIMS = (64, 128)
DTYPES = {"fp16": "DType::kF16", "bf16": "DType::kBF16"}
CAUSAL = (False, True)


def read_policy(path: Path = POLICY, struct: str = "ShippedPolicy") -> dict[int, FwdOptions]:
    """``struct``<D>::kOptions of policy.hpp per head dim (its designated initializers; comments
    ignored): the shipped option sets, named there once (ShippedPolicy: the fast one, the default;
    AccuratePolicy: the accurate one)."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    policy = {}
    for d, body in re.findall(struct + r"<(\d+)> \{\s*static constexpr FwdOptions kOptions\{(.*?)\};", text, re.S):
        values = re.findall(r"\.(\w+) = (true|false|\d+),?", body)
        if len(values) != body.count("="):
            raise ValueError(f"{path.name}: {struct}<{d}>: only `.field = true/false/N` initializers: {body}")
        policy[int(d)] = FwdOptions(**{k: v == "true" if v in ("true", "false") else int(v) for k, v in values})
    if set(policy) != set(HEAD_DIMS):
        raise ValueError(f"{path.name}: {struct} for head dims {sorted(policy)}, expected {sorted(HEAD_DIMS)}")
    return policy


# The default options per head dim (the backend's choice: policy.hpp, one line of why per option;
# the measurements behind them follow). hd128: lean softmax, softmax / PV
# overlap, ping-pong, Q in registers, split reductions; hd64: the same without ping-pong and split
# reductions (both lost there), every exp2 on MUFU (with the per-tile fp32 sum the FMA pipes are
# busier: every 8th exp2 from the polynomial became 2-4 % slower, kernels_h200.md's
# ours_exp_mufu_only against ours at hd64). Neither lets O accumulate in
# the FP8 tensor core across all key tiles (O shrinks with the key count, kernel_fwd.cuh): hd64
# sums each tile in fp32 registers (fp32_pv_tiles); at hd128 that tile does not fit the register
# budget (it spills), so O's fp32 sum lives in smem and takes the accumulator every 4 tiles: within
# 1.4 % of the uncorrected speed at 16K, O within 0.3 % of its reference (int8_pv_accumulation_h200.md).
_HD128 = FwdOptions(lean_softmax=True, overlap_softmax_pv=True, pingpong=True, q_in_registers=True,
                    split_reductions=True)
_HD64 = FwdOptions(lean_softmax=True, overlap_softmax_pv=True, q_in_registers=True, exp2_poly_every=8)
# Decided on the H200 (variants_bench.py, attention kernel alone; eval/results/int8_variants_h200.md),
# each bit-identical to the option set before it:
# * epilogue_summary, both head dims: the epilogue skips V's per-channel non-finite lookup where the
#   pre-pass saw none: 1x24x4608x128 0.424 -> 0.379 ms, 1x24x16384x128 4.186 -> 4.023,
#   1x38x4429x64 0.495 -> 0.466, 1x48x17776x64 7.786 -> 7.491 (fixed cost per CTA 14.7 -> 8.6 us
#   at hd128, 7.2 -> 5.0 at hd64: int8_fixed_cost_h200.md).
# * epilogue_staged, both head dims: O packed into shared memory, rows written with 16-byte stores,
#   V's scales loaded before any store: the epilogue 5.2 -> 1.0 us per CTA (int8_phases_h200.md);
#   1x24x4608x128 0.383 -> 0.357 ms, 1x24x16384x128 4.061 -> 3.957.
# * hd64: three consumer warpgroups (192 query rows per CTA) without the softmax / PV overlap,
#   which does not fit their 160 registers; with the staged epilogue 1x38x4429x64 0.469 -> 0.422 ms,
#   1x48x17776x64 7.631 -> 7.482.
# * hd64: tc_row_sum (the row sums from the PV wgmma, N = 72; other bits: sage8_reference
#   row_sum="codes"): 1x38x4429x64 0.418 -> 0.408 ms, 1x48x17776x64 7.476 -> 7.013
#   (eval/results/int8_tcsum_h200.md). At hd128 it was 1.009x slower at both shapes, until the exact
#   softmax path (b0e984f: each warp votes per key tile on its rows' score scale) cost the fp32-sum
#   loop more than the tcsum loop: side by side on the H200 (int8_tcsum_h200.md, run of 5369e27)
#   the hd128 kernel with it 0.370 -> 0.360 ms at 1x24x4608x128, 4.243 -> 4.035 at 1x24x16384x128.
# * hd128: seeded_scores; hd64: fused_rescale (the benchmark build's notes below).
DEFAULTS = read_policy()
# The accurate policy per head dim (Precision::kAccurate): 16-bit P~ V (pv_16bit), measured in the
# benchmark build as the `pv16` variants (the notes on pv_16bit below).
ACCURATE = read_policy(struct="AccuratePolicy")
# Exp2 polynomial shares compiled besides the default (env SAGE_DIFFUSERS_EXP_POLY picks one).
EXTRA_EXP_POLY = {64: (8,), 128: ()}

# Benchmark build (env SAGE_DIFFUSERS_SM90_BENCH=1, bench/sm90_int8/binding_bench.cpp): bf16, non-causal. Per
# head dim: the defaults, the option set that accumulates O in the tensor core over all tiles
# (the previous default).
# Measured and dropped (eval/results/int8_pv_accumulation_h200.md): hd128's per-tile register
# sum (it spills), the smem sum at hd64, flushing every tile, and every 2 or 8 tiles.
# Measured and deleted (DESIGN.md): seed_reductions (no faster on the H200:
# eval/results/int8_variants_h200.md), fp16_exp2 (slower: eval/results/int8_latewait_h200.md),
# persistent (a persistent grid, one CTA per SM looping over the work tiles: no faster on the H200,
# eval/results/int8_variants_h200.md "persistent grid", int8_fixed_cost_h200.md), q_in_kernel (Q
# quantized inside the forward kernel, the pre-pass without Q: no faster in total, the whole call
# 0.557 against 0.561 ms at 1x24x4608x128; no LSE path; eval/results/int8_variants_h200.md) and late_pv_wait
# (the PV wait after the softmax's exp2, P packed after it; same bits: attention kernel 1.03x the
# defaults at hd128, 1.15x hd64's overlap loop on the H200, eval/results/int8_latewait_h200.md; on
# 192-key tiles 1.08x the defaults against 1.07x for the same loop without it on the H100,
# eval/results/int8_long_tile_ab_h100.md).
# Per head dim also: the defaults with phase_clock (timestamps at the phase points of each CTA:
# bench/int8_phases.py splits the fixed cost; two consumer warpgroups only, so hd128 only now); the
# defaults without the staged epilogue (the previous defaults); and without both epilogue options,
# the partner variants_bench.py compares the defaults with bit for bit (SAME_BITS_FLAGS strips
# epilogue_summary, epilogue_staged, three_consumers and phase_clock).
# hd64 also: the previous defaults (two consumer warpgroups with the softmax / PV overlap, which
# does not fit three warpgroups' 160 registers: 432 bytes of spills) and the defaults' loop on two
# warpgroups without either epilogue option (three_consumers' bit-identity partner).
# hd128 also: three consumer warpgroups (192 query rows per CTA) on the plain loop (no overlap, no
# ping-pong: both hold two P arrays, more than 160 registers) with O's smem sum flushed every tile
# (smem_o_every = 1: O's 64 registers are then dead through the softmax; with 2 or 4 the loop
# spills 192 B at 160 registers; eval/results/int8_three_consumers_sass.md "hd128"), and the same
# loop on two warpgroups without either epilogue option, its bit-identity partner. Q comes from
# shared memory there: with Q in registers ptxas (CUDA 13.0) gave Q's registers to the softmax and P
# inside this loop, so every tile after the first used garbage as Q (H200: cos 0.1 against the
# reference; sass_cost.py reports such a loop as MISCOMPILE; eval/results/int8_hd128_wg3_h200.md).
# Option changes the benchmark build makes to the defaults of each head dim, in this order; a
# change the defaults refuse (phase_clock with three_consumers) is left out (_bench_changed).
_BENCH_COMMON = ({"phase_clock": True}, {"epilogue_staged": False},
                 {"epilogue_summary": False, "epilogue_staged": False})
_HD128_WG3_LOOP = {"overlap_softmax_pv": False, "pingpong": False, "smem_o_every": 1, "q_in_registers": False}
# tc_row_sum (the row sums of P~ from the PV wgmma, N = D + 8 with ones rows after V^T: 64 FADDs per
# tile and thread fewer, 6 % / 12 % more PV tensor time at hd128 / hd64; other bits):
# the defaults of both head dims have it; the benchmark build has them without it (the previous defaults).
# tile_sums (hd128: tc_row_sum's sums, which share O's 4-tile accumulation in the FP8 wgmma and come
# out 2-3e-3 low in the LSE on DiT-like inputs, taken into fp32 after every tile;
# eval/results/gpu_tests_h200.md run 15): hd128's defaults with it. Not yet run on a GPU. SASS
# (sass_cost.py): 458 instructions per tile against the defaults' 430, sync/barrier 20 against 7
# (ptxas warns C7519 that it injected warpgroup.arrive before a GMMA that uses the zeroed
# accumulator registers), 0 spills.
# fused_rescale (hd64, whose default plain loop sums each tile in fp32: fp32_pv_tiles): O = alpha O +
# tile as one FFMA per value after the PV, instead of the warp's vote, O *= alpha before the PV
# (taken on ~60 % of tiles at 4K keys) and O += tile after it: the rescale leaves the path from the
# softmax to the PV issue. Where a row max moved, O is rounded once instead of twice (not the same
# bits); elsewhere fma(O, 1, tile) = O + tile exactly.
# hd64's defaults have it, decided on the H200 side by side with the previous defaults (the benchmark
# build's {"fused_rescale": False}): attention kernel 0.383 -> 0.373 ms at 1x38x4429x64, 6.414 -> 6.274
# at 1x48x17776x64 (eval/results/int8_fused_rescale_h200.md). The overlap loops it does not apply to
# are built without it.
# Measured and removed (eval/results/int8_fma_convert_h200.md): fma_convert (flag bit 1 << 23), the
# scores' int32 -> biased-float adds as IMADs with a kernel-parameter 1 on the FMA pipe, interleaved
# with the row max: bit-identical, 827 -> 764 static stall cycles per warp in hd128's softmax step,
# yet the attention kernel 1.008x / 1.036x slower at hd128 (4608 / 16384 keys) and 1.034x at 1x48x17776x64.
# seeded_scores (same bits): S accumulated onto the bits of 1.5 * 2^23, written into S's registers
# before each QK issue, instead of 64 VIADDs at the head of every tile's softmax (~13 % of hd128's
# stall samples). hd128's defaults have it, decided on the H200 side by side with the previous
# defaults (the benchmark build's {"seeded_scores": False}): attention kernel 0.359 -> 0.357 ms at
# 1x24x4608x128, 4.029 -> 3.990 at 1x24x16384x128 (eval/results/int8_seeded_scores_h200.md), though
# ptxas places the 64 register moves after the ping-pong turn's barrier, just before the wgmma
# issue. Loading S's registers from a 16-byte smem slot instead (16 volatile ld.shared.v4 before the
# waits, 391 instructions per tile against 430) was slower: 0.373 / 4.214 ms. At hd64 (the plain
# loop pays the moves in series) slower too: 1x48x17776x64 6.327 -> 6.501 ms; not built there.
# hd128's defaults without overlap_softmax_pv (ping-pong alone: S_t and PV_{t-1} issued in one turn, both
# retired before the softmax, so the P array of the PV in flight is dead when the next one is written):
# not yet run. It prices the intra-warpgroup overlap, which a longer key tile (192 keys with 64-key K
# scales, eval/results/int8_long_tile_accuracy_cpu.md) could not keep within 232 registers; the plain
# loop without either was 1.64x the defaults' kernel time at 1x24x4608x128 (int8_hd128_wg3_h200.md).
# And the defaults without pingpong (the overlap alone), the other half of that split; not yet run.
# long_tile (192-key tiles of three 64-key K scale blocks; sage8_reference(block_kv=192, k_block=64),
# at least as accurate as 128 / 128: eval/results/int8_long_tile_accuracy_cpu.md): S takes 96 registers
# per thread, so hd128's loops fit only with Q read from shared memory and the producer warpgroup at 24
# registers (consumers 240); with Q in registers every loop spills and ptxas serializes the wgmmas
# (C7512), as at 232 registers with Q in smem (eval/results/int8_long_tile_sass.md). With tc_row_sum
# (the defaults') the V^T stage holds three chunks of image rows and ones rows (three copies per tile)
# and the ring 2 stages (234 KB for 3); without it 3 stages. Loops: the defaults' (overlap + ping-pong)
# and ping-pong alone, each with and without tc_row_sum (the FA3 order, late_pv_wait, went with that
# option). sass_cost.py per 128 keys: 439 with tc_row_sum against the
# defaults' 430; 499-515 without against the same options on 128-key tiles' 497 (the per-key work is
# the same; fewer waits and barriers per key, 4 against 7). O's FP8 accumulator spans smem_o_every = 4
# tiles, 768 keys here against 512, before each fp32 flush: bench/pv_accumulation_model.py
# --mantissa-bits 10 (the H200's loss) gives O 0.44 % small on DiT-like inputs against 0.30 %; the
# defaults' loop also with smem_o_every = 2 (384 keys: 0.23 %, a flush per 2 tiles). variants_bench.py's
# accumulation check and the GPU test measure it. Not yet run on a GPU.
_LONG = {"long_tile": True, "q_in_registers": False}
# pv_16bit (the accuracy policy designed in eval/results/int8_error_budget_cpu.md, "The policy to
# build": P~ = p in bf16 times V in bf16 as given, fp32 accumulation; benchmark inputs rel-L1 ~0.012
# expected against 0.038; sage8_reference(pv="bf16")): each head dim's defaults with it, without what it
# replaces: tc_row_sum (the sums come from the softmax: the ones rows are FP8), and the FP8
# accumulator's workarounds smem_o_every (hd128), fp32_pv_tiles and fused_rescale (hd64). The pre-pass
# writes V as a 16-bit image (kPrepassV16Image), twice the FP8 one; the hd128 ring drops to 3 stages.
# hd128 fits the defaults' loop (overlap + ping-pong, Q in registers) only with the consumers at 240
# registers (at 232: 16 bytes of spills, wgmmas serialized); hd64: the defaults' three-consumer plain
# loop (160 registers, no spill). Measured on the H100 (eval/results/int8_pv16_ab_h100.md): rel-L1
# 0.0116 / 0.0110 against 0.0383; kernel 1.05x / 1.12x the defaults at hd128 (4608 / 16384 keys),
# 1.17x / 1.18x at hd64: policy.hpp's AccuratePolicy, kept here as the lab's partner of the defaults.
# Measured and deleted: hd128 with Q from smem (1.078x / 1.174x) and hd64's overlap loop on two
# warpgroups (1.274x / 1.297x).
_PV16 = {"pv_16bit": True, "tc_row_sum": False}
_BENCH_CHANGES = {
    128: (*_BENCH_COMMON,
          {**_HD128_WG3_LOOP, "three_consumers": True},
          {**_HD128_WG3_LOOP, "epilogue_summary": False, "epilogue_staged": False},
          {"tc_row_sum": False}, {"tile_sums": True}, {"seeded_scores": False},
          {"overlap_softmax_pv": False}, {"pingpong": False},
          _LONG, {**_LONG, "smem_o_every": 2}, {**_LONG, "overlap_softmax_pv": False}, {**_LONG, "tc_row_sum": False},
          {**_LONG, "tc_row_sum": False, "overlap_softmax_pv": False},
          {**_PV16, "smem_o_every": 0}),
    64: (*_BENCH_COMMON,
         {"three_consumers": False, "epilogue_staged": False, "overlap_softmax_pv": True, "fused_rescale": False},
         {"three_consumers": False, "epilogue_summary": False, "epilogue_staged": False},
         {"tc_row_sum": False}, {"fused_rescale": False},
         {**_PV16, "fp32_pv_tiles": False, "fused_rescale": False}),
}
_UNCORRECTED = {128: _HD128, 64: _HD64}
# Options refused together at one head dim (fwd_kernel static_asserts the same): at hd128 the
# overlapped loop's two P arrays do not fit three consumer warpgroups' 160 registers.
_HEAD_DIM_EXCLUSIVE = {128: (("three_consumers", "overlap_softmax_pv"),)}


def _checked(d: int, opt: FwdOptions) -> FwdOptions:
    """opt, after checking that the kernel implements its options together at head dim d."""
    for a, b in _HEAD_DIM_EXCLUSIVE.get(d, ()):
        if getattr(opt, a) and getattr(opt, b):
            raise ValueError(f"{opt}: {a} with {b} is not implemented at head dim {d}")
    return opt


def _bench_changed(d: int):
    """The defaults of head dim d with each of its benchmark changes the defaults support: a change
    an option of the defaults refuses (e.g. phase_clock once three_consumers is a default) is left
    out rather than failing the generator."""
    for c in _BENCH_CHANGES[d]:
        try:
            yield replace(DEFAULTS[d], **c)
        except ValueError:
            continue


# dict.fromkeys: a change the defaults already have names the defaults once (one file, one table row)
BENCH_VARIANTS = tuple(dict.fromkeys(
    (d, _checked(d, opt)) for d in (128, 64) for opt in (DEFAULTS[d], _UNCORRECTED[d], *_bench_changed(d))))


def variants():
    """(head dim, dtype name, C++ dtype, causal, options) of the regular build: the fast policy with
    each compiled exp2 share, then the accurate one (its own exp2 share only)."""
    for d, (dt, cpp_dt), causal in itertools.product(HEAD_DIMS, DTYPES.items(), CAUSAL):
        for poly in (*EXTRA_EXP_POLY[d], DEFAULTS[d].exp2_poly_every):
            yield d, dt, cpp_dt, causal, _checked(d, replace(DEFAULTS[d], exp2_poly_every=poly))
        yield d, dt, cpp_dt, causal, _checked(d, ACCURATE[d])


_HEADER = "// Generated by generate_instantiations.py: do not edit.\n"


def _write_instantiation(path: Path, args: str, includes: tuple[str, ...]) -> None:
    """One .cu file instantiating launch_fwd<args> after includes (the benchmark build's files, outside
    csrc/, find kernel_fwd.cuh through its -I csrc/sm90_int8)."""
    path.write_text(
        _HEADER + "".join(f'#include "{inc}"\n' for inc in includes) + "\n"
        "namespace sage_sm90 {\n"
        f"template cudaError_t launch_fwd<{args}>(const FwdParams&, cudaStream_t, bool);\n"
        "}  // namespace sage_sm90\n"
    )


def _shipped_cpp(d: int, opt: FwdOptions) -> str:
    """The C++ expression of a shipped option set: policy.hpp's name for it (with another exp2
    polynomial share: with_exp2_poly)."""
    if opt == ACCURATE[d]:
        return f"AccuratePolicy<{d}>::kOptions"
    name = f"ShippedPolicy<{d}>::kOptions"
    if opt == DEFAULTS[d]:
        return name
    if opt != replace(DEFAULTS[d], exp2_poly_every=opt.exp2_poly_every):
        raise ValueError(f"{opt}: not head dim {d}'s shipped policy")
    return f"with_exp2_poly({name}, {opt.exp2_poly_every})"


def _suffix(d: int, opt: FwdOptions) -> str:
    """The file name's tail after the causal part: the accurate policy, or the fast one's exp2 share."""
    if opt == ACCURATE[d]:
        return "_accurate"
    return f"_exp2poly{opt.exp2_poly_every}" if opt.exp2_poly_every else ""


def _row_sum(opt: FwdOptions) -> str:
    """sage8_reference's ``row_sum`` for the numerics of these options."""
    return "codes" if opt.tc_row_sum else "p"


def _reference_kwargs(opt: FwdOptions) -> dict:
    """sage8_reference's keyword arguments, beyond row_sum, for the numerics of a benchmark variant
    (bf16 inputs): long_tile's 192-key tiles of 64-key K blocks, pv_16bit's 16-bit P~ V."""
    kw: dict = {}
    if opt.long_tile:
        kw.update(block_kv=192, k_block=64)
    if opt.pv_16bit:
        kw.update(pv="bf16")
    return kw


def main() -> None:
    out = HERE / "instantiations"
    out.mkdir(exist_ok=True)
    BENCH_OUT.mkdir(exist_ok=True)
    for old in [*out.glob("fwd_*.cu"), *BENCH_OUT.glob("bench_*.cu")]:
        old.unlink()
    table = []
    for d, dt, cpp_dt, causal, opt in variants():
        args = f"{d}, {cpp_dt}, {'true' if causal else 'false'}, {_shipped_cpp(d, opt)}"
        _write_instantiation(out / f"fwd_hd{d}_{dt}_{'causal' if causal else 'full'}{_suffix(d, opt)}.cu", args,
                             ("../kernel_fwd.cuh", "../policy.hpp"))
        table.append(f"SAGE_SM90_VARIANT({d}, {cpp_dt}, {'true' if causal else 'false'}, ({_shipped_cpp(d, opt)}))")
    (out / "variants.inc").write_text(_HEADER + "\n".join(table) + "\n")
    bench = []
    for d, opt in BENCH_VARIANTS:
        args = f"{d}, DType::kBF16, false, {opt.cpp()}"
        _write_instantiation(BENCH_OUT / f"bench_hd{d}_{opt.name}.cu", args, ("kernel_fwd.cuh",))
        bench.append(f"SAGE_SM90_VARIANT({d}, DType::kBF16, false, ({opt.cpp()}))")
    (BENCH_OUT / "variants_bench.inc").write_text(_HEADER + "\n".join(bench) + "\n")
    names = {o.flags: replace(o, exp2_poly_every=0).name
             for o in [*DEFAULTS.values(), *ACCURATE.values(), *(o for _, o in BENCH_VARIANTS)]}
    reference = {o.flags: _reference_kwargs(o) for _, o in BENCH_VARIANTS if _reference_kwargs(o)}
    PY_OUT.write_text(
        '"""Generated by csrc/sm90_int8/generate_instantiations.py: do not edit.\n\n'
        "The 8-bit kernel's compiled variants and defaults, from the same source as the C++ dispatch\n"
        'tables (csrc/sm90_int8/instantiations/variants.inc, bench/sm90_int8/instantiations/variants_bench.inc)."""\n'
        f"# exp2 polynomial share of the default options per head dim\n"
        f"DEFAULT_EXP_POLY = {{{', '.join(f'{d}: {o.exp2_poly_every}' for d, o in sorted(DEFAULTS.items()))}}}\n"
        f"# run-time flags (FwdOptions::flags()) of the default options per head dim\n"
        f"DEFAULT_FLAGS = {{{', '.join(f'{d}: {o.flags}' for d, o in sorted(DEFAULTS.items()))}}}\n"
        f"# sage8_reference's row_sum that the default options compute (\"codes\": tc_row_sum)\n"
        f"DEFAULT_ROW_SUM = {{{', '.join(f'{d}: {chr(39)}{_row_sum(o)}{chr(39)}' for d, o in sorted(DEFAULTS.items()))}}}\n"
        f"# the accurate policy (16-bit P~ V, Precision::kAccurate) per head dim: its run-time flags and exp2 share\n"
        f"ACCURATE_FLAGS = {{{', '.join(f'{d}: {o.flags}' for d, o in sorted(ACCURATE.items()))}}}\n"
        f"ACCURATE_EXP_POLY = {{{', '.join(f'{d}: {o.exp2_poly_every}' for d, o in sorted(ACCURATE.items()))}}}\n"
        f"# exp2 polynomial shares the regular build compiles per head dim (the fast policy)\n"
        f"COMPILED_EXP_POLY = {{{', '.join(f'{d}: {tuple(sorted({*EXTRA_EXP_POLY[d], DEFAULTS[d].exp2_poly_every}))}' for d in HEAD_DIMS)}}}\n"
        f"# benchmark build: (head dim, exp2 polynomial share, flags, name)\n"
        f"BENCH_VARIANTS = {tuple((d, o.exp2_poly_every, o.flags, o.name) for d, o in BENCH_VARIANTS)!r}\n"
        f"# option-set name per run-time flags\n"
        f"FLAG_NAMES = {dict(sorted(names.items()))!r}\n"
        f"# sage8_reference's keyword arguments for the benchmark variants whose numerics differ from the\n"
        f"# defaults' beyond row_sum: block_kv / k_block (long_tile), pv (pv_16bit, in the build's bf16)\n"
        f"REFERENCE_KWARGS = {dict(sorted(reference.items()))!r}\n"
    )


if __name__ == "__main__":
    main()
