"""SageBwd on one GPU: forward + backward time against torch SDPA (cuDNN and flash backends).

    python eval/bench_sagebwd.py              # hd64 and hd128, 4K-32K tokens (H200: a few minutes)
    python eval/bench_sagebwd.py --quick      # two shapes, fewer rounds

Writes eval/results/sagebwd_h200.json (every timing, with metadata) and sagebwd_h200.md.

- Inputs: bf16 BHSD, Q and V ~ N(0, 1), K = N(0, 1) + 4 N(0, 1) per channel (as
  eval/bench_kernels.py), dO ~ N(0, 1).
- Methods: ``sagebwd`` (``sage_diffusers.sagebwd``, Triton kernels, the whole call: quantization
  pre-passes included), ``sagebwd_atomic_dq`` (dQ by FP32 atomics inside the dK/dV kernel instead
  of its own kernel: ``SAGE_DIFFUSERS_SAGEBWD_DQ=atomic``), ``sagebwd_dov_int8`` (the dO.V^T INT8
  ablation), ``sdpa_cudnn`` and
  ``sdpa_flash`` (``F.scaled_dot_product_attention`` under ``sdpa_kernel``); ``fwd`` rows time the
  forward alone (no autograd graph), ``fwd+bwd`` rows one forward and
  ``torch.autograd.grad`` for dQ, dK, dV.
- Warm-up compiles and autotunes every kernel variant first (a few minutes on an H200, not
  timed); ``--methods`` narrows the run.
- Timing: interleaved rounds (every method once per round, in turn), each the mean of ``--iters``
  back-to-back calls between CUDA events after a warm-up; min / median / max over the rounds.
- TOPS: forward 4 B H S^2 D, backward 2.5 times that (five matmuls of which two are the
  recomputation), halved for causal.
- Accuracy (each head dim, at 4096 tokens): cos and relative L1 of O, dQ, dK, dV against float32
  SDPA (math backend) on the same inputs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sage_diffusers as sd
from sage_diffusers.kernels._timing import pipelined_ms
from sage_diffusers.reference import cosine, relative_l1

RESULTS = Path(__file__).resolve().parent / "results"
ACC_TOKENS = 4096
SDPA_BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}


def make_inputs(b, h, s, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, device="cuda")
    k = torch.randn(b, h, s, d, generator=g, device="cuda") + 4 * torch.randn(1, h, 1, d, generator=g, device="cuda")
    v = torch.randn(b, h, s, d, generator=g, device="cuda")
    do = torch.randn(b, h, s, d, generator=g, device="cuda")
    return [x.to(torch.bfloat16) for x in (q, k, v, do)]


def attention_fn(method: str, causal: bool):
    if method.startswith("sagebwd"):
        dov = "int8" if method.endswith("dov_int8") else "fp16"
        return lambda q, k, v: sd.sagebwd(q, k, v, is_causal=causal, dov=dov)

    def run(q, k, v):
        with sdpa_kernel(SDPA_BACKENDS[method]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


@contextlib.contextmanager
def dq_pass(method: str):
    """``sagebwd_atomic_dq``: the backward's dQ by atomics in the dK/dV kernel (read at call time)."""
    if method != "sagebwd_atomic_dq":
        yield
        return
    os.environ["SAGE_DIFFUSERS_SAGEBWD_DQ"] = "atomic"
    try:
        yield
    finally:
        del os.environ["SAGE_DIFFUSERS_SAGEBWD_DQ"]


def step_fn(method: str, causal: bool, pass_: str, q, k, v, do):
    fn = attention_fn(method, causal)
    if pass_ == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v)
        return step
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        with dq_pass(method):
            out = fn(qg, kg, vg)
            torch.autograd.grad(out, (qg, kg, vg), do)
    return step


