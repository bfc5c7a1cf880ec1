"""One performance variant of the FP4 kernel on the GPU: accuracy vs sage3_reference, timing vs cuDNN.

Run by variants_bench.sh, once per variant (SAGE_DIFFUSERS_FP4_OPT set by the caller to the option
names, fp4.opt_name), after the builds. Prints one JSON line ("RESULT {...}", "opt" = the variant's
name) and saves the small-case outputs to $FP4_VARIANT_DIR/variant_<name>.pt so that every variant
is compared with the baseline $FP4_BASELINE (the first of the driver's list, run first).

    python bench/fp4/variants_bench.py check|time [--iters N]
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from bench.bench_utils import pipelined_ms  # noqa: E402
from sage_diffusers.kernels import fp4  # noqa: E402
from sage_diffusers.reference import cosine, sage3_reference  # noqa: E402

OPT = fp4.opt_name(fp4._opt_bits())  # the build's option set (env SAGE_DIFFUSERS_FP4_OPT)
BASELINE = fp4.opt_name(fp4.parse_opt(os.environ.get("FP4_BASELINE", "none")))
OUT_DIR = os.environ.get("FP4_VARIANT_DIR", "/tmp/fp4_variants")
# Small accuracy cases: (B, Hq, Hkv, Sq, Skv, D, dtype, key mask, causal).
CASES = {
    "gqa_mask_causal_d128_bf16": (1, 4, 2, 300, 333, 128, torch.bfloat16, True, True),
    "gqa_mask_d64_fp16": (2, 6, 3, 257, 1023, 64, torch.float16, True, False),
}
TIMED = ((1, 24, 16384, 128), (2, 24, 4096, 128))


def _inputs(b, hq, hkv, sq, skv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, sq, d, device="cuda", generator=g).to(dtype)
    k = (torch.randn(b, hkv, skv, d, device="cuda", generator=g)
         + 3 * torch.randn(1, 1, 1, d, device="cuda", generator=g)).to(dtype)  # smoothing matters
    v = torch.randn(b, hkv, skv, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def check() -> dict:
    res, outs = {}, {}
    for name, (b, hq, hkv, sq, skv, d, dtype, use_mask, causal) in CASES.items():
        q, k, v = _inputs(b, hq, hkv, sq, skv, d, dtype)
        mask = None
        if use_mask:
            mask = torch.ones(b, skv, dtype=torch.bool, device="cuda")
            mask[:, -37:] = False
            mask[-1, 5:60] = False
        out, lse = fp4.attention_fp4(q, k, v, key_mask=mask, is_causal=causal, return_lse=True)
        ref, ref_lse = sage3_reference(q, k, v, key_mask=mask, is_causal=causal, return_lse=True)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(out).all())
        fin_lse = torch.isfinite(ref_lse)
        lse_err = float((lse[fin_lse] - ref_lse[fin_lse]).abs().max()) if fin_lse.any() else 0.0
        res[name] = {"cos": round(float(cosine(out.float(), ref.float())), 7), "finite": finite,
                     "lse_maxerr": round(lse_err, 5)}
        outs[name] = out.float().cpu()
    os.makedirs(OUT_DIR, exist_ok=True)
    torch.save(outs, os.path.join(OUT_DIR, f"variant_{OPT}.pt"))
    base = os.path.join(OUT_DIR, f"variant_{BASELINE}.pt")
    if OPT != BASELINE and os.path.exists(base):
        b0 = torch.load(base, weights_only=True)
        for name in CASES:
            res[name]["maxdiff_vs_baseline"] = float((outs[name] - b0[name]).abs().max())
    return res


def _timeit(fn, iters: int) -> float:
    return pipelined_ms(fn, iters, warmup=1)


def timing(iters: int, with_cudnn: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res = {}
    for shape in TIMED:
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = _timeit(lambda: fp4.attention_fp4(q, k, v), iters)
        entry = {"fp4_ms": round(ms, 3)}
        if with_cudnn:
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    entry["cudnn_ms"] = round(_timeit(lambda: F.scaled_dot_product_attention(q, k, v), iters), 3)
            except Exception as e:  # noqa: BLE001 - report, do not fail the table
                entry["cudnn_error"] = str(e)[:120]
        res["x".join(map(str, shape))] = entry
    return res


def main(argv: list[str]) -> int:
    t0 = time.time()
    fp4.build()  # already built by the driver: only loads
    out = {"opt": OPT}
    if "check" in argv:
        out["check"] = check()
    if "time" in argv:
        iters = int(argv[argv.index("--iters") + 1]) if "--iters" in argv else 10
        out["time"] = timing(iters, with_cudnn="--cudnn" in argv)
    out["seconds"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
