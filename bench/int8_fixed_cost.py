"""Per-CTA fixed cost of the sm_90a 8-bit attention kernel: how much of a CTA's time does not scale
with its key count (launch, Q load, pipeline fill, the loop's first and last tile, epilogue).

The kernel runs one CTA (128 query rows of one head) per SM at a time, so with W = ceil(CTAs / SMs)
waves and n = ceil(Skv / 128) key tiles per CTA its time is about W (F + n c). This times the
attention kernel alone (``ext.bench_parts``, back-to-back launches, pre-pass excluded) at a fixed
query length over several key lengths and fits F (us per CTA) and c (us per key tile) by least
squares, per compiled variant of the benchmark build (``SAGE_DIFFUSERS_SM90_BENCH=1``) or the
default. A large F against n c is what a persistent grid (the next work tile's loads under this
one's epilogue) was to win back at image lengths (the `persistent` option: no faster, deleted;
csrc/sm90_int8/DESIGN.md).

    SAGE_DIFFUSERS_SM90_BENCH=1 python bench/int8_fixed_cost.py [--reps 20] [--out eval/results/int8_fixed_cost_h200]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_utils import make_inputs  # noqa: E402
from eval import _cli  # noqa: E402
from sage_diffusers.kernels import _sm90_int8_variants as variants  # noqa: E402
from sage_diffusers.kernels import int8_sm90  # noqa: E402

# (head dim, heads, query length): Flux's and SD3.5's image attention.
CASES = ((128, 24, 4608), (64, 38, 4429))
KEY_LENGTHS = (256, 1152, 2304, 4608, 9216)
BLOCK = 128  # query rows per CTA and keys per tile (csrc/sm90_int8/tile_config.hpp)


def fit(points):
    """Least squares t = W (F + n c) over (W, n, t): returns (F, c, max relative residual)."""
    a = torch.tensor([[w, w * n] for w, n, _ in points], dtype=torch.float64)
    t = torch.tensor([p[2] for p in points], dtype=torch.float64)
    sol = torch.linalg.lstsq(a, t[:, None]).solution[:, 0]
    resid = ((a @ sol - t).abs() / t).max().item()
    return sol[0].item(), sol[1].item(), resid


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=_cli.positive_int, default=20)
    ap.add_argument("--out", type=lambda t: str(_cli.output_file(t)), default=None,
                    help="path without suffix for .md and .json (its folder must exist)")
    args = ap.parse_args(argv)
    ext = int8_sm90.build_bench()  # bench_parts and set_fwd_flags are the benchmark build's
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bench = int8_sm90._BENCH  # every benchmark variant (SAGE_DIFFUSERS_SM90_BENCH), else the shipped option sets
    todo = [(d, poly, flags, name) for d, poly, flags, name in variants.BENCH_VARIANTS] if bench else \
        [(d, variants.DEFAULT_EXP_POLY[d], variants.DEFAULT_FLAGS[d], "default") for d, _, _ in CASES]
    rows, lines = [], []
    lines.append(f"{torch.cuda.get_device_name(0)}, {sms} SMs; attention kernel alone (bench_parts, "
                 f"{args.reps} back-to-back launches, median of 3); t = W (F + n c) fitted per variant.")
    lines.append("")
    lines.append("| variant | shape (Skv varied) | " + " | ".join(f"Skv {s}" for s in KEY_LENGTHS) +
                 " | F us/CTA | c us/tile | F / (F + n c) at Skv = Sq | max resid |")
    lines.append("|---" * (len(KEY_LENGTHS) + 6) + "|")
    for d, heads, sq in CASES:
        q = make_inputs(1, heads, sq, d, seed=5)[0]
        ctas = heads * math.ceil(sq / BLOCK)
        waves = math.ceil(ctas / sms)
        for vd, poly, flags, name in todo:
            if vd != d:
                continue
            ext.set_fwd_flags(flags)
            points, times = [], []
            for skv in KEY_LENGTHS:
                _, k, v = make_inputs(1, heads, skv, d, seed=6)
                t = sorted(ext.bench_parts(q, k, v, False, poly, args.reps)[1] for _ in range(3))[1]
                points.append((waves, math.ceil(skv / BLOCK), t * 1e3))  # us
                times.append(t)
            f_us, c_us, resid = fit(points)
            n_self = math.ceil(sq / BLOCK)
            share = f_us / (f_us + n_self * c_us)
            rows.append(dict(variant=name, d=d, heads=heads, sq=sq, ctas=ctas, waves=waves,
                             skv=list(KEY_LENGTHS), ms=times, F_us=f_us, c_us=c_us, fixed_share=share,
                             max_resid=resid))
            lines.append(f"| {name} | 1x{heads}x{sq}x{d} ({waves} waves) | " +
                         " | ".join(f"{t:.3f}" for t in times) +
                         f" | {f_us:.1f} | {c_us:.3f} | {share:.0%} | {resid:.1%} |")
            print(lines[-1], flush=True)
    ext.set_fwd_flags(-1)
    print("\n".join(lines))
    if args.out:
        Path(args.out + ".md").write_text("# Per-CTA fixed cost of the 8-bit kernel\n\n" + "\n".join(lines) + "\n")
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
