"""Per-call time distribution of the 8-bit attention against cuDNN BF16, with the GPU's clock, power and
throttle state per round: what a round median hides.

eval/bench_kernels.py reports the median of round medians. On a power-capped H100 the 8-bit kernel's
per-call times at 1x24x16384x128 were bimodal (most calls at the minimum, some 10-20 % slower) while
cuDNN's moved together with the power state, so the round median of one method could land in either
mode. This times every call (L2 flushed before each, as the tables do), in rounds that alternate the
methods, and reports percentiles over all calls with the SM clock, power draw and throttle reasons
(nvidia-smi) read after each round.

    python bench/int8_call_spread.py [--shapes 1x24x16384x128,1x48x17776x64] [--rounds 6] [--calls 40]
        [--out eval/results/int8_call_spread_h100.md]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_utils import git_head, make_inputs  # noqa: E402
from eval import _cli  # noqa: E402

PERCENTILES = (0, 10, 50, 90, 100)
DEFAULT_SHAPES = "1x24x16384x128,1x48x17776x64,1x24x4608x128"
SMI_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def percentiles(times: list[float], points=PERCENTILES) -> dict[int, float]:
    """{p: the p-th percentile of ``times``} by the nearest rank (0: the minimum, 100: the maximum)."""
    if not times:
        raise ValueError("no times")
    ordered = sorted(times)
    return {p: ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}


def gpu_state() -> str:
    """SM clock, power draw and active throttle reasons now, as nvidia-smi prints them ("" without it)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_cli.shape_list, default=_cli.shape_list(DEFAULT_SHAPES))
    ap.add_argument("--rounds", type=_cli.positive_int, default=6)
    ap.add_argument("--calls", type=_cli.positive_int, default=40, help="timed calls per method per round")
    ap.add_argument("--out", type=_cli.output_file, default=None, help="markdown file (default: print only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/int8_call_spread.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import sage_diffusers as sd
    from sage_diffusers.kernels._timing import flushed_call_ms, round_order

    def cudnn(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    methods = {"ours": lambda q, k, v: sd.attention(q, k, v, mode="int8"), "sdpa_cudnn": cudnn}
    lines = [f"# 8-bit attention: per-call times on {torch.cuda.get_device_name()}", "",
             f"Run of commit {git_head()}; torch {torch.__version__}; {args.rounds} rounds x {args.calls} calls per "
             "method, L2 flushed before each call, methods in a new order each round; bf16 `make_inputs`.", "",
             "| shape | method | ms " + " / ".join(f"p{p}" for p in PERCENTILES) + " | round medians | SM MHz, W, throttle after each round |",
             "|---|---|---|---|---|"]
    for b, h, s, d in args.shapes:
        q, k, v = make_inputs(b, h, s, d)
        times = {n: [] for n in methods}
        medians = {n: [] for n in methods}
        states = {n: [] for n in methods}
        for fn in methods.values():
            fn(q, k, v)  # builds, plans
        for r in range(args.rounds):
            for name in round_order(list(methods), r):
                t = flushed_call_ms(lambda: methods[name](q, k, v), args.calls)
                times[name] += t
                medians[name].append(percentiles(t, (50,))[50])
                states[name].append(gpu_state())
        for name in methods:
            p = percentiles(times[name])
            line = (f"| {b}x{h}x{s}x{d} | {name} | {' / '.join(f'{p[x]:.3f}' for x in PERCENTILES)} | "
                    f"{', '.join(f'{m:.3f}' for m in medians[name])} | {'; '.join(sorted(set(states[name])))} |")
            lines.append(line)
            print(line, flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
