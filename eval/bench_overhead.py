"""Where the 8-bit kernel's time goes per call, on one GPU: host work vs pre-pass vs attention kernel.

For each shape the same inputs are timed, methods interleaved over rounds (median [min-max]):

- ``pre-pass`` and ``kernel``: GPU time of the two launches alone (``bench_parts`` of the benchmark
  build, ``int8_sm90.build_bench()``, on the shipped option set of the head dim and the shipped
  pre-pass mode: prepared once, back-to-back launches, no host work);
- ``ext.fwd``: the pybind entry (allocations, checks, launches), pipelined;
- ``op``: ``attention_int8_sm90`` (the registered custom op and its Python wrapper), pipelined;
- ``sd int8`` / ``sd auto``: ``sage_diffusers.attention`` with that mode, pipelined;
- ``SDPA``: torch's default backend (cuDNN on Hopper), pipelined;
- host columns: CPU time per call of each entry while the GPU is held busy by a sleep kernel, so
  the launches queue up and nothing waits on the device (what the entry costs the host alone).

When a pipelined time is close to its host time, the call is host-bound at that shape.

    python eval/bench_overhead.py --out eval/results/int8_overhead_h200
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sage_diffusers as sd  # noqa: E402
from bench.bench_utils import pipelined_ms  # noqa: E402
from eval import _cli  # noqa: E402
from sage_diffusers.kernels import _sm90_int8_variants as _variants  # noqa: E402
from sage_diffusers.kernels import int8_sm90  # noqa: E402
from sage_diffusers.kernels._timing import spread  # noqa: E402

# (B, H, S, D): short image length, Flux, SD3.5, CogVideoX-5B, 16K
SHAPES = [(1, 24, 2048, 128), (1, 24, 4608, 128), (1, 38, 4429, 64), (1, 48, 17776, 64), (1, 24, 16384, 128)]


def host_us(fn, calls: int = 50) -> float:
    """Microseconds of CPU time per call while the GPU is busy (the queue absorbs the launches)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # ~0.2 s of GPU spin: longer than `calls` host calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=_cli.positive_int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="path without suffix (.md and .json)")
    args = ap.parse_args(argv)
    ok, why = int8_sm90.is_available()
    if not ok:
        raise SystemExit(f"int8 kernel unavailable: {why}")
    ext = int8_sm90.build()  # the shipped build: ext.fwd, op, sd
    parts = int8_sm90.build_bench()  # bench_parts, on each head dim's shipped option set
    rows = []
    for b, h, s, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        poly = int8_sm90.default_exp_poly_every(d)
        scale = d ** -0.5
        entries = {
            "ext.fwd": lambda: ext.fwd(q, k, v, None, False, scale, False, poly),
            "op": lambda: int8_sm90.attention_int8_sm90(q, k, v),
            "sd int8": lambda: sd.attention(q, k, v, mode="int8"),
            "sd auto": lambda: sd.attention(q, k, v, mode="auto"),
            "SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
        }
        probe = pipelined_ms(entries["op"], 3)
        iters = max(5, int(30.0 / max(probe, 1e-3)))
        reps = iters
        times = {n: [] for n in ["pre-pass", "kernel", *entries]}
        names = list(entries)
        for r in range(args.rounds):
            parts.set_fwd_flags(_variants.DEFAULT_FLAGS[d])
            pre, ker = parts.bench_parts(q, k, v, False, poly, reps)
            times["pre-pass"].append(pre)
            times["kernel"].append(ker)
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                times[n].append(pipelined_ms(entries[n], iters))
        host = {n: host_us(fn) for n, fn in entries.items()}
        row = {"shape": [b, h, s, d], "ms": {n: spread(t) for n, t in times.items()}, "host_us": host}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
            "prepass_mode": int(parts.prepass_mode())}
    lines = [f"# 8-bit attention: host vs pre-pass vs kernel ({meta['gpu']})", "",
             f"torch {meta['torch']}, {meta['date']}, bf16 BHSD N(0,1), no mask, median of "
             f"{args.rounds} interleaved rounds [min-max]; pre-pass mode {meta['prepass_mode']}. "
             "`python eval/bench_overhead.py`.", "",
             "| B x H x S x D | pre-pass ms | kernel ms | ext.fwd ms | op ms | sd int8 ms | sd auto ms | SDPA ms "
             "| host us: ext.fwd / op / sd int8 / sd auto / SDPA |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        m = r["ms"]

        def f(n):
            return f"{m[n]['median']:.3f} [{m[n]['min']:.3f}-{m[n]['max']:.3f}]"
        hu = " / ".join(f"{r['host_us'][n]:.0f}" for n in ["ext.fwd", "op", "sd int8", "sd auto", "SDPA"])
        lines.append(f"| {'x'.join(map(str, r['shape']))} | {f('pre-pass')} | {f('kernel')} | {f('ext.fwd')} "
                     f"| {f('op')} | {f('sd int8')} | {f('sd auto')} | {f('SDPA')} | {hu} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
