#!/usr/bin/env python3
"""Lab: SageBwd's sm_90a backward kernels (``csrc/sm90_sagebwd/``) in every built variant, checked against
the torch reference and timed kernel by kernel beside the shipped Triton backward and cuDNN BF16's backward.

The kernels are warp-specialized: a producer lane bulk-copies each query (dK/dV) or key (dQ) block's
operands into a ring of stages, and two consumer warpgroups of 64 keys (queries) each run S^T, dP^T
(16-bit wgmma), the softmax gradient and dS quantization in registers, and the INT8 products, with
barriers among a warpgroup's own 128 threads only. Here their operands are images of the swizzled
shared-memory tiles made with torch ops from the reference's quantized operands (the layouts come from
the lab extension, ``bench/sm90_sagebwd/``: ``layout_table``), so the timing is the kernels alone; the
package's path writes them with its Triton image pre-pass (``sage_diffusers/kernels/sagebwd_sm90.py``;
``eval/bench_sagebwd.py --methods sagebwd_sm90`` times the whole call). The lab binding also has the
variants the shipped policy leaves out: dV in place (dO' per channel), the serial hd64 schedule, and dK
and dQ as bf16 products summed in place (``DkAcc`` / ``DqAcc::kBf16InPlace``: no dS tile scale, no INT8
codes of dS, no per-step conversion; other numerics than the package's, specified by
:func:`dk16_reference` and :func:`dq16_reference`, dQ with the smoothed K in bf16). The
numerics are otherwise the shipped ones with 16-bit scores (``sage_diffusers/reference/sagebwd.py``,
``scores="fp16"``); no masks, causality or GQA; Sq % 64 == 0, Skv % 128 == 0.

    python bench/sagebwd_cuda_dkdv.py --check                  # small shapes against the reference
    python bench/sagebwd_cuda_dkdv.py --shapes 1x24x16384x128,1x48x16384x64 --rounds 3 \
        --out eval/results/sagebwd_cuda_dkdv_h100.md

Timing: kernel device times from ``torch.profiler``, rounds interleaving the methods (ours, the
shipped Triton backward's kernels, cuDNN BF16's backward kernels), min / median / max over rounds of the
per-call mean. Accuracy at the timed shapes: ours against the shipped Triton kernel's dK / dV (same
forward state); at the check shapes: against the torch reference, and both against float64 autograd.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_utils import git_head, make_inputs  # noqa: E402
from eval import _cli  # noqa: E402
from sage_diffusers.kernels.sagebwd_sm90 import (channel_codes_reference, dv_in_place_reference,  # noqa: E402
                                                  key_entries_reference)
from sage_diffusers.reference import cosine, relative_l1  # noqa: E402
from sage_diffusers.reference import sagebwd as ref  # noqa: E402
from sage_diffusers.reference.online_softmax import LOG2E  # noqa: E402
from sage_diffusers.reference.quant import quantize_int8_per_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "bench" / "sm90_sagebwd"
BLOCK_M, BLOCK_N, KEYS_PER_WG = 64, 128, 64
DS_PRESCALE = 2.0 ** 32  # the kernel holds dS times this (dkdv_kernel.cuh kDsPrescale)


def build():
    """The experiment's extension (JIT, cached by source hash)."""
    from sage_diffusers.kernels import _jit, int8_sm90
    return _jit.load_extension("sage_diffusers_sagebwd_sm90_lab", [LAB / "binding.cu", LAB / "lab_hd64.cu", LAB / "lab_hd128.cu"],
                               extra_cuda_cflags=list(int8_sm90._NVCC_FLAGS),
                               extra_include_paths=[ROOT / "csrc" / "sm90_sagebwd"])  # hashed with csrc/common: a kernel edit rebuilds


def vt_position_to_query(p: torch.Tensor) -> torch.Tensor:
    """The query stored at k position p (< 64) of an INT8 B image: csrc/sm90_int8/tile_config.hpp
    vt_position_to_key, as the 8-bit forward's images use it (the inverse of int8_sm90's map)."""
    from sage_diffusers.kernels import int8_sm90
    return torch.argsort(int8_sm90._vt_key_to_position(p.device, BLOCK_M))[p]