def accuracy(q, k, v, do, causal: bool) -> dict:
    ref = [t.float().detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out_ref = F.scaled_dot_product_attention(*ref, is_causal=causal)
    grads_ref = torch.autograd.grad(out_ref, ref, do.float())
    res = {}
    for dov in ("fp16", "int8"):
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sd.sagebwd(*x, is_causal=causal, dov=dov)
        grads = torch.autograd.grad(out, x, do)
        for name, a, b in zip(("O", "dQ", "dK", "dV"), (out, *grads), (out_ref, *grads_ref)):
            res[f"{dov}/{name}"] = dict(cos=cosine(a, b), rel_l1=relative_l1(a, b))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--methods", default="sagebwd,sagebwd_atomic_dq,sagebwd_dov_int8,sdpa_cudnn,sdpa_flash")
    ap.add_argument("--out", default=str(RESULTS / "sagebwd_h200"))
    args = ap.parse_args()
    shapes = [(1, 24, s, 128) for s in (4096, 8192, 16384, 32768)] + [(1, 48, s, 64) for s in (4096, 8192, 16384, 32768)]
    causal_shapes = [(1, 24, 16384, 128), (1, 48, 16384, 64)]
    if args.quick:
        shapes, causal_shapes, args.rounds = [(1, 24, 16384, 128), (1, 48, 8192, 64)], [], 3
    methods = args.methods.split(",")
    rows, acc = [], {}
    torch.backends.cuda.matmul.allow_tf32 = False
    for shape, causal in [(s, False) for s in shapes] + [(s, True) for s in causal_shapes]:
        b, h, s, d = shape
        if not causal and d not in {a[1] for a in acc.values()}:  # float32 math SDPA needs S^2 memory: 4K tokens
            acc[f"{b}x{h}x{ACC_TOKENS}x{d}"] = (accuracy(*make_inputs(b, h, ACC_TOKENS, d), causal), d)
            torch.cuda.empty_cache()
        q, k, v, do = make_inputs(*shape)
        for pass_ in ("fwd", "fwd+bwd"):
            steps = {m: step_fn(m, causal, pass_, q, k, v, do) for m in methods}
            for step in steps.values():  # warm-up: JIT, autotuning, cuDNN plans
                step()
            torch.cuda.synchronize()
            times = {m: [] for m in methods}
            for _ in range(args.rounds):
                for m in methods:
                    times[m].append(pipelined_ms(steps[m], args.iters, warmup=0))
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * (1.0 if pass_ == "fwd" else 3.5)
            base = statistics.median(times["sdpa_cudnn"]) if "sdpa_cudnn" in times else None
            for m in methods:
                med = statistics.median(times[m])
                rows.append(dict(shape=f"{b}x{h}x{s}x{d}", causal=causal, pass_=pass_, method=m,
                                 ms_min=min(times[m]), ms_median=med, ms_max=max(times[m]),
                                 tops=flops / med / 1e9, speedup_vs_cudnn=(base / med) if base else None))
                print(f"{b}x{h}x{s}x{d} causal={int(causal)} {pass_:8s} {m:18s} {med:8.3f} ms "
                      f"({flops / med / 1e9:6.1f} TOPS) x{(base / med) if base else float('nan'):.2f}", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, rounds=args.rounds, iters=args.iters,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, accuracy={k: v[0] for k, v in acc.items()}), indent=1))
    lines = [f"# SageBwd on {meta['device']} (forward + backward vs torch SDPA)", "",
             f"torch {meta['torch']}, triton {meta['triton']}; {meta['rounds']} interleaved rounds of "
             f"{meta['iters']} calls each; bf16 inputs; produced by `eval/bench_sagebwd.py`. "
             "Speed-up = median cuDNN time / median time.", "",
             "| shape | causal | pass | method | ms min / median / max | TOPS | vs cuDNN |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = f"{r['speedup_vs_cudnn']:.2f}x" if r["speedup_vs_cudnn"] else "n/a"
        lines.append(f"| {r['shape']} | {int(r['causal'])} | {r['pass_']} | {r['method']} | {r['ms_min']:.3f} / "
                     f"{r['ms_median']:.3f} / {r['ms_max']:.3f} | {r['tops']:.0f} | {sp} |")
    lines += ["", "## Accuracy against float32 SDPA (same inputs)", "",
              "| shape | dO·Vᵀ | O cos / rel-L1 | dQ | dK | dV |", "|---|---|---|---|---|---|"]
    for shape, (res, _) in acc.items():
        for dov in ("fp16", "int8"):
            cells = [f"{res[f'{dov}/{n}']['cos']:.5f} / {res[f'{dov}/{n}']['rel_l1']:.4f}" for n in ("O", "dQ", "dK", "dV")]
            lines.append(f"| {shape} | {dov} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("wrote", out.with_suffix(".md"))


if __name__ == "__main__":
    main()
