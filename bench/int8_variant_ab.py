#!/usr/bin/env python3
"""Side-by-side timing of chosen 8-bit kernel variants (benchmark build) against cuDNN BF16 SDPA.

For each shape and each named option set of the benchmark build (generate_instantiations
BENCH_VARIANTS, named as there: the option set, then ``exp2poly<N>`` where N > 0; ``default`` = the shipped
defaults of that head dim): the full call (pre-pass + kernel + host work, L2 flushed, the timer of
eval/bench_kernels.py, ``_timing.compare_ms``) and the attention kernel alone
(``ext.bench_parts``), both over ``--rounds`` rounds with the methods in a new order every round;
median [min-max] over the rounds. Before timing, every variant's output is compared with the
default's (bit for bit, and cosine), with ``sage8_reference`` of the variant's numerics
(REFERENCE_KWARGS: long_tile's tiles, pv_16bit's 16-bit P~ V) on the first two heads, and with fp32
SDPA on every head (cos, rel-L1: what a variant buys in accuracy; cuDNN's bf16 output too).

    SAGE_DIFFUSERS_SM90_BENCH=1 python bench/int8_variant_ab.py \\
        --variants lean_overlap_qregs_split_smemo4_esum_stage_tcsum_seeded --out eval/results/x.md
    SAGE_DIFFUSERS_SM90_BENCH=1 python bench/int8_variant_ab.py --variants pv16 --out eval/results/x.md

``--variants pv16`` (or any name part, e.g. ``long``) names every variant whose option-set name has
that part.

``--prepass-modes N...`` adds the defaults under other pre-pass modes (launch.h kPrepass* bit sets),
named ``prepass mN``; the pre-pass alone (``ext.bench_parts``) is timed for every entry.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("SAGE_DIFFUSERS_SM90_BENCH", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_utils import make_inputs  # noqa: E402
from eval import _cli  # noqa: E402
from sage_diffusers.kernels import _sm90_int8_variants as variants  # noqa: E402
from sage_diffusers.kernels._timing import compare_ms, spread  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1, sage8_reference  # noqa: E402

SHAPES = [(1, 24, 4608, 128), (1, 24, 16384, 128), (1, 38, 4429, 64), (1, 48, 17776, 64)]


def _flags_by_name() -> dict[tuple[int, str], tuple[int, int]]:
    """(head dim, variant name) -> (run-time flags, exp2 polynomial share) of the benchmark build."""
    return {(d, name): (flags, poly) for d, poly, flags, name in variants.BENCH_VARIANTS}


def _expand(requested: list[str], names: list[str]) -> list[str]:
    """The variant names requested: each a full name, or a name part (e.g. ``pv16``) standing for every
    name that has it; unknown entries are returned as they are (the caller refuses them)."""
    out = []
    for r in requested:
        parts = [n for n in names if r in n.split("_")] if r not in names else [r]
        out += parts or [r]
    return list(dict.fromkeys(out))


def _fp32_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of the inputs in float32 (B, H, S, D), on the memory-efficient kernel (its fp32 path keeps
    fp32 accuracy; the math fallback would build the whole score matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


def _fmt(xs: list[float]) -> str:
    t = spread(xs)
    return f"{t['median']:.3f} [{t['min']:.3f}-{t['max']:.3f}]"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=[],
                    help="option-set names (either head dim), or name parts (pv16: every pv_16bit variant)")
    ap.add_argument("--prepass-modes", nargs="*", type=_cli.nonnegative_int, default=[],
                    help="pre-pass mode bit sets to run the defaults under (launch.h kPrepass*)")
    ap.add_argument("--rounds", type=_cli.positive_int, default=5)
    ap.add_argument("--reps", type=_cli.positive_int, default=20, help="launches per bench_parts sample")
    ap.add_argument("--shapes", default="all", choices=("all", "quick"))
    ap.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = ap.parse_args(argv)
    names = sorted({name for _, name in _flags_by_name()})
    args.variants = _expand(args.variants, names)
    unknown = [n for n in args.variants if n not in names]
    if unknown:  # otherwise they are skipped at every shape and the table holds the defaults only
        ap.error(f"--variants {', '.join(unknown)}: unknown; known: {', '.join(names)}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (sm_90)")
    from sage_diffusers.kernels import int8_sm90

    t0 = time.time()
    ext = int8_sm90.build()
    known = _flags_by_name()
    mode0 = ext.prepass_mode()
    lines = [f"# 8-bit kernel variants side by side ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. Full call: median of per-call "
             f"times with L2 flushed (compare_ms), {args.rounds} rounds, order redrawn every round; kernel: "
             f"ext.bench_parts ({args.reps} back-to-back launches) in the same round scheme, and the "
             f"pre-pass alone the same way (its launches and workspace memsets). Pre-pass mode {mode0} unless "
             "named (prepass mN). "
             "Bits / cos: against the default's output; cos ref: against sage8_reference of the variant's "
             "numerics (first two heads); fp32: against fp32 SDPA of the same bf16 inputs (every head).", "",
             "| shape | variant | full ms | kernel ms | pre-pass ms | vs cuDNN (full) | kernel / default kernel | "
             "bits = default | cos | cos ref | cos fp32 | rel-L1 fp32 |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    shapes = SHAPES if args.shapes == "all" else SHAPES[:1] + SHAPES[2:3]
    for (b, h, s, d) in shapes:
        chosen = {"default": (variants.DEFAULT_FLAGS[d], int8_sm90.default_exp_poly_every(d), mode0)}
        for name in args.variants:
            if (d, name) in known:
                chosen[name] = (*known[(d, name)], mode0)
        for m in args.prepass_modes:
            chosen[f"prepass m{m}"] = (*chosen["default"][:2], m)
        if len(chosen) == 1:
            continue
        q, k, v = make_inputs(b, h, s, d)

        def call(variant):
            flags, poly, mode = variant
            ext.set_fwd_flags(flags)
            ext.set_prepass_mode(mode)
            return ext.fwd(q, k, v, None, False, d ** -0.5, False, poly)[0]

        base = call(chosen["default"])
        exact = _fp32_sdpa(q, k, v)  # every head
        refs = {}  # sage8_reference of each variant's numerics (REFERENCE_KWARGS: long_tile's tiles, pv_16bit's pv)
        checks = {}
        for name, variant in chosen.items():
            out = call(variant)
            kw = variants.REFERENCE_KWARGS.get(variant[0], {})
            key = tuple(sorted(kw.items()))
            if key not in refs:
                refs[key] = sage8_reference(q[:, :2].float(), k[:, :2].float(), v[:, :2].float(), **kw).float()
            ref = refs[key]
            checks[name] = (torch.equal(out.view(torch.int16), base.view(torch.int16)),
                            cosine(out.float(), base.float()), cosine(out[:, :2].float(), ref),
                            relative_l1(out[:, :2].float(), ref), cosine(out.float(), exact),
                            relative_l1(out.float(), exact))
        methods = {name: (lambda c=variant: call(c)) for name, variant in chosen.items()}

        def cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        methods["cudnn"] = cudnn
        out_cudnn = cudnn().float()
        acc_cudnn = (cosine(out_cudnn, exact), relative_l1(out_cudnn, exact))
        out_cudnn = exact = None
        full = compare_ms(methods, lambda: (), args.rounds)
        def part_ms(variant, part):  # 0: the pre-pass, 1: the attention kernel; its own timer
            flags, poly, mode = variant
            ext.set_fwd_flags(flags)
            ext.set_prepass_mode(mode)
            return ext.bench_parts(q, k, v, False, poly, args.reps)[part]

        kern, pre = (compare_ms({name: (lambda c=variant, i=part: part_ms(c, i)) for name, variant in chosen.items()},
                                lambda: (), args.rounds, sample=lambda fn, _calls: fn()) for part in (1, 0))
        ext.set_fwd_flags(-1)
        ext.set_prepass_mode(mode0)
        tag = f"{b}x{h}x{s}x{d}"
        t_cudnn = statistics.median(full["cudnn"])
        k_def = statistics.median(kern["default"])
        lines.append(f"| {tag} | cuDNN bf16 | {_fmt(full['cudnn'])} | - | - | 1.00 | - | - | - | - | "
                     f"{acc_cudnn[0]:.6f} | {acc_cudnn[1]:.4f} |")
        for name in chosen:
            same, c, cref, l1, c32, l1_32 = checks[name]
            lines.append(f"| {tag} | {name} | {_fmt(full[name])} | {_fmt(kern[name])} | {_fmt(pre[name])} | "
                         f"{t_cudnn / statistics.median(full[name]):.3f} | "
                         f"{statistics.median(kern[name]) / k_def:.3f} | {'yes' if same else 'no'} | "
                         f"{c:.6f} | {cref:.6f} (rel-L1 {l1:.4f}) | {c32:.6f} | {l1_32:.4f} |")
        print("\n".join(lines[-len(chosen) - 1:]), flush=True)
        q = k = v = base = ref = None
        torch.cuda.empty_cache()
    lines += ["", f"Total {time.time() - t0:.0f} s (build included)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