def _images_of(x: torch.Tensor, rows: int, table: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, C) -> (B, H, S / rows, rows * C) with each tile's elements at the table's offsets."""
    b, h, s, c = x.shape
    tiles = x.reshape(b, h, s // rows, rows * c)
    out = torch.empty_like(tiles)
    out[..., table.reshape(-1).to(x.device)] = tiles
    return out


def operands(ext, q, k, v, do, st: ref.SageBwdState, sm_scale: float, dv_channel: bool = False) -> dict:
    """The kernel's images and vectors from the forward state ``st`` (16-bit scores) and dO, with the
    reference's operations: P~'s inverse row sum, dO' = dO / l quantized per 64 queries, delta.
    ``dv_channel``: dO' quantized per channel over all queries instead (the kernel's dV in place;
    ``dv_scale`` (B, H, D) = 1/127 times each channel's scale)."""
    b, h, sq, d = q.shape
    skv = k.shape[2]
    if sq % BLOCK_M or skv % BLOCK_N:
        raise ValueError(f"the experiment's kernel needs Sq % {BLOCK_M} == 0 and Skv % {BLOCK_N} == 0, got {sq}, {skv}")
    live = torch.isfinite(st.lse2)
    zero = torch.zeros((), device=q.device)
    m_safe = torch.where(live, st.m2, zero)
    inv_l = torch.exp2(m_safe - torch.where(live, st.lse2, zero))  # (B, H, Sq)
    dos = do.float() * inv_l[..., None]
    dos8, sdos = quantize_int8_per_block(dos, BLOCK_M)
    dv_scale = torch.empty(0, device=q.device)
    if dv_channel:
        dos8, sch = channel_codes_reference(do, inv_l)  # (B, H, Sq, D), (B, H, D)
        dv_scale = (sch * ref.P_SCALE).contiguous()
    delta = (do.float() * st.out.float()).sum(-1)  # (B, H, Sq)
    cdt = st.vc.dtype
    kv16, q16, t8 = (ext.layout_table(kind, d) for kind in ("kv16", "q16", "t8"))
    as16 = lambda x: x.to(cdt).contiguous().view(torch.int16)  # noqa: E731
    perm = vt_position_to_query(torch.arange(BLOCK_M, device=q.device))

    def t8_images(codes: torch.Tensor) -> torch.Tensor:  # (B, H, Sq, D) int8 -> per block D x 64, permuted
        blocks = codes.reshape(b, h, sq // BLOCK_M, BLOCK_M, d)[:, :, :, perm, :]
        return _images_of(blocks.transpose(-1, -2).reshape(b, h, -1, BLOCK_M), d, t8)

    vec = torch.zeros(b, h, sq // BLOCK_M, ext.vec_floats, dtype=torch.float32, device=q.device)
    vec[..., 0:64] = m_safe.reshape(b, h, -1, BLOCK_M)
    vec[..., 64:128] = (inv_l * DS_PRESCALE).reshape(b, h, -1, BLOCK_M)  # exact: a power of two
    vec[..., 128:192] = delta.reshape(b, h, -1, BLOCK_M)
    vec[..., 192] = sdos * ref.P_SCALE
    vec[..., 193] = st.sq
    return dict(
        k=_images_of(as16(st.kc), KEYS_PER_WG, kv16).view(torch.uint8),
        v=_images_of(as16(st.vc), KEYS_PER_WG, kv16).view(torch.uint8),
        q=_images_of(as16(st.qc), BLOCK_M, q16).view(torch.uint8),
        dO=_images_of(as16(do), BLOCK_M, q16).view(torch.uint8),
        qt=t8_images(st.q8).view(torch.uint8),
        dot=t8_images(dos8).view(torch.uint8),
        vec=vec.contiguous(), bf16=cdt == torch.bfloat16, qk_scale=sm_scale * LOG2E, sm_scale=sm_scale,
        dv_scale=dv_scale)


def dq_operands(ext, q, do, st: ref.SageBwdState, sm_scale: float, ks16: Optional[torch.Tensor] = None) -> dict:
    """The dQ kernel's images (Q, dO per 64 queries; K, V, K^T per 64 keys), K's block scales and the
    rows' m, 2^32 / l and delta, with the reference's operations. ``ks16`` (B, H, Skv, D) bf16, the
    smoothed K (:func:`smoothed_k16`): its 16-bit images take K^T's place (DqAcc::kBf16InPlace)."""
    b, h, sq, d = q.shape
    skv = st.kc.shape[2]
    if sq % BLOCK_N or skv % KEYS_PER_WG:
        raise ValueError(f"the experiment's dQ kernel needs Sq % {BLOCK_N} == 0 and Skv % {KEYS_PER_WG} == 0, "
                         f"got {sq}, {skv}")
    live = torch.isfinite(st.lse2)
    zero = torch.zeros((), device=q.device)
    m_safe = torch.where(live, st.m2, zero)
    inv_l = torch.exp2(m_safe - torch.where(live, st.lse2, zero))
    kv16, t8 = ext.layout_table("kv16", d), ext.layout_table("t8", d)
    cdt = st.vc.dtype
    as16 = lambda x: x.to(cdt).contiguous().view(torch.int16)  # noqa: E731
    perm = vt_position_to_query(torch.arange(KEYS_PER_WG, device=q.device))
    kt = st.k8.reshape(b, h, skv // KEYS_PER_WG, KEYS_PER_WG, d)[:, :, :, perm, :]
    k_scale = key_entries_reference(st.sk).view(torch.float32)  # every key visible
    return dict(
        q=_images_of(as16(st.qc), BLOCK_M, kv16).view(torch.uint8),
        dO=_images_of(as16(do), BLOCK_M, kv16).view(torch.uint8),
        k=_images_of(as16(st.kc), KEYS_PER_WG, kv16).view(torch.uint8),
        v=_images_of(as16(st.vc), KEYS_PER_WG, kv16).view(torch.uint8),
        kt=(_images_of(as16(ks16), KEYS_PER_WG, kv16) if ks16 is not None else
            _images_of(kt.transpose(-1, -2).reshape(b, h, -1, KEYS_PER_WG), d, t8)).view(torch.uint8),
        k_scale=k_scale, m=m_safe.contiguous(), inv_l=(inv_l * DS_PRESCALE).contiguous(),
        delta=(do.float() * st.out.float()).sum(-1).contiguous(), bf16=cdt == torch.bfloat16,
        qk_scale=sm_scale * LOG2E, sm_scale=sm_scale)


def run_dq(ext, ops: dict, shape, overlap: bool = False, dq16: bool = False) -> torch.Tensor:
    """dQ (B, H, Sq, D) float32 from the dQ kernel; ``overlap``: its overlapped schedule (bf16);
    ``dq16``: dQ as a bf16 product summed in place (operands with ``ks16``; :func:`dq16_reference`)."""
    dq = torch.empty(shape, dtype=torch.float32, device="cuda")
    ext.dq(ops["q"], ops["dO"], ops["k"], ops["v"], ops["kt"], ops["k_scale"], ops["m"], ops["inv_l"], ops["delta"],
           dq, ops["bf16"], ops["qk_scale"], ops["sm_scale"], overlap or dq16, dq16)
    return dq


def run_ours(ext, ops: dict, shape, overlap: bool = False, dk16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV (B, H, Skv, D) float32 from the kernel; ``overlap``: the overlapped schedule (hd64);
    ``dk16``: dK as a bf16 product summed in place (DkAcc::kBf16InPlace, :func:`dk16_reference`)."""
    b, h, skv, d = shape
    dk = torch.empty(b, h, skv, d, dtype=torch.float32, device="cuda")
    dv = torch.empty_like(dk)
    ext.dkdv(ops["k"], ops["v"], ops["q"], ops["dO"], ops["qt"], ops["dot"], ops["vec"], dk, dv, ops["bf16"],
             ops["qk_scale"], ops["sm_scale"], overlap, ops["dv_scale"], dk16)
    return dk, dv


def ds16_reference(st: ref.SageBwdState, do: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """dS * DS_PRESCALE rounded to bf16, as float64 (B, H, Sq, Skv): the reference's dS (16-bit scores in
    the forward's key tiles, delta from the output; no mask), the A operand of the bf16 dK and dQ
    products (DkAcc / DqAcc::kBf16InPlace; the lab's numerics, not the package's)."""
    p_tilde, inv_l = ref.recompute_p(st, None, False, sm_scale, ref.ScorePrecision.FP16)
    dp = do.to(st.vc.dtype).float() @ st.vc.float().transpose(-1, -2)
    delta = (do.float() * st.out.float()).sum(-1, keepdim=True)
    p = p_tilde * inv_l
    return (p * (dp - delta) * DS_PRESCALE).to(torch.bfloat16).double()


def dk16_reference(st: ref.SageBwdState, do: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """dK (B, H, Skv, D) float32 as DkAcc::kBf16InPlace computes it: :func:`ds16_reference` transposed
    times Q in 16 bits, summed exactly, times sm_scale / DS_PRESCALE."""
    ds16 = ds16_reference(st, do, sm_scale)
    return ((ds16.transpose(-1, -2) @ st.qc.double()) * (sm_scale / DS_PRESCALE)).float()


def smoothed_k16(k: torch.Tensor) -> torch.Tensor:
    """K minus its token mean (float32, the reference's smoothing; no mask) rounded to bf16, (B, H, Skv, D):
    DqAcc::kBf16InPlace's K operand (dQ needs the smoothed K: eval/results/sagebwd_error_budget_cpu.md)."""
    return ref.masked_kv(k, k, None)[0].to(torch.bfloat16)


def dq16_reference(st: ref.SageBwdState, do: torch.Tensor, ks16: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """dQ (B, H, Sq, D) float32 as DqAcc::kBf16InPlace computes it: :func:`ds16_reference` times the
    smoothed K in bf16 (``ks16``), summed exactly, times sm_scale / DS_PRESCALE."""
    ds16 = ds16_reference(st, do, sm_scale)
    return ((ds16 @ ks16.double()) * (sm_scale / DS_PRESCALE)).float()


def metrics(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = float((got.double() - want.double()).abs().max())
    return f"cos {cosine(got, want):.6f} rel-L1 {relative_l1(got, want):.2e} max|diff| {diff:.3e}"


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The check's rule: finite, and cos > 0.99999 against the reference (the same quantized operands;
    only fp32 summation orders and the MUFU's exp2 differ)."""
    return bool(torch.isfinite(got).all()) and cosine(got, want) > 0.99999


def check_inputs(kind: str, b: int, h: int, s: int, d: int, dtype, seed: int) -> list[torch.Tensor]:
    """q, k, v, dO (B, H, S, D) for one check case (the kernels take no mask, so no padding cases):
    ``offsets``: per-channel offsets in Q, K and V (K's as DiTs have, which smoothing removes);
    ``sharp``: those with logits x20 (Q scaled); ``tiny`` / ``huge``: every tensor x1e-4 / Q, K x1e2
    and V, dO x1e4; ``inference``: made under torch.inference_mode(), as ComfyUI does."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda")  # noqa: E731
    with torch.inference_mode(kind == "inference"):
        q, k, v, do = (rnd(b, h, s, d) for _ in range(4))
        q, k, v = (x + c * rnd(1, h, 1, d) for x, c in ((q, 1.0), (k, 3.0), (v, 2.0)))
        if kind == "sharp":
            q = q * 20
        elif kind == "tiny":
            q, k, v, do = (x * 1e-4 for x in (q, k, v, do))
        elif kind == "huge":
            q, k, v, do = q * 1e2, k * 1e2, v * 1e4, do * 1e4
        return [x.to(dtype) for x in (q, k, v, do)]


def check(ext) -> bool:
    """Small shapes and realistic inputs (check_inputs): ours against the reference's dQ, dK, dV (same
    state), both against float64 autograd."""
    ok = True
    for (b, h, s, d), dtype, kind in (((1, 2, 256, 128), torch.bfloat16, "offsets"),
                                      ((2, 3, 512, 64), torch.float16, "sharp"),
                                      ((1, 2, 512, 64), torch.bfloat16, "inference"),
                                      ((1, 1, 640, 128), torch.float16, "tiny"),
                                      ((1, 2, 256, 64), torch.bfloat16, "huge"),
                                      ((1, 2, 384, 128), torch.bfloat16, "sharp")):
        q, k, v, do = check_inputs(kind, b, h, s, d, dtype, seed=s + d)
        sm_scale = 1.0 / math.sqrt(d)
        st = ref.sagebwd_forward(q, k, v, pv="fp16", scores="fp16")
        dq_ref, dk_ref, dv_ref = ref.sagebwd_backward(do, st, scores="fp16")
        ops = operands(ext, q, k, v, do, st, sm_scale)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        out = F.scaled_dot_product_attention(qd, kd, vd)
        dq64, dk64, dv64 = torch.autograd.grad(out, (qd, kd, vd), do.double())
        ops_dq = dq_operands(ext, q, do, st, sm_scale)
        for overlap in (False, True) if dtype == torch.bfloat16 else (False,):
            dq = run_dq(ext, ops_dq, (b, h, s, d), overlap)
            tag = f"{b}x{h}x{s}x{d} {str(dtype).split('.')[-1]} {kind}{' overlap' if overlap else ''}"
            print(f"{tag}: dQ ours vs reference {metrics(dq, dq_ref)}; vs float64: ours {metrics(dq, dq64)} | "
                  f"reference {metrics(dq_ref, dq64)}")
            ok = ok and agrees(dq, dq_ref)
        if dtype == torch.bfloat16:  # dQ as a bf16 product of the smoothed K
            ks16 = smoothed_k16(k)
            dq = run_dq(ext, dq_operands(ext, q, do, st, sm_scale, ks16), (b, h, s, d), dq16=True)
            want = dq16_reference(st, do, ks16, sm_scale)
            tag = f"{b}x{h}x{s}x{d} {str(dtype).split('.')[-1]} {kind} dQ bf16"
            print(f"{tag}: dQ ours vs its reference {metrics(dq, want)}; vs float64: ours {metrics(dq, dq64)} | "
                  f"reference {metrics(dq_ref, dq64)}")
            ok = ok and agrees(dq, want)
        variants = [(False, False, False)] + ([(True, False, False)] if d == 64 else [])
        if dtype == torch.bfloat16:  # dV in place: hd64 with the overlapped schedule, hd128 serial; dK in bf16
            variants += [(d == 64, True, False), (d == 64, False, True), (d == 64, True, True)]
        dk16_want = dk16_reference(st, do, sm_scale) if dtype == torch.bfloat16 else None
        for overlap, in_place, dk16 in variants:
            dv_want = dv_in_place_reference(st, do, sm_scale) if in_place else dv_ref
            dk_want = dk16_want if dk16 else dk_ref
            dk, dv = run_ours(ext, operands(ext, q, k, v, do, st, sm_scale, in_place) if in_place else ops,
                              (b, h, s, d), overlap, dk16)
            torch.cuda.synchronize()
            tag = (f"{b}x{h}x{s}x{d} {str(dtype).split('.')[-1]} {kind}{' overlap' if overlap else ''}"
                   f"{' dV in place' if in_place else ''}{' dK bf16' if dk16 else ''}")
            print(f"{tag}: dK ours vs its reference {metrics(dk, dk_want)}; dV {metrics(dv, dv_want)}")
            print(f"{tag}: vs float64: dK ours {metrics(dk, dk64)} | reference {metrics(dk_ref, dk64)}")
            print(f"{tag}: vs float64: dV ours {metrics(dv, dv64)} | reference {metrics(dv_ref, dv64)}")
            ok = ok and agrees(dk, dk_want) and agrees(dv, dv_want)
    print("CHECK", "PASSED" if ok else "FAILED")
    return ok


def _kernel_ms(fn, match, iters: int) -> float:
    """Mean device ms per call of fn() summed over the CUDA kernels whose name satisfies match."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = sum(ev.device_time_total for ev in prof.events()
                if ev.device_type == torch.autograd.DeviceType.CUDA and match(ev.name))
    return total / 1e3 / iters


def bench(ext, shapes, rounds: int, iters: int) -> list[str]:
    from sage_diffusers.kernels import sagebwd_triton as tri
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lines = []
    for shape in shapes:
        b, h, s, d = shape
        q, k, v = make_inputs(b, h, s, d)
        do = torch.randn_like(q)
        sm_scale = 1.0 / math.sqrt(d)
        st = tri._forward_impl(q, k, v, None, False, None, ref.PVPrecision.FP16, ref.ScorePrecision.FP16)
        ops = operands(ext, q, k, v, do, st, sm_scale)
        kernels = tri.bwd_kernels(d)
        triton_bwd = lambda: tri._backward_impl(do, st, None, False, None, ref.DoVPrecision.FP16,  # noqa: E731
                                                scores=ref.ScorePrecision.FP16)
        ops_ch = operands(ext, q, k, v, do, st, sm_scale, dv_channel=True)
        dq_t, dk_t, dv_t = triton_bwd()
        ops_dq = dq_operands(ext, q, do, st, sm_scale)
        ops_dq16 = dq_operands(ext, q, do, st, sm_scale, smoothed_k16(k))
        acc = [f"- dQ kernel: dQ {metrics(run_dq(ext, ops_dq, shape), dq_t)}",
               f"- dQ kernel, overlapped: dQ {metrics(run_dq(ext, ops_dq, shape, True), dq_t)}",
               f"- dQ kernel, dQ bf16: dQ {metrics(run_dq(ext, ops_dq16, shape, dq16=True), dq_t)}"]
        for label, o, overlap, dk16 in (("serial", ops, False, False), ("overlapped", ops, True, False),
                                        ("dV in place", ops_ch, d == 64, False),
                                        ("dV in place, dK bf16", ops_ch, d == 64, True)):
            if overlap and d != 64 and o is ops:
                continue
            dk, dv = run_ours(ext, o, shape, overlap, dk16)
            acc.append(f"- {label}: dK {metrics(dk, dk_t)}; dV {metrics(dv, dv_t)}")
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg)
        cudnn_bwd = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
        methods = {
            "ours dK/dV": (lambda: run_ours(ext, ops, shape), lambda n: "dkdv_kernel" in n),
        }
        if d == 64:
            methods["ours dK/dV, overlapped"] = (lambda: run_ours(ext, ops, shape, True), lambda n: "dkdv_kernel" in n)
        methods["ours dK/dV, dV in place (dO' per channel)"] = (lambda: run_ours(ext, ops_ch, shape, d == 64),
                                                                 lambda n: "dkdv_kernel" in n)
        methods["ours dK/dV, dV in place, dK bf16 in place"] = (lambda: run_ours(ext, ops_ch, shape, d == 64, True),
                                                                 lambda n: "dkdv_kernel" in n)
        methods["ours dQ"] = (lambda: run_dq(ext, ops_dq, shape), lambda n: "dq_kernel" in n)
        methods["ours dQ, overlapped"] = (lambda: run_dq(ext, ops_dq, shape, True), lambda n: "dq_kernel" in n)
        methods["ours dQ, bf16 in place"] = (lambda: run_dq(ext, ops_dq16, shape, dq16=True),
                                             lambda n: "dq_kernel" in n)
        methods |= {
            f"Triton dK/dV ({kernels.value})": (triton_bwd, lambda n: "_bwd_dkdv" in n or "_bwd_fused" in n),
            "Triton dQ (lean only)": (triton_bwd, lambda n: "_bwd_dq" in n),
            "Triton backward (all kernels)": (triton_bwd, lambda n: True),
            "cuDNN BF16 backward": (cudnn_bwd, lambda n: True),
        }
        for fn, _ in methods.values():  # warm-up (Triton autotuning, cuDNN plans)
            fn()
        times = {name: [] for name in methods}
        for _ in range(rounds):
            for name, (fn, match) in methods.items():
                times[name].append(_kernel_ms(fn, match, iters))
        tag = "x".join(map(str, shape))
        fused_note = " (dQ included: the fused kernel)" if kernels.value == "fused" else ""
        lines.append(f"\n### {tag} bf16, not causal\n")
        lines.append("Ours against the shipped Triton kernel's gradients (same forward state):\n")
        lines += acc + [""]
        lines.append("| kernels | ms min | median | max | vs Triton dK/dV |")
        lines.append("|---|---:|---:|---:|---:|")
        base = statistics.median(times[f"Triton dK/dV ({kernels.value})"])
        for name, ts in times.items():
            med = statistics.median(ts)
            if med == 0:  # no kernel of the name ran (the Triton dQ kernel at hd64: inside the fused one)
                continue
            label = name + (fused_note if name.startswith("Triton dK/dV") else "")
            lines.append(f"| {label} | {min(ts):.3f} | {med:.3f} | {max(ts):.3f} | {base / med:.2f}x |")
        print("\n".join(lines[-(len(methods) + len(acc) + 6):]), flush=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="small shapes against the reference, then stop")
    ap.add_argument("--shapes", type=_cli.shape_list, default=[(1, 24, 16384, 128), (1, 48, 16384, 64)])
    ap.add_argument("--rounds", type=_cli.positive_int, default=3)
    ap.add_argument("--iters", type=_cli.positive_int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="markdown file of the timing tables")
    args = ap.parse_args(argv)
    ext = build()
    ok = check(ext)
    if args.check:
        return 0 if ok else 1
    lines = bench(ext, args.shapes, args.rounds, args.iters)  # timed even when the check failed: said below
    if args.out:
        gpu = torch.cuda.get_device_name()
        head = (f"# SageBwd dK/dV as an sm_90a wgmma kernel (experiment) on {gpu}\n\n"
                f"Run of commit {git_head()}, torch {torch.__version__}: `python bench/sagebwd_cuda_dkdv.py "
                f"--rounds {args.rounds} --iters {args.iters}`. Kernel device times (torch.profiler), "
                f"{args.rounds} rounds interleaving the methods, each the mean of {args.iters} calls. Check against "
                f"the torch reference at small shapes: {'passed' if ok else 'FAILED'}.\n")
        args.out.write_text(head + "\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
