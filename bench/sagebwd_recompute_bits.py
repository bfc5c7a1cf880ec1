"""Does SageBwd's backward recompute the forward's scores bit for bit on the GPU?

The backward recomputes S = Q K^T (16-bit operands, float32 sums) and takes P~ = exp2(s - m) with
the forward's row max m. Where the recomputed sums differ from the forward's, P~ differs; where the
products cancel (heavy-tailed operands x1e4), by many log2 units. This compares, on the same
inputs, the scores of Triton ``tl.dot`` in the forward's shape (query rows as the MMA's M side),
in the dQ kernel's, and in the dK/dV kernel's transposed shape (keys as M, then transposed), and
cuBLAS's (torch.matmul), elementwise in log2 units (the scores times scale * log2(e)). Then
SageBwd's gradients four ways (Triton or reference forward state, Triton or reference backward,
all on the GPU) against float32 attention, to tell the recompute's part from the algorithm's.

    python bench/sagebwd_recompute_bits.py [--out eval/results/sagebwd_recompute_bits_<gpu>.md]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sage_diffusers import realistic  # noqa: E402
from sage_diffusers.kernels import sagebwd_triton as tri  # noqa: E402
from sage_diffusers.reference import cosine  # noqa: E402
from sage_diffusers.reference import sagebwd as ref  # noqa: E402
from sage_diffusers.reference.online_softmax import LOG2E  # noqa: E402


@triton.jit
def _scores(q_ptr, k_ptr, s_ptr, SQ, SKV, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            KEYS_AS_M: tl.constexpr, AS_F32: tl.constexpr):
    """S tile (BM queries x BN keys) of one head: q (SQ, D), k (SKV, D) contiguous, s (SQ, SKV)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rm[:, None] * D + d[None, :], mask=(rm < SQ)[:, None], other=0.0)
    k = tl.load(k_ptr + rn[:, None] * D + d[None, :], mask=(rn < SKV)[:, None], other=0.0)
    if AS_F32:  # the interpreter's bfloat16 dot is wrong; float32 copies have the same exact products
        q, k = q.to(tl.float32), k.to(tl.float32)
    if KEYS_AS_M:
        st = tl.dot(k, tl.trans(q), out_dtype=tl.float32)  # (BN, BM), as the dK/dV kernel
        tl.store(s_ptr + rm[None, :] * SKV + rn[:, None], st, mask=(rm < SQ)[None, :] & (rn < SKV)[:, None])
    else:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
        tl.store(s_ptr + rm[:, None] * SKV + rn[None, :], s, mask=(rm < SQ)[:, None] & (rn < SKV)[None, :])


SHAPES = {  # name: (BM, BN, num_warps, keys as M)
    "forward (128 q x 64 k, 8 warps)": (128, 64, 8, False),
    "dQ kernel (128 q x 64 k, 8 warps)": (128, 64, 8, False),
    "dQ kernel (64 q x 64 k, 4 warps)": (64, 64, 4, False),
    "dK/dV kernel (128 k x 64 q, 8 warps), transposed": (64, 128, 8, True),
    "dK/dV kernel (64 k x 64 q, 4 warps), transposed": (64, 64, 4, True),
}


def triton_scores(q, k, bm, bn, warps, keys_as_m):
    sq, d = q.shape
    s = torch.empty(sq, k.shape[0], device=q.device, dtype=torch.float32)
    _scores[(triton.cdiv(sq, bm), triton.cdiv(k.shape[0], bn))](q, k, s, sq, k.shape[0], D=d, BM=bm, BN=bn,
                                                                 KEYS_AS_M=keys_as_m, AS_F32=q.device.type == "cpu",
                                                                 num_warps=warps)
    return s


def score_table(case_name: str, q, k, qk_scale: float) -> list[str]:
    base = triton_scores(q, k, *SHAPES["forward (128 q x 64 k, 8 warps)"])
    rows = []
    others = {name: triton_scores(q, k, *cfg) for name, cfg in SHAPES.items()}
    others["torch.matmul of float32 copies (no TF32)"] = q.float() @ k.float().t()
    for name, s in others.items():
        diff = (s - base).abs() * qk_scale
        top = s.max(-1).values * qk_scale - base.max(-1).values * qk_scale  # recomputed row max above the forward's
        rows.append(f"| {case_name} | {name} | {(s != base).float().mean().item():.4f} | {diff.max().item():.3g} | "
                    f"{diff.mean().item():.3g} | {top.max().item():.3g} | {(base.abs().max() * qk_scale).item():.3g} |")
    return rows


