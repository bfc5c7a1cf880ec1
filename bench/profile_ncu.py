#!/usr/bin/env python3
"""Run one attention call per shape inside a CUDA profiler range, for Nsight Compute.

Warm-up calls (JIT build, caches) run outside the range, so ``ncu --profile-from-start off``
records exactly one call per (mode, shape): the pre-pass launches and the attention kernel.

    ncu --clock-control none --profile-from-start off --section ComputeWorkloadAnalysis \\
        python3 bench/profile_ncu.py --modes int8 --shapes 1x24x16384x128 1x48x17776x64

Inputs follow eval/bench_kernels.py: Q, V ~ N(0, 1), K = N(0, 1) + 4 N(0, 1) per channel.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import sage_diffusers as sd  # noqa: E402
from bench.bench_utils import make_inputs  # noqa: E402  (eval/bench_kernels.py's inputs)
from eval import _cli  # noqa: E402


def _mode(text: str) -> str:
    from sage_diffusers.options import Mode

    try:
        Mode.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", type=_mode, default=["int8"])
    ap.add_argument("--shapes", nargs="+", type=_cli.shape, default=[(1, 24, 16384, 128)], help="BxHxSxD ...")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--prepass-mode", type=_cli.nonnegative_int, default=None,
                    help="8-bit pre-pass mode (csrc/sm90_int8/launch.h kPrepass* bits); default: the built-in")
    args = ap.parse_args(argv)
    if args.prepass_mode is not None:
        from sage_diffusers.kernels import int8_sm90
        ext = int8_sm90.build()
        if not hasattr(ext, "set_prepass_mode"):
            raise SystemExit("--prepass-mode: the shipped build runs one mode; set SAGE_DIFFUSERS_SM90_BENCH=1 "
                             "(the benchmark build, bench/sm90_int8/binding_bench.cpp)")
        ext.set_prepass_mode(args.prepass_mode)
    cases = [(m, s) for m in args.modes for s in args.shapes]
    data = {}
    for mode, shape in cases:
        q, k, v = make_inputs(*shape)
        for _ in range(2):
            sd.attention(q, k, v, mode=mode, layout="bhsd", is_causal=args.causal)
        data[(mode, shape)] = (q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for mode, shape in cases:
        q, k, v = data[(mode, shape)]
        torch.cuda.nvtx.range_push(f"{mode} {'x'.join(map(str, shape))}")
        sd.attention(q, k, v, mode=mode, layout="bhsd", is_causal=args.causal)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(f"{m} {'x'.join(map(str, s))}" for m, s in cases))
    print("fallbacks:", sd.fallback_stats())


if __name__ == "__main__":
    main()
