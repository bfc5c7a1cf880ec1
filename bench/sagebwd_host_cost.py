"""Is a SageBwd forward + backward bound by the host or by the GPU, with and without a key mask?

    python bench/sagebwd_host_cost.py [--iters 20] [--out eval/results/sagebwd_host_cost_h100]

At 4096 tokens the masked call of ``eval/bench_sagebwd.py --mask-cost`` took about 1 ms more than
the same call over the kept keys alone, whatever share was kept, while at 16K the two agree within
a few percent. A cost that does not grow with the kept keys is either host work (the masked path
runs about 50 more small torch ops than the unmasked one) or a GPU pass over the padded length.
For each case this measures, per call:

- ``pipelined``: back-to-back calls between two CUDA events (what the mask-cost table reports);
- ``host``: from the call's start to its return, the GPU idle at the start (no op in the call
  waits for the GPU, so this is the launch work alone);
- ``device``: the CUDA kernels' summed time under ``torch.profiler``, and their count.

A call is host-bound where ``host`` is close to ``pipelined`` and ``device`` well below it. The
CPU ops the masked call adds are listed from the same profile (self CPU time, top entries), and
``--cprofile`` prints where the host time of each SageBwd call goes by Python function.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sage_diffusers as sd  # noqa: E402
from bench import bench_utils  # noqa: E402

SHAPES = ((1, 24, 4096, 128), (1, 24, 16384, 128))
KEEP = 0.5


def cases(b, h, s, d):
    """{name: step()} for one shape: SageBwd masked, SageBwd over the kept keys, cuDNN BF16 unmasked."""
    q, k, v = bench_utils.make_inputs(b, h, s, d)
    do = torch.randn_like(q)
    mask = torch.zeros(b, s, dtype=torch.bool, device="cuda")
    mask[:, :int(KEEP * s)] = True
    qg = q.detach().requires_grad_()
    km, vm = (t.detach().requires_grad_() for t in (k, v))
    ku, vu = (t[:, :, mask[0]].detach().requires_grad_() for t in (k, v))

    def masked():
        torch.autograd.grad(sd.sagebwd(qg, km, vm, key_mask=mask), (qg, km, vm), do)

    def kept_only():
        torch.autograd.grad(sd.sagebwd(qg, ku, vu), (qg, ku, vu), do)

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            torch.autograd.grad(F.scaled_dot_product_attention(qg, ku, vu), (qg, ku, vu), do)

    return {"sagebwd masked": masked, "sagebwd kept only": kept_only, "cudnn kept only": cudnn}


def host_ms(fn, iters: int) -> float:
    """Median milliseconds from a call's start to its return, the GPU idle at the start."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def profiled(fn, iters: int):
    """(device ms per call, kernels per call, Counter of CPU self time in ms per call by op name)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    dev, kernels, cpu = 0.0, 0, Counter()
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            dev += ev.self_device_time_total / 1e3
            kernels += ev.count
        else:
            cpu[ev.key] += ev.self_cpu_time_total / 1e3 / iters
    return dev / iters, kernels / iters, cpu


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the top N Python functions by own time per SageBwd call (0: none)")
    ap.add_argument("--out", type=Path, default=None, help="writes OUT.md and OUT.json")
    args = ap.parse_args(argv)
    rows = []
    for shape in SHAPES:
        steps = cases(*shape)
        for fn in steps.values():  # compile, autotune
            fn(), fn()
        torch.cuda.synchronize()
        cpu_of = {}
        for name, fn in steps.items():
            pipe = bench_utils.pipelined_ms(fn, args.iters)
            host = host_ms(fn, args.iters)
            dev, nk, cpu_of[name] = profiled(fn, max(3, args.iters // 4))
            rows.append(dict(shape="x".join(map(str, shape)), method=name, pipelined_ms=pipe, host_ms=host,
                             device_ms=dev, kernels=nk))
            print(f"{rows[-1]['shape']} {name:18s} pipelined {pipe:7.3f}  host {host:7.3f}  device {dev:7.3f} ms"
                  f"  ({nk:.0f} kernels)", flush=True)
        for name, fn in steps.items():
            if args.cprofile and name.startswith("sagebwd"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.iters):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.cprofile)
                print(f"== cProfile {rows[-1]['shape']} {name}, {args.iters} calls", buf.getvalue(), sep="\n")
        extra = cpu_of["sagebwd masked"].copy()
        extra.subtract(cpu_of["sagebwd kept only"])
        top = [(k, round(v, 4)) for k, v in extra.most_common(12)]
        rows.append(dict(shape="x".join(map(str, shape)), masked_extra_cpu_ms=top))
        print("masked minus kept-only CPU self ms per call:", top, flush=True)
    lines = [f"# SageBwd host and device time per forward + backward ({torch.cuda.get_device_name()})", "",
             f"`bench/sagebwd_host_cost.py`, commit {bench_utils.git_head()}, torch {torch.__version__}, "
             f"{args.iters} calls each; keys kept {KEEP:.0%} (trailing padding). pipelined = back-to-back calls "
             "between CUDA events; host = call start to return with the GPU idle; device = summed kernel time.", "",
             "| shape | method | pipelined ms | host ms | device ms | kernels |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "method" in r:
            lines.append(f"| {r['shape']} | {r['method']} | {r['pipelined_ms']:.3f} | {r['host_ms']:.3f} | "
                         f"{r['device_ms']:.3f} | {r['kernels']:.0f} |")
    for r in rows:
        if "masked_extra_cpu_ms" in r:
            lines += ["", f"{r['shape']}: CPU self time the masked call adds, ms per call: "
                      + ", ".join(f"{k} {v:+.3f}" for k, v in r["masked_extra_cpu_ms"])]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                            indent=1))


if __name__ == "__main__":
    main()
