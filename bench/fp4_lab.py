#!/usr/bin/env python3
"""The FP4 kernel's lab: the paper's format and P~ ablations through the kernel, a benchmark against
SDPA, and a command line that also runs the kernel's self-check and build. The backend itself is
``sage_diffusers.kernels.fp4``.

peaked_inputs(...) -> q, k, v
    Attention rows with a few hot keys and many small probabilities (where direct P~ underflows).
ablation(...) -> list[dict]
    NVFP4 vs MXFP4 x two-level vs direct through the kernel, accuracy vs fp32 SDPA per
    combination (appended to $SAGE_FP4_REPORT as JSON lines when set).
benchmark(...) -> dict
    The FP4 path (pre-pass included) against torch SDPA (cuDNN) on one shape.

    python bench/fp4_lab.py [selftest|build|bench [--emu mma|wgmma|both]|ablation]
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from bench.bench_utils import pipelined_ms  # noqa: E402
from sage_diffusers.kernels import fp4  # noqa: E402
from sage_diffusers.options import FP4Format, PQuant  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1, rmse, sage3_reference  # noqa: E402


def peaked_inputs(b=1, h=2, s=2048, d=128, dtype=torch.bfloat16, gap=8.0, hot=4, seed=0, device="cuda"):
    """Inputs whose attention rows are peaked: ``hot`` early keys score about ``gap`` (natural log)
    above the rest, so later key tiles hold only small P~ values (where direct FP4 of P~ with E4M3
    scales underflows), while the many small probabilities still carry a sizeable share of the
    mass. K and V have per-channel offsets (V's makes the lost mass visible in the output's
    direction, as real V does). Returns q, k, v (B, H, S, D).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    a = math.sqrt(gap / math.sqrt(d))
    u = torch.randn(d, device=device, generator=g)
    u = u / u.norm() * math.sqrt(d)
    q = torch.randn(b, h, s, d, device=device, generator=g) + a * u
    k = torch.randn(b, h, s, d, device=device, generator=g) + 2 * torch.randn(1, 1, 1, d, device=device, generator=g)
    k[:, :, :hot] += a * u
    v = torch.randn(b, h, s, d, device=device, generator=g) + torch.randn(1, 1, 1, d, device=device, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def ablation(shapes=((1, 2, 2048, 64), (1, 2, 2048, 128)), dtype=torch.bfloat16, report: Optional[str] = None,
             verbose: bool = True) -> list[dict]:
    """The paper's two ablations through the kernel: NVFP4 vs MXFP4 x two-level vs direct P~.

    For each shape (B, H, S, D) of :func:`peaked_inputs`, runs the four (fmt, p_quant) combinations
    and measures each against fp32 SDPA (cos, relative L1, RMSE) and against sage3_reference of
    the same combination (cos_ref: the kernel must track its reference, so the ranking is the
    algorithm's, not the kernel's). Returns one dict per combination; appends them as JSON lines
    to ``report`` (default $SAGE_FP4_REPORT) when set.
    """
    report = report or os.environ.get("SAGE_FP4_REPORT")
    records = []
    for (b, h, s, d) in shapes:
        q, k, v = peaked_inputs(b, h, s, d, dtype)
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for fmt in (FP4Format.NVFP4, FP4Format.MXFP4):
            for pq in (PQuant.TWO_LEVEL, PQuant.DIRECT):
                out = fp4.attention_fp4(q, k, v, fmt=fmt, p_quant=pq)[0].float()
                ref = sage3_reference(q, k, v, fmt=fmt, p_quant=pq)
                rec = {"case": f"ablation peaked {b}x{h}x{s}x{d} {str(dtype)[6:]}", "fmt": fmt.value,
                       "p_quant": pq.value, "atom": fp4._default_atom(fp4._device_arch()),
                       "cos_sdpa": cosine(out, exact), "rel_l1_sdpa": relative_l1(out, exact),
                       "rmse_sdpa": rmse(out, exact), "cos_ref": cosine(out, ref),
                       "cos_ref_vs_sdpa": cosine(ref, exact)}
                records.append(rec)
                if verbose:
                    print(f"fp4 ablation {rec['case']} {fmt.value:5s} {pq.value:9s}: cos vs SDPA "
                          f"{rec['cos_sdpa']:.5f} (reference {rec['cos_ref_vs_sdpa']:.5f}), "
                          f"rel-L1 {rec['rel_l1_sdpa']:.4f}, cos vs reference {rec['cos_ref']:.6f}")
    if report:
        with open(report, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return records


def benchmark(b=1, h=24, s=16384, d=128, dtype=torch.bfloat16, iters=20,
              fmt: "str | FP4Format" = FP4Format.NVFP4, emus: Optional[tuple] = None) -> dict:
    """Time the FP4 path (pre-pass included) against torch SDPA (cuDNN / flash) on one shape.

    emus : emulated GEMM variants to time side by side (e.g. ("mma", "wgmma")); default: the one
        attention_fp4 picks (env SAGE_DIFFUSERS_FP4_EMU).

    Returns dict with milliseconds per call (fp4_ms includes the pre-pass, also timed alone as
    prepass_ms) and the speed ratio sdpa_ms / fp4_ms; with ``emus``, fp4_<emu>_ms,
    speed_<emu>_vs_<sdpa> and fp4_<emu>_tflops per variant instead.
    """

    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))

    def timeit(fn):
        return pipelined_ms(fn, iters, warmup=3)

    fmt = FP4Format.parse(fmt)
    fp4_times = {}
    for emu in (emus or (None,)):
        fp4_times[emu] = timeit(lambda: fp4.attention_fp4(q, k, v, fmt=fmt, emu=emu))
    prepass_ms = timeit(lambda: fp4.prepass(k, v, fmt=fmt))  # k mean + K/V quantization, included in fp4_ms
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            sdpa_ms = timeit(lambda: F.scaled_dot_product_attention(q, k, v))
        which = "cudnn"
    except Exception:  # cuDNN SDPA unavailable in this build: whatever SDPA picks
        sdpa_ms = timeit(lambda: F.scaled_dot_product_attention(q, k, v))
        which = "sdpa"
    flops = 4 * b * h * s * s * d
    res = {"shape": (b, h, s, d), "atom": fp4._default_atom(fp4._device_arch()), "fmt": fmt.value,
           "prepass_ms": round(prepass_ms, 3), f"{which}_ms": round(sdpa_ms, 3)}
    for emu, fp4_ms in fp4_times.items():
        tag = "" if emu is None else f"_{emu}"
        res[f"fp4{tag}_ms"] = round(fp4_ms, 3)
        res[f"speed{tag}_vs_{which}"] = round(sdpa_ms / fp4_ms, 3)
        res[f"fp4{tag}_tflops"] = round(flops / fp4_ms / 1e9, 1)
    return res


def _main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "selftest"
    if cmd == "selftest":
        return 0 if fp4.selftest() else 1
    if cmd == "build":
        fp4.build(verbose=True)
        return 0
    if cmd == "bench":
        # --emu mma|wgmma|both: which emulated GEMM variants to time (default: env, else "auto").
        emus = None
        if "--emu" in argv:
            i = argv.index("--emu")
            choice = argv[i + 1] if i + 1 < len(argv) else ""
            if choice == "both":  # the variants this device runs (mma only where the native atom serves)
                emus = tuple(fp4.emu_gemms()) if fp4._default_atom(fp4._device_arch()) == fp4.Atom.EMULATED else ()
                emus = emus or (fp4.EmuGemm.MMA,)
            else:
                emus = (fp4._emu_name(choice),)
        for shape in ((1, 24, 16384, 128), (1, 48, 17776, 64), (2, 24, 4096, 128)):
            print(benchmark(*shape, emus=emus), flush=True)
        return 0
    if cmd == "ablation":
        ok, reason = fp4.is_available()
        if not ok:
            print(f"fp4 ablation skipped: {reason}")
            return 0
        ablation()
        return 0
    print("usage: python bench/fp4_lab.py [selftest|build|bench [--emu mma|wgmma|both]|ablation]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
