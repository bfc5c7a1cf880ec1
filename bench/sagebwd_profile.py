"""Where SageBwd's forward + backward time goes, per GPU kernel, beside cuDNN's.

    python bench/sagebwd_profile.py --shapes 1x24x16384x128,1x48x16384x64 --out eval/results/sagebwd_profile_h100

One forward + backward through ``sd.sagebwd`` (default kernels) and through cuDNN BF16 SDPA, under
``torch.profiler`` after a warm-up (Triton compiles and autotunes there). For every CUDA kernel:
its device time summed over ``--iters`` steps and divided by them, its share of the step, and for
the kernels whose products are known the tensor throughput it reaches (forward 4 B H S^2 D, the
backward's dK/dV kernel 4 of the five backward products (2 B H S^2 D each), the dQ kernel 3, the
fused kernel 5; causal halves them).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sage_diffusers as sd  # noqa: E402
from bench import bench_utils  # noqa: E402
from eval import _cli  # noqa: E402

# products (in units of 2 B H S^2 D) per Triton kernel, matched on the kernel name's prefix
PRODUCTS = {"_fwd_kernel": 2, "_fwd_jit": 2, "_bwd_dkdv": 4, "_bwd_fused": 5, "_bwd_dq": 3}


def _step(method: str, causal: bool, q, k, v, do):
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    if method == "sagebwd":
        out = sd.sagebwd(qg, kg, vg, is_causal=causal)
    else:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    torch.autograd.grad(out, (qg, kg, vg), do)


def kernel_times(method: str, shape, causal: bool, iters: int) -> list[dict]:
    b, h, s, d = shape
    q, k, v = bench_utils.make_inputs(b, h, s, d)
    do = torch.randn_like(q)
    for _ in range(3):
        _step(method, causal, q, k, v, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _step(method, causal, q, k, v, do)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total / 1e3  # ms
            per[ev.name][1] += 1
    total = sum(t for t, _ in per.values()) / iters
    unit = 2.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    rows = []
    for name, (t, n) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        ms = t / iters
        prods = next((p for pre, p in PRODUCTS.items() if name.startswith(pre)), None)
        rows.append(dict(kernel=name[:90], ms=ms, calls=n // iters, share=ms / total if total else 0.0,
                         tops=(prods * unit / (ms * 1e-3) / 1e12) if prods and ms else None))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_cli.shape_list, default=[(1, 24, 16384, 128), (1, 48, 16384, 64)])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=_cli.positive_int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    lines = [f"# SageBwd forward + backward per kernel ({gpu})", "",
             f"torch {torch.__version__}; `bench/sagebwd_profile.py`, {args.iters} steps under torch.profiler "
             "after 3 warm-up steps; bf16 `make_inputs`, dO ~ N(0, 1). TOPS: the kernel's products over its "
             "time (dK/dV kernel 4 products, dQ 3, fused 5, forward 2; 2 B H S^2 D each).", ""]
    result = {}
    for shape in args.shapes:
        for method in ("sagebwd", "sdpa_cudnn"):
            rows = kernel_times(method, shape, args.causal, args.iters)
            label = "x".join(map(str, shape)) + (" causal" if args.causal else "")
            result[f"{label}/{method}"] = rows
            total = sum(r["ms"] for r in rows)
            lines += [f"## {label}, {method}: {total:.3f} ms per step", "",
                      "| kernel | calls | ms | share | TOPS |", "|---|---:|---:|---:|---:|"]
            for r in rows[:14]:
                tops = "" if r["tops"] is None else f"{r['tops']:.0f}"
                lines.append(f"| `{r['kernel']}` | {r['calls']} | {r['ms']:.3f} | {100 * r['share']:.1f} % | {tops} |")
            lines.append("")
            print("\n".join(lines[-(len(rows[:14]) + 4):]), flush=True)
    if args.out:
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")
        Path(args.out + ".json").write_text(json.dumps(dict(gpu=gpu, results=result), indent=1))


if __name__ == "__main__":
    main()
