#!/usr/bin/env python3
"""Time the forward-kernel variants side by side against cuDNN BF16 SDPA (one GPU, one process).

Builds the benchmark extension (env SAGE_DIFFUSERS_SM90_BENCH=1: bf16 non-causal variants listed in
generate_instantiations.BENCH_VARIANTS, options explained in csrc/sm90_int8/DESIGN.md), checks every variant and
both pre-pass modes against sage8_reference on small awkward shapes (key mask included), then per
timed shape and variant (the phase_clock, epilogue_summary and epilogue_staged variants are also
compared bit for bit with the flags without them, V with and without +-Inf / NaN: bit_identity_check):
  full  : median of the whole call (pre-pass + kernel + host work), synchronised per repetition
          (the convention of eval/bench_kernels.py, host latency included like cuDNN's);
  main  : the attention kernel alone, back-to-back launches (ext.bench_parts);
and per shape, with the default variant: the pre-pass alone (GPU time) in modes PRE_MODES (launch.h
kPrepass* bits: 1 = Q quantized inside the stats launch, 2 = batched loads, 8 = programmatic
dependent launches, 16 = L2 reuse of K and V, 32 = one reciprocal per scale; bit 4 = one workspace
allocation is host-only), the full call in modes FULL_MODES, and the full call pipelined (20 calls between two events, no sync) in modes 0, 7 and
15: full - pipelined ~ host latency per call. The correctness check runs every variant in mode 0
and in mode 15. Per variant, "pre ms" is the pre-pass alone as that variant needs it.
Before the timing, --accuracy runs every variant on long sequences (16K-131K tokens) against
sage8_reference and fp32 SDPA (accumulation_check). A compact table comes last (the device log
keeps only its tail).

    python bench/sm90_int8/variants_bench.py [--reps 20] [--shapes all|quick] [--accuracy all|quick|none]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# --default: time only the shipped option sets (the defaults, which the benchmark build holds too: the
# shipped build has no bench_parts or mode switch) instead of every benchmark variant
DEFAULT_ONLY = "--default" in sys.argv
os.environ["SAGE_DIFFUSERS_SM90_BENCH"] = "1"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_utils import event_median_ms, make_inputs, pipelined_ms  # noqa: E402
from sage_diffusers.kernels import _sm90_int8_variants as _variants  # noqa: E402
from sage_diffusers.kernels import int8_sm90  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1, sage8_reference  # noqa: E402

SHAPES = [(1, 24, 4608, 128), (1, 38, 4429, 64), (2, 24, 4096, 128), (1, 24, 16384, 128),
          (1, 48, 17776, 64)]
QUICK_SHAPES = [(1, 24, 4608, 128), (1, 38, 4429, 64), (1, 24, 16384, 128), (1, 48, 17776, 64)]
NAMES = {-1: "default", **_variants.FLAG_NAMES}  # run-time flags -> option-set name
DEFAULT_FLAGS = _variants.DEFAULT_FLAGS
# long sequences for the P V accumulation check (accumulation_check)
ACC_SHAPES = [(1, 4, 16384, 128), (1, 8, 17776, 64), (1, 2, 65536, 128), (1, 4, 65536, 64),
              (1, 1, 131072, 128)]
ACC_QUICK_SHAPES = [(1, 4, 16384, 128), (1, 8, 17776, 64), (1, 1, 65536, 128)]
PDL_MODE = 15  # mode 7 + bit 8 (launch.h kPrepassPdl): the quant launch and the forward kernel start with PDL
# bits 16 / 32 (launch.h kPrepassL2Reuse / kPrepassFastDiv): L2 eviction hints + reversed K/V order,
# one reciprocal per scale; 55 = 7 + both, 63 = every bit
CHECK_MODES = (1, 2, 3, 4, 7, 8, PDL_MODE, 16, 32, 55, 63)  # pre-pass mode bit sets checked against the reference
FULL_MODES = (0, 3, 4, 7, 14, PDL_MODE, 23, 39, 55, 63)     # full-call timings (per-repetition sync)
PRE_MODES = (0, 1, 2, 3, 11, 19, 35, 51, 59)                # pre-pass alone (bench_parts)




def time_ms(fn, reps):
    """Median of per-repetition event times, synchronised after each (host latency included)."""
    return event_median_ms(fn, reps)


def time_pipelined_ms(fn, n=20):
    """Mean time of n back-to-back calls between two events (host work overlaps the GPU)."""
    return pipelined_ms(fn, n, warmup=1)


# FwdOptions bits that must change no output bit (launch.h): phase_clock, epilogue_summary,
# epilogue_staged, three_consumers (only the rows' grouping into CTAs changes)
SAME_BITS_FLAGS = (1 << 14) | (1 << 15) | (1 << 17) | (1 << 18)


def bit_identity_check(variants, run, ext=None):
    """Each variant with phase_clock, epilogue_summary or epilogue_staged against the same flags
    without any of them (a staged variant with the summary thus against the unstaged lookup path), bit
    for bit, with and without a key mask, on V without and with +-Inf / NaN (one channel with both
    infinities, a NaN, a lone Inf, and a NaN on a masked key, which must vanish), in pre-pass modes
    0 and 7 (separate tensors / one workspace: both carve v_summary; ext None: the current mode
    only). Returns failures."""
    bad = 0
    for mode in ((0, 7) if ext is not None else (None,)):
        if mode is not None:
            ext.set_prepass_mode(mode)
        bad += _bit_identity_once(variants, run, mode)
    if ext is not None:
        ext.set_prepass_mode(0)
    return bad


def _bit_identity_once(variants, run, mode):
    bad = 0
    compiled = {(d, poly, flags) for d, poly, flags in variants}
    for d in (64, 128):
        q, k, v = make_inputs(2, 3, 1023, d, seed=2)
        mask = torch.ones(2, 1023, dtype=torch.bool, device="cuda")
        mask[1, 600:] = False
        v_bad = v.clone()
        v_bad[0, 1, 100, 5], v_bad[0, 1, 300, 5] = float("inf"), float("-inf")
        v_bad[1, 2, 500, d - 1], v_bad[1, 0, 7, 0] = float("nan"), float("inf")
        v_bad[1, 1, 700, 3] = float("nan")  # a masked key: no output sees it
        for dd, poly, flags in variants:
            base = flags & ~SAME_BITS_FLAGS
            if dd != d or base == flags or (d, poly, base) not in compiled:
                continue
            for label, vv in (("finite V", v), ("V with Inf/NaN", v_bad)):
                for m in (None, mask):
                    got, want = run(q, k, vv, poly, flags, mask=m), run(q, k, vv, poly, base, mask=m)
                    ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
                    if vv is v_bad:  # the non-finite values reach the output (else this proves little)
                        ok &= bool(torch.isinf(got[0, 1, :, 5]).any() or torch.isnan(got[0, 1, :, 5]).any())
                    bad += not ok
                    if not ok:
                        print(f"BAD bit identity d={d} {NAMES.get(flags, flags)} vs {NAMES.get(base, base)} "
                              f"{label} mask={m is not None} prepass={mode}", flush=True)
    return bad


def accumulation_check(variants, run, shapes):
    """Each variant on long sequences, against sage8_reference (same quantization, fp32 sums)
    and against fp32 SDPA, on two inputs: the benchmark's (SageAttention2's accuracy bound is
    stated on them) and DiT-like ones with a per-channel Q and V bias, where O is large against
    each key tile's share and low-precision accumulation of P V shows as a norm ratio below 1."""
    print("| shape | inputs | variant | cos vs ref | rel-L1 vs ref | |out|/|ref| | cos vs fp32 | "
          "rel-L1 vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for (b, h, s, d) in shapes:
        for label, bias in (("bench", {}), ("dit", {"q_bias": 1.0, "v_bias": 0.5})):
            q, k, v = make_inputs(b, h, s, d, seed=3, **bias)
            qf, kf, vf = q.float(), k.float(), v.float()
            refs = {}  # per variant numerics (REFERENCE_KWARGS: long_tile's 192 / 64, pv_16bit's pv), once each
            exact = F.scaled_dot_product_attention(qf, kf, vf)
            for dd, poly, flags in variants:
                if dd != d:
                    continue
                kw = _variants.REFERENCE_KWARGS.get(flags, {})
                key = tuple(sorted(kw.items()))
                if key not in refs:
                    refs[key] = sage8_reference(qf, kf, vf, **kw).float()
                ref = refs[key]
                out = run(q, k, v, poly, flags).float()
                print(f"| {b}x{h}x{s}x{d} | {label} | {NAMES.get(flags, flags)}/p{poly} | "
                      f"{cosine(out, ref):.6f} | {relative_l1(out, ref):.4f} | "
                      f"{(out.norm() / ref.norm()).item():.4f} | {cosine(out, exact):.6f} | "
                      f"{relative_l1(out, exact):.4f} |", flush=True)
            q = k = v = qf = kf = vf = ref = refs = exact = out = None
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", choices=("all", "quick"), default="all")
    ap.add_argument("--default", action="store_true")
    ap.add_argument("--accuracy", choices=("all", "quick", "none"), default="quick",
                    help="long-sequence accuracy of every variant (accumulation_check)")
    args = ap.parse_args()
    t0 = time.time()
    ext = int8_sm90.build()
    print(f"bench build/load {time.time() - t0:.0f} s", flush=True)
    if DEFAULT_ONLY:
        variants = [(d, _variants.DEFAULT_EXP_POLY[d], _variants.DEFAULT_FLAGS[d]) for d in (64, 128)]
    else:  # (d, poly, flags) of the benchmark build (generate_instantiations.BENCH_VARIANTS)
        variants = [(d, poly, flags) for d, poly, flags, _ in _variants.BENCH_VARIANTS]
    has_modes = hasattr(ext, "set_prepass_mode")

    def run(q, k, v, poly, flags, mask=None):
        ext.set_fwd_flags(flags)
        return ext.fwd(q, k, v, mask, False, q.shape[-1] ** -0.5, False, poly)[0]

    def default_variant(d):
        if DEFAULT_ONLY:
            return int8_sm90.default_exp_poly_every(d), -1
        return int8_sm90.default_exp_poly_every(d), DEFAULT_FLAGS[d]

    # ---- correctness vs the reference (small, awkward, with and without a key mask) ----
    bad = 0
    for d in (64, 128):
        for (b, h, s) in ((1, 2, 1023), (2, 3, 4097)):
            q, k, v = make_inputs(b, h, s, d, seed=1)
            mask = torch.rand(b, s, device="cuda") > 0.2
            mask[:, :5] = True
            # the last batch row sees only its first third: key-tile counts differ between its CTAs
            mask[-1, s // 3:] = False
            # per variant numerics (REFERENCE_KWARGS: long_tile's 192-key tiles of 64-key K blocks, pv_16bit's
            # 16-bit P~ V) and mask
            refs = {(key, masked): sage8_reference(q.float(), k.float(), v.float(), key_mask=mask if masked else None,
                                                   **dict(key)).float()
                    for key in {tuple(sorted(t.items())) for t in (*_variants.REFERENCE_KWARGS.values(), {})}
                    for masked in (False, True)}
            # every variant in mode 0 and launched with PDL (its pdl_wait guards the pre-pass outputs)
            cases = [(poly, flags, mode) for dd, poly, flags in variants if dd == d
                     for mode in ((0, PDL_MODE) if has_modes else (0,))]
            if has_modes:
                cases += [(*default_variant(d), mode) for mode in CHECK_MODES]
            for poly, flags, mode in cases:
                if has_modes:
                    ext.set_prepass_mode(mode)
                for masked in (False, True):
                    out = run(q, k, v, poly, flags, mask=mask if masked else None)
                    c = cosine(out.float(), refs[(tuple(sorted(_variants.REFERENCE_KWARGS.get(flags, {}).items())), masked)])
                    ok = c >= 0.9999 and torch.isfinite(out).all().item()
                    bad += not ok
                    if not ok:
                        print(f"BAD ref d={d} {b}x{h}x{s} mask={masked} poly={poly} "
                              f"{NAMES.get(flags, flags)} prepass={mode}: cos={c:.6f}", flush=True)
            if has_modes:
                ext.set_prepass_mode(0)
    bad += bit_identity_check(variants, run, ext if has_modes else None)
    ext.set_fwd_flags(-1)
    print(f"correctness failures: {bad} ({time.time() - t0:.0f} s)", flush=True)

    if args.accuracy != "none":
        accumulation_check(variants, run, ACC_SHAPES if args.accuracy == "all" else ACC_QUICK_SHAPES)
        ext.set_fwd_flags(-1)
        print(f"accuracy check done ({time.time() - t0:.0f} s)", flush=True)

    # ---- timing ----
    from torch.nn.attention import SDPBackend, sdpa_kernel
    summary = []
    print("| shape | variant | poly | full ms | main ms | pre ms | TOPS(full) | vs cuDNN | cos vs base | bits = base |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    shapes = SHAPES if args.shapes == "all" else QUICK_SHAPES
    for (b, h, s, d) in shapes:
        q, k, v = make_inputs(b, h, s, d)
        flops = 4 * b * h * s * s * d
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = time_ms(lambda: F.scaled_dot_product_attention(q, k, v), args.reps)
        tag = f"{b}x{h}x{s}x{d}"
        print(f"| {tag} | cuDNN bf16 | - | {t_cudnn:.3f} | - | - | {flops / t_cudnn / 1e9:.0f} | 1.00 | - | - |", flush=True)
        base = run(q, k, v, *default_variant(d)).float()
        best = None
        for dd, poly, flags in variants:
            if dd != d:
                continue
            out = run(q, k, v, poly, flags)
            c = cosine(out.float(), base)
            same = torch.equal(out.float(), base)
            t = time_ms(lambda: run(q, k, v, poly, flags), args.reps)
            ext.set_fwd_flags(flags)
            t_pre, t_main = ext.bench_parts(q, k, v, False, poly, args.reps)
            name = f"{NAMES.get(flags, flags)}/p{poly}"
            print(f"| {tag} | {NAMES.get(flags, flags)} | {poly} | {t:.3f} | {t_main:.3f} | {t_pre:.3f} | "
                  f"{flops / t / 1e9:.0f} | {t_cudnn / t:.2f} | {c:.6f} | {'yes' if same else 'no'} |", flush=True)
            if best is None or t_main < best[2]:
                best = (name, t, t_main)
        # pre-pass modes, pipelined call, with the default variant
        poly, flags = default_variant(d)
        ext.set_fwd_flags(flags)
        row = {"shape": tag, "cudnn": t_cudnn, "best": best, "full": {}, "pre": {}, "pipe": {}}
        for mode in (FULL_MODES if has_modes else (0,)):
            if has_modes:
                ext.set_prepass_mode(mode)
            row["full"][mode] = time_ms(lambda: run(q, k, v, poly, flags), args.reps)
            if mode in (0, 7, 15):
                row["pipe"][mode] = time_pipelined_ms(lambda: run(q, k, v, poly, flags))
        for mode in (PRE_MODES if has_modes else (0,)):
            if has_modes:
                ext.set_prepass_mode(mode)
            row["pre"][mode], main_ms = ext.bench_parts(q, k, v, False, poly, args.reps)
            row.setdefault("main", main_ms)
        if has_modes:
            ext.set_prepass_mode(0)
        print(f"| {tag} | default | {poly} | " + ", ".join(
            f"full m{m} {t:.3f}" for m, t in row["full"].items()) + " | " + ", ".join(
            f"pre m{m} {t:.3f}" for m, t in row["pre"].items()) + f" | main {row['main']:.3f} | " +
            ", ".join(f"pipelined m{m} {t:.3f}" for m, t in row["pipe"].items()) + " |", flush=True)
        summary.append(row)
        q = k = v = base = None  # free before the next shape (lambdas above close over them)
    ext.set_fwd_flags(-1)

    nan = float("nan")
    print(f"\n== summary (ms; x = cuDNN / ours; m = pre-pass mode bits, launch.h; total "
          f"{time.time() - t0:.0f} s, correctness failures {bad})")
    print("| shape | cuDNN | full m0 | x | full m7 | x | full m15 | x | full m55 | x | best m | main | " +
          " | ".join(f"pre m{m}" for m in PRE_MODES) + " | pipe m0 | pipe m7 | pipe m15 | best main (variant) |")
    print("|---" * (16 + len(PRE_MODES)) + "|")
    for r in summary:
        full = [r["full"].get(m, nan) for m in (0, 7, 15, 55)]
        bm = min(r["full"], key=r["full"].get)
        pre = [r["pre"].get(m, nan) for m in PRE_MODES]
        pipe = [r["pipe"].get(m, nan) for m in (0, 7, 15)]
        print(f"| {r['shape']} | {r['cudnn']:.3f} | " + " | ".join(f"{f:.3f} | {r['cudnn'] / f:.2f}" for f in full) +
              f" | {bm} | {r['main']:.3f} | " + " | ".join(f"{x:.3f}" for x in (*pre, *pipe)) +
              f" | {r['best'][2]:.3f} ({r['best'][0]}) |")


if __name__ == "__main__":
    main()
