#!/usr/bin/env python3
"""Time the forward-kernel flag variants side by side against cuDNN BF16 SDPA (one GPU, one process).

Builds the benchmark extension (env SAGE_DIFFUSERS_SM90_BENCH=1: bf16 non-causal variants of every
flag set in generate_instantiations.BENCH_FLAGS, see kernel_fwd.cuh for the flags), then per shape
and variant: median time of the full call (pre-pass included), TOPS, ratio to cuDNN, and
correctness: cos vs sage8_reference on small awkward shapes (key mask included), cos vs the flag-0
variant on the timed shapes (same algorithm: must stay >= 0.9999).

    python csrc/sm90_int8/variants_bench.py [--shapes all|quick] [--reps 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# --default: time the regular build (the compiled default flags) instead of the bench variants
DEFAULT_ONLY = "--default" in sys.argv
if not DEFAULT_ONLY:
    os.environ["SAGE_DIFFUSERS_SM90_BENCH"] = "1"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sage_diffusers.kernels import int8_sm90  # noqa: E402
from sage_diffusers.reference import cosine, sage8_reference  # noqa: E402

SHAPES = [(1, 24, 16384, 128), (1, 48, 17776, 64), (1, 24, 4608, 128), (1, 38, 4429, 64)]
NAMES = {-1: "default", 0: "base", 1: "lean", 3: "lean+ovl", 5: "lean+pp", 7: "lean+ovl+pp"}


def inputs(b, h, s, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, device="cuda")
    k = torch.randn(b, h, s, d, generator=g, device="cuda") + 4 * torch.randn(1, h, 1, d, generator=g, device="cuda")
    v = torch.randn(b, h, s, d, generator=g, device="cuda")
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def time_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--default", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    ext = int8_sm90.build()
    print(f"bench build/load {time.time() - t0:.0f} s", flush=True)
    table = open(ROOT / "csrc/sm90_int8/instantiations/variants_bench.inc").read()
    if DEFAULT_ONLY:
        table = "\n".join(f"SAGE_SM90_VARIANT({d}, x, false, {int8_sm90.default_exp_poly_every(d)}, -1)"
                          for d in (64, 128))
    variants = []  # (d, poly, flags)
    for line in table.splitlines():
        if line.startswith("SAGE_SM90_VARIANT("):
            d, _, _, poly, flags = [x.strip() for x in line[len("SAGE_SM90_VARIANT("):-1].split(",")]
            variants.append((int(d), int(poly), int(flags)))

    def run(q, k, v, poly, flags, mask=None, scale=None):
        ext.set_fwd_flags(flags)
        sc = scale if scale is not None else q.shape[-1] ** -0.5
        return ext.fwd(q, k, v, mask, False, sc, False, poly)[0]

    # correctness vs the reference (small, awkward, with a key mask)
    bad = 0
    for d in (64, 128):
        for (b, h, s) in ((1, 2, 1023), (2, 3, 4097)):
            q, k, v = inputs(b, h, s, d, seed=1)
            mask = torch.rand(b, s, device="cuda") > 0.2
            mask[:, :5] = True
            ref = sage8_reference(q.float(), k.float(), v.float(), key_mask=mask).float()
            ref0 = sage8_reference(q.float(), k.float(), v.float()).float()
            for dd, poly, flags in variants:
                if dd != d:
                    continue
                for m in (None, mask):
                    out = run(q, k, v, poly, flags, mask=m)
                    r = ref if m is not None else ref0
                    c = cosine(out.float(), r)
                    ok = c >= 0.9999 and torch.isfinite(out).all().item()
                    bad += not ok
                    if not ok or s == 4097:
                        print(f"{'OK ' if ok else 'BAD'} ref d={d} {b}x{h}x{s} mask={m is not None} "
                              f"poly={poly} {NAMES.get(flags, flags)}: cos={c:.6f}", flush=True)
    ext.set_fwd_flags(-1)
    print("correctness failures:", bad, flush=True)

    print("| shape | variant | poly | ms | TOPS | vs cuDNN | cos vs base |")
    print("|---|---|---|---|---|---|---|")
    for (b, h, s, d) in SHAPES:
        q, k, v = inputs(b, h, s, d)
        flops = 4 * b * h * s * s * d
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = time_ms(lambda: F.scaled_dot_product_attention(q, k, v), args.reps)
        print(f"| {b}x{h}x{s}x{d} | cuDNN bf16 | - | {t_cudnn:.3f} | {flops / t_cudnn / 1e9:.0f} | 1.00 | - |", flush=True)
        base = run(q, k, v, 0 if not DEFAULT_ONLY else int8_sm90.default_exp_poly_every(d),
                   -1 if DEFAULT_ONLY else 0).float()
        for dd, poly, flags in variants:
            if dd != d:
                continue
            out = run(q, k, v, poly, flags)
            c = cosine(out.float(), base)
            t = time_ms(lambda: run(q, k, v, poly, flags), args.reps)
            print(f"| {b}x{h}x{s}x{d} | {NAMES.get(flags, flags)} | {poly} | {t:.3f} | {flops / t / 1e9:.0f} | "
                  f"{t_cudnn / t:.2f} | {c:.6f} |", flush=True)
        # pre-pass alone
        t_pre = time_ms(lambda: ext.prepass(q, k, v, None, d ** -0.5), args.reps)
        print(f"| {b}x{h}x{s}x{d} | prepass only | - | {t_pre:.3f} | - | - | - |", flush=True)
        del q, k, v, base
    ext.set_fwd_flags(-1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
