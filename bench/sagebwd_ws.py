"""Experiment: SageBwd's dK/dV kernel with Triton's automatic warp specialization on Hopper.

Question: the shipped dK/dV kernel (``sagebwd_triton._bwd_dkdv_kernel``, LEAN order, 16-bit
scores) runs at 2.5x its issue bound on an H100 (docs/sagebwd.md): each step waits for every
wgmma it issues, and with 128 keys on 8 warps its two warpgroups move in lockstep through ten
CTA-wide barriers per step. ``tl.range(..., warp_specialize=True)`` (Triton >= 3.5 on Hopper)
splits a 128-row tile over two consumer warpgroups that run independently, with TMA loads in a
producer warp, so one warpgroup's products can run under the other's elementwise work.

What it needs from the algorithm: the partitioned dimension (keys) must carry no reduction.
The shipped dS quantization takes one scale per 64x64 tile (an absmax over 64 keys), which
Triton's data partitioner refuses (WSDataPartition: "reduce should not happen on the partitioned
dimension"). This kernel quantizes dS^T per key row instead (absmax over the step's 64 queries):
finer than the tile, and for dK = dS^T Q the scale sits on the output row, outside the
reduction. dV, the scores and dP are the shipped kernel's.

Scope: no mask, not causal, 16-bit scores and dP, Sq a multiple of 4 (the row vectors are read
by TMA: 16-byte strides). Both are timed side by side (methods interleaved over rounds) with the
gradients' cosine against fp32 autograd through SDPA.

    python bench/sagebwd_ws.py --check            # CPU, TRITON_INTERPRET=1: against the torch model below
    python bench/sagebwd_ws.py --rounds 5 --out $OUT/sagebwd_ws.md   # GPU A/B
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sage_diffusers.kernels import sagebwd_triton as K  # noqa: E402
from sage_diffusers.reference.sagebwd import ScorePrecision  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dkdv_ws_kernel(
    k_desc, v_desc, q_desc, do_desc, mb_desc, il_desc, de_desc, sq_desc, qt_desc, ot_desc, so_desc,
    dk_ptr, dv_ptr, qk_scale, sm_scale, GROUP, SQ, SKV,
    D: tl.constexpr, DW: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, WS: tl.constexpr,
    AS_F32: tl.constexpr,
):
    """dK, dV (BLOCK_N keys, all query heads of the group) with dS^T quantized per key row."""
    pid_n = tl.program_id(0)
    bkv = tl.program_id(1)
    start_n = pid_n * BLOCK_N
    keys = start_n + tl.arange(0, BLOCK_N)
    ink = keys < SKV
    # every operand by TMA (host descriptors; a plain load feeding an MMA stops Triton 3.6's
    # warp specialization): rows past SKV / SQ read as 0. Q = 0 gives S = 0 and mb = 0 gives
    # P~ = 1 on such query rows, but invl = 0 gives P = dS = 0 and dO' = 0 zeroes the dV product
    kc = k_desc.load([bkv, start_n, 0]).reshape(BLOCK_N, D)
    vc = v_desc.load([bkv, start_n, 0]).reshape(BLOCK_N, D)
    lane = tl.arange(0, 4)  # the scale of block qi: lane qi % 4 of the aligned 4 from qi // 4 * 4
    dk = tl.zeros((BLOCK_N, DW), tl.float32)
    dv = tl.zeros((BLOCK_N, DW), tl.float32)
    dk2 = tl.zeros((BLOCK_N, DW), tl.float32)
    dv2 = tl.zeros((BLOCK_N, DW), tl.float32)
    nqb = tl.cdiv(SQ, SUB)
    for t in tl.range(0, GROUP * nqb, warp_specialize=WS):
        bh = bkv * GROUP + t // nqb
        qi = t % nqb
        m0 = qi * SUB
        qc = q_desc.load([bh, m0, 0]).reshape(SUB, D)
        st = K._dot16(kc, tl.trans(qc), AS_F32) * qk_scale  # (BLOCK_N, SUB)
        mb = mb_desc.load([bh, m0]).reshape(SUB)
        pt = tl.exp2(st - mb[None, :])
        p8t = K._f2i8(pt * 127.0)
        p = pt * il_desc.load([bh, m0]).reshape(SUB)[None, :]
        do = do_desc.load([bh, m0, 0]).reshape(SUB, D)
        dpt = K._dot16(vc, tl.trans(do), AS_F32)
        ds_big = p * (dpt - de_desc.load([bh, m0]).reshape(SUB)[None, :])
        scale, s_big, r = K._ds_scale(tl.max(tl.abs(ds_big), axis=1))  # per key row
        ds8 = K._codes_by_reciprocal(ds_big, s_big[:, None], r[:, None])
        dk_scale = ((scale * tl.sum(tl.where(lane == qi % 4, sq_desc.load([bh, qi // 4 * 4]).reshape(4), 0.0))) * sm_scale)[:, None]
        qt = qt_desc.load([bh, 0, m0]).reshape(DW, SUB)
        dk += tl.dot(ds8, tl.trans(qt), out_dtype=tl.int32).to(tl.float32) * dk_scale
        if DW < D:
            qt2 = qt_desc.load([bh, DW, m0]).reshape(DW, SUB)
            dk2 += tl.dot(ds8, tl.trans(qt2), out_dtype=tl.int32).to(tl.float32) * dk_scale
        dv_scale = tl.sum(tl.where(lane == qi % 4, so_desc.load([bh, qi // 4 * 4]).reshape(4), 0.0)) * (1.0 / 127.0)
        ot = ot_desc.load([bh, 0, m0]).reshape(DW, SUB)
        dv += tl.dot(p8t, tl.trans(ot), out_dtype=tl.int32).to(tl.float32) * dv_scale
        if DW < D:
            ot2 = ot_desc.load([bh, DW, m0]).reshape(DW, SUB)
            dv2 += tl.dot(p8t, tl.trans(ot2), out_dtype=tl.int32).to(tl.float32) * dv_scale
    K._store_dkdv(dk_ptr, dv_ptr, dk, dv, dk2, dv2, bkv, SKV, keys, ink, D, DW)


def prepare(q, k, v, do):
    """The shipped forward (16-bit scores) and backward pre-pass: everything both dK/dV kernels read."""
    state = K._forward_impl(q, k, v, None, False, None, K.PVPrecision.INT8, ScorePrecision.FP16)
    rows = K.backward_rows(do, state, dov_int8=False)
    return state, rows


def _pad4(x):
    """(B, H, n) float32 -> (B * H, n rounded up to 4), zero padded: 16-byte rows for TMA."""
    b, h, n = x.shape
    out = torch.zeros((b * h, -(-n // 4) * 4), dtype=x.dtype, device=x.device)
    out[:, :n] = x.reshape(b * h, n)
    return out


def _desc(x, shape, strides, block):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(x, list(shape), list(strides), list(block))


def run_ws(state, rows, do, ws: bool, block_n: int = 128, num_warps: int = 4, num_stages: int = 2):
    b, hq, sq_len, d = state.q8.shape
    hkv, skv = state.k8.shape[1], state.k8.shape[2]
    assert sq_len % 4 == 0, "row vectors read by TMA need 16-byte strides"
    sub = K.BLOCK_Q
    sm_scale = 1.0 / math.sqrt(d)
    dk = torch.empty((b, hkv, skv, d), dtype=torch.float32, device=do.device)
    dv = torch.empty_like(dk)
    q8t = K._transposed(state.q8)
    do16 = do.to(state.vc.dtype).contiguous()
    dw = min(d, K.LEAN_COLUMNS)
    sqt = K.token_stride(sq_len)
    bh = b * hq

    def rows3(x, n, block):  # (B, H, n, D) contiguous
        return _desc(x, (x.shape[0] * x.shape[1], n, d), (n * d, d, 1), (1, block, d))

    def vec(x):  # (B, H, Sq) float32
        return _desc(x, (bh, sq_len), (sq_len, 1), (1, sub))

    def tr(x):  # (B, H, D, Sq) int8, token stride sqt
        return _desc(x, (bh, d, sq_len), (d * sqt, sqt, 1), (1, dw, sub))

    def scales(x):  # (B, H, nqb) float32
        xp = _pad4(x)
        return _desc(xp, xp.shape, xp.stride(), (1, 4))

    _dkdv_ws_kernel[(triton.cdiv(skv, block_n), b * hkv)](
        rows3(state.kc, skv, block_n), rows3(state.vc, skv, block_n), rows3(state.qc, sq_len, sub),
        rows3(do16, sq_len, sub), vec(rows.mb), vec(rows.inv_l), vec(rows.delta), scales(state.sq), tr(q8t),
        tr(rows.dos8t), scales(rows.sdos),
        dk, dv, sm_scale * K.LOG2E, sm_scale, hq // hkv, sq_len, skv,
        D=d, DW=dw, BLOCK_N=block_n, SUB=sub, WS=ws, AS_F32=INTERPRET,
        **({} if INTERPRET else dict(num_warps=num_warps, num_stages=num_stages)),
    )
    return dk, dv


def model(state, rows, do):
    """Torch model of the per-row kernel (float32, the same operations in the same order)."""
    b, hq, sq_len, d = state.q8.shape
    hkv, skv = state.k8.shape[1], state.k8.shape[2]
    g = hq // hkv
    sm_scale = 1.0 / math.sqrt(d)
    kc = state.kc.float().repeat_interleave(g, 1)
    vc = state.vc.float().repeat_interleave(g, 1)
    st = (kc @ state.qc.float().transpose(-1, -2)) * (sm_scale * K.LOG2E)  # (B, H, Skv, Sq)
    pt = torch.exp2(st - rows.mb[:, :, None, :])
    p8t = torch.round(pt * 127.0)
    p = pt * rows.inv_l[:, :, None, :]
    dpt = vc @ do.to(state.vc.dtype).float().transpose(-1, -2)
    ds_big = p * (dpt - rows.delta[:, :, None, :])
    nqb = -(-sq_len // K.BLOCK_Q)
    dk = torch.zeros((b, hq, skv, d), dtype=torch.float64, device=do.device)
    dv = torch.zeros_like(dk)
    dos = rows.dos8t.float()  # (B, H, D, Sq)
    q8 = state.q8.float()
    for qi in range(nqb):
        sl = slice(qi * K.BLOCK_Q, min(sq_len, (qi + 1) * K.BLOCK_Q))
        blk = ds_big[..., sl]
        scale = (blk.abs().amax(-1) / K.DS_PRESCALE.value) / 127.0  # per key row
        codes = torch.where(scale[..., None] > 0, torch.round(blk / (scale[..., None] * K.DS_PRESCALE.value)
                                                               .clamp_min(1e-45)), 0.0)
        dk += ((codes @ q8[:, :, sl]) * (scale * state.sq[:, :, qi, None] * sm_scale)[..., None]).double()
        dv += ((p8t[..., sl] @ dos[..., sl].transpose(-1, -2)) * (rows.sdos[:, :, qi, None, None] / 127.0)).double()
    fold = lambda x: x.view(b, hkv, g, skv, d).sum(2).float()  # noqa: E731
    return fold(dk), fold(dv)


def _inputs(b, h, hkv, s, d, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda heads, scale=1.0: (torch.randn(b, heads, s, d, generator=gen) * scale).to(device, torch.bfloat16)  # noqa: E731
    return mk(h, 2.0), mk(hkv, 2.0), mk(hkv), mk(h)


def check() -> int:
    """CPU: the kernel (interpreter) against the torch model, and the shipped dK/dV next to it."""
    worst = 0.0
    dv_equal = True
    for (b, h, hkv, s, d) in ((1, 2, 1, 192, 64), (1, 1, 1, 132, 128)):
        q, k, v, do = _inputs(b, h, hkv, s, d, "cpu")
        state, rows = prepare(q, k, v, do)
        dk, dv = run_ws(state, rows, do, ws=False)
        mk, mv = model(state, rows, do)
        _, sk, sv = K._backward_impl(do, state, None, False, None, K.DoVPrecision.FP16, scores=ScorePrecision.FP16)
        dv_equal &= torch.equal(dv, sv)  # dV's operands and order are the shipped kernel's
        for name, x, y, z in (("dK", dk, mk, sk), ("dV", dv, mv, sv)):
            rel = ((x - y).abs().max() / y.abs().max()).item()
            worst = max(worst, rel)
            cos = torch.nn.functional.cosine_similarity(x.flatten(), z.flatten(), dim=0).item()
            print(f"{b}x{h}/{hkv}x{s}x{d} {name}: max |kernel - model| / max |model| = {rel:.2e}; "
                  f"cos to the shipped kernel {cos:.6f}")
    ok = worst < 1e-5 and dv_equal
    print("PASS" if ok else "FAIL", f"(worst {worst:.2e}, bound 1e-5; dV bit-equal to the shipped kernel's: {dv_equal})")
    return 0 if ok else 1


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def bench(args) -> int:
    dev = "cuda"
    known = {f"{s}x{d}": (b, h, hkv, s, d) for b, h, hkv, s, d in
             ((1, 24, 24, 16384, 128), (1, 48, 48, 16384, 64), (1, 24, 24, 4096, 128))}
    shapes = [known[name] for name in args.shapes.split(",")]
    lines = ["# SageBwd dK/dV: shipped kernel vs warp-specialized per-key-row dS kernel", "",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
             f"{args.rounds} rounds, methods interleaved, `triton.testing.do_bench` per method and round "
             "(ms, the dK/dV kernel alone, pre-pass excluded); cos: dK, dV against fp32 autograd through SDPA "
             "(N(0,1) inputs, q and k x2).", "",
             "| shape | method | min | median | max | vs shipped (median) | dK cos | dV cos |", "|---|---|---|---|---|---|---|---|"]
    for (b, h, hkv, s, d) in shapes:
        q, k, v, do = _inputs(b, h, hkv, s, d, dev)
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        ref_out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf)
        gq, gk, gv = torch.autograd.grad(ref_out, (qf, kf, vf), do.float())
        del ref_out, gq, qf, kf, vf
        state, rows = prepare(q, k, v, do)
        bwd = K._bwd_dkdv_kernel
        # contiguous like the shipped path's (SDPA's gk may come back in another memory layout)
        dk_s = torch.empty((b, hkv, s, d), dtype=torch.float32, device=dev)
        dv_s = torch.empty_like(dk_s)
        q8t = K._transposed(state.q8)
        k8t = K._transposed(state.k8)
        do16 = do.to(state.vc.dtype).contiguous()
        mask, _ = K._mask_arg(None, state.q8)
        kext = K.key_extent(None, state.sq.view(torch.int32))
        sm_scale = 1.0 / math.sqrt(d)

        def shipped():
            bwd[lambda meta: (triton.cdiv(s, meta["BLOCK_N"]), b * hkv)](
                state.q8, state.sq, q8t, state.k8, state.sk, k8t, state.v8, state.sv, state.vc, state.qc, state.kc,
                rows.mb, rows.inv_l, rows.delta, do16, rows.do8, rows.sdo, rows.dos8t, rows.sdos, mask, kext, dk_s, dv_s,
                dk_s, sm_scale * K.LOG2E, sm_scale, hkv, h // hkv, s, s, K.token_stride(s), K.token_stride(s),
                D=d, SUB=K.BLOCK_Q, HAS_MASK=False, IS_CAUSAL=False, DOV_INT8=False, DOT16_AS_F32=False,
                ACC_XU=K.acc_convert() is K.AccConvert.XU, QK16=True, DW=min(d, K.LEAN_COLUMNS), FUSE_DQ=False,
                DV_LAST=True)
            return dk_s, dv_s

        methods = {
            "shipped": ("shipped (lean, autotuned)", shipped),
            # 128 keys: two consumer warpgroups of 64 keys and a producer warp (12 warps in all)
            "ws128": ("per-row, warp-specialized, 128 keys",
                      lambda: run_ws(state, rows, do, ws=True, block_n=128, num_warps=4)),
            # the same kernel without the specialization: what the per-row dS and TMA loads alone give
            "pr128w8": ("per-row, 128 keys on 8 warps", lambda: run_ws(state, rows, do, ws=False, block_n=128, num_warps=8)),
            "pr64w4": ("per-row, 64 keys on 4 warps", lambda: run_ws(state, rows, do, ws=False, block_n=64, num_warps=4)),
        }
        methods = {label: fn for key, (label, fn) in methods.items() if key in args.methods.split(",")}
        times = {m: [] for m in methods}
        accs = {}
        for m, fn in list(methods.items()):
            try:
                dk, dv = fn()
                torch.cuda.synchronize()
                accs[m] = (_cos(dk, gk), _cos(dv, gv))
            except Exception as exc:  # a variant Triton cannot build: reported, not timed
                print(f"{m}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                del methods[m], times[m]
        for _ in range(args.rounds):
            for m, fn in methods.items():
                times[m].append(triton.testing.do_bench(fn, warmup=5, rep=100))
        base = statistics.median(times.get("shipped (lean, autotuned)", [float("nan")]))
        for m in methods:
            t = times[m]
            lines.append(f"| {b}x{h}x{s}x{d} | {m} | {min(t):.3f} | {statistics.median(t):.3f} | {max(t):.3f} | "
                         f"{base / statistics.median(t):.2f}x | {accs[m][0]:.5f} | {accs[m][1]:.5f} |")
            print(lines[-1], flush=True)
        del state, rows
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--methods", default="shipped,pr64w4,pr128w8,ws128",
                    help="comma-separated: shipped, ws128, pr128w8, pr64w4 (one per process isolates a crash)")
    ap.add_argument("--shapes", default="16384x128,16384x64,4096x128")
    args = ap.parse_args()
    t0 = time.time()
    rc = check() if args.check else bench(args)
    print(f"done in {time.time() - t0:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
