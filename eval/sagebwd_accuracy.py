"""SageBwd accuracy on the CPU: O, dQ, dK, dV against float64 autograd of exact attention.

    python eval/sagebwd_accuracy.py            # writes eval/results/sagebwd_accuracy.md / .json

Runs SageBwd's torch reference (the kernels' numerics, tests/test_sagebwd_triton.py) over
sequence lengths and head dims, with dP = dO.V^T in 16 bits (SageBwd) and in INT8 (the paper's
ablation), and bf16 SDPA as the same-precision baseline. Inputs (bf16): Q, V ~ N(0, 1); K =
N(0, 1) + 4 N(0, 1) per channel (what smoothing removes, as eval/bench_kernels.py); dO ~ N(0, 1),
or with token outliers ("dO outliers": 5 % of the rows x 20, the regime where INT8 dO hurts).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_diffusers import sagebwd
from sage_diffusers.reference import cosine, relative_l1
from sage_diffusers.sagebwd import Impl

RESULTS = Path(__file__).resolve().parent / "results"
LENGTHS = (256, 1024, 2048)
HEAD_DIMS = (32, 64, 128)
HEADS = 2
NAMES = ("O", "dQ", "dK", "dV")


def make_inputs(s: int, d: int, outliers: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, s, d, generator=g)
    k = torch.randn(1, HEADS, s, d, generator=g) + 4 * torch.randn(1, HEADS, 1, d, generator=g)
    v = torch.randn(1, HEADS, s, d, generator=g)
    do = torch.randn(1, HEADS, s, d, generator=g)
    if outliers:
        do = do * (1 + 19 * (torch.rand(1, HEADS, s, 1, generator=g) > 0.95))
    return [t.to(torch.bfloat16) for t in (q, k, v, do)]


def grads(fn, q, k, v, do, dtype):
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*x)
    out.backward(do.to(dtype))
    return [out.detach(), *(t.grad for t in x)]


def main(argv: list[str] | None = None) -> None:
    # No options: parsing still answers --help and refuses stray arguments instead of running (and
    # rewriting the results) regardless.
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    t0 = time.perf_counter()
    for outliers in (False, True):
        for d in HEAD_DIMS:
            for s in LENGTHS:
                q, k, v, do = make_inputs(s, d, outliers)
                exact = grads(F.scaled_dot_product_attention, q, k, v, do, torch.float64)
                methods = {
                    "sagebwd (dO·Vᵀ fp16)": lambda *x: sagebwd(*x, dov="fp16", impl=Impl.REFERENCE),
                    "sagebwd (dO·Vᵀ int8)": lambda *x: sagebwd(*x, dov="int8", impl=Impl.REFERENCE),
                    "bf16 SDPA": F.scaled_dot_product_attention,
                }
                for name, fn in methods.items():
                    got = grads(fn, q, k, v, do, torch.bfloat16)
                    row = dict(dO="outliers" if outliers else "gaussian", D=d, S=s, method=name)
                    for n, a, b in zip(NAMES, got, exact):
                        row[n] = dict(cos=cosine(a, b), rel_l1=relative_l1(a, b))
                    rows.append(row)
                    print(row["dO"], d, s, name, " ".join(f"{n} {row[n]['cos']:.5f}" for n in NAMES), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sagebwd_accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# SageBwd accuracy (CPU, torch reference)",
        "",
        "Against float64 autograd of exact attention on the same bf16 inputs; cos / relative L1 as in "
        "the papers (`sage_diffusers.reference.metrics`). B = 1, H = 2, non-causal. Inputs: Q, V ~ N(0, 1), "
        "K = N(0, 1) + 4 N(0, 1) per channel; dO ~ N(0, 1) (\"gaussian\") or with 5 % of its rows ×20 "
        "(\"outliers\"). `bf16 SDPA` is the same-precision baseline (torch's CPU SDPA in bfloat16). "
        f"Produced by `eval/sagebwd_accuracy.py` in {time.perf_counter() - t0:.0f} s.",
        "",
        "| dO | D | S | method | O | dQ | dK | dV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[n]['cos']:.5f} / {r[n]['rel_l1']:.4f}" for n in NAMES)
        lines.append(f"| {r['dO']} | {r['D']} | {r['S']} | {r['method']} | {cells} |")

    def mean_cos(method, name, outliers):
        vals = [r[name]["cos"] for r in rows if r["method"] == method and r["dO"] == outliers]
        return sum(vals) / len(vals)

    lines += ["", "## dO·Vᵀ ablation (mean dQ cos over the grid)", "",
              "| dO | dO·Vᵀ fp16 | dO·Vᵀ int8 | bf16 SDPA |", "|---|---|---|---|"]
    for kind in ("gaussian", "outliers"):
        lines.append(f"| {kind} | " + " | ".join(f"{100 * mean_cos(m, 'dQ', kind):.3f} %" for m in
                                                  ("sagebwd (dO·Vᵀ fp16)", "sagebwd (dO·Vᵀ int8)", "bf16 SDPA")) + " |")
    lines += ["", "The paper (arXiv 2505.11594) reports dQ cos 99.77 % with dO·Vᵀ in FP16 and 97.47 % in INT8 "
              "on real model tensors; the size of the gap depends on how uneven dO is across tokens "
              "(the per-block INT8 scale of dO is set by its largest row).", ""]
    (RESULTS / "sagebwd_accuracy.md").write_text("\n".join(lines))
    print("wrote", RESULTS / "sagebwd_accuracy.md")


if __name__ == "__main__":
    main()