def grads_table(case, dtype, shape) -> list[str]:
    b, hq, hkv, sq, skv, d = shape
    q, k, v, mask = realistic.case_inputs(case, b, hq, hkv, sq, skv, d, seed=5, dtype=dtype, device=DEVICE)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    x = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(*x, enable_gqa=hq != hkv)
    want = torch.autograd.grad(o, x, do.float())
    st = {"triton": tri.sagebwd_forward(q, k, v, None, False, None, "fp16", "fp16"),
          "reference": ref.sagebwd_forward(q, k, v, None, False, None, "fp16", "fp16")}
    bwd = {"triton": tri.sagebwd_backward, "reference": ref.sagebwd_backward}
    # the output both states should round: float64 P V with the reference state's LSE
    g = hq // hkv
    kc, vc = (t.repeat_interleave(g, 1).double() for t in (st["reference"].kc, st["reference"].vc))
    s = (st["reference"].qc.double() @ kc.transpose(-1, -2)) * (LOG2E / math.sqrt(d))
    o64 = torch.exp2(s - st["reference"].lse2.double()[..., None]) @ vc
    ulp = torch.exp2(torch.floor(torch.log2(o64.abs().clamp_min(1e-30))) - 7)  # bfloat16's spacing at o64
    delta64 = (do.double() * o64).sum(-1)
    st["triton, float32 inputs (out not rounded)"] = tri.sagebwd_forward(q.float(), k.float(), v.float(), None, False,
                                                                        None, "fp16", "fp16")
    st["triton, out of the reference"] = st["triton"]._replace(out=st["reference"].out)
    st["triton, out = float64 P V rounded"] = st["triton"]._replace(out=o64.to(dtype))
    rows = []
    for fs, state in st.items():
        err = (state.out.double() - o64).abs() / ulp
        derr = ((do.double() * state.out.double()).sum(-1) - delta64).abs()
        for bs, fn in bwd.items():
            gr = fn(do, state, None, False, None, "fp16", scores="fp16")
            rows.append(f"| {case.name} | {fs} | {err.max().item():.3f} / {(err > 0.5001).double().mean().item():.5f} | "
                        f"{derr.max().item():.4g} | {bs} | " + " | ".join(f"{cosine(a, w):.5f}" for a, w in zip(gr, want)) + " |")
    return rows


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a check under TRITON_INTERPRET=1
GRAD_SHAPE = (2, 4, 2, 1000, 1000, 128) if DEVICE == "cuda" else (1, 2, 1, 256, 256, 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU, Triton interpreter"
    d, sq, skv = 128, GRAD_SHAPE[3], GRAD_SHAPE[4]
    qk_scale = LOG2E / math.sqrt(d)
    lines = [f"# SageBwd's score recompute on the GPU ({gpu})", "",
             f"torch {torch.__version__}, triton {triton.__version__}; `python bench/sagebwd_recompute_bits.py`. "
             f"One head, {sq} queries x {skv} keys, head dim {d}, bfloat16 operands from "
             "`sage_diffusers.realistic` (seed 5). Scores in log2 units (times scale * log2(e)), each against "
             "Triton's forward shape.", "",
             "| inputs | scores computed as | share of elements differing | max abs diff | mean abs diff | "
             "max (row max - forward's row max) | largest |score| |", "|---|---|---|---|---|---|---|"]
    for case in realistic.CASES:
        if case.name not in ("flat head x1/8", "sharp head x400", "x1e4 operands, heavy tails"):
            continue
        q, k, _, _ = realistic.case_inputs(case, 1, 1, 1, sq, skv, d, seed=5, dtype=torch.bfloat16, device=DEVICE)
        lines += score_table(case.name, q[0, 0].contiguous(), k[0, 0].contiguous(), qk_scale)
    lines += ["", f"Gradients (cos against float32 attention), {GRAD_SHAPE} bfloat16, 16-bit scores:", "",
              "| inputs | forward state | out's error in bf16 ulps: max / share > 0.5 | max abs error of delta = rowsum(dO o out) | backward | dQ | dK | dV |",
              "|---|---|---|---|---|---|---|---|"]
    for case in realistic.CASES:
        if case.name in ("sharp head x400", "x1e4 operands, heavy tails"):
            lines += grads_table(case, torch.bfloat16, GRAD_SHAPE)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
