#!/usr/bin/env python3
"""Error budget of SageBwd's gradients on the CPU: which quantized step costs dQ, dK and dV how much.

The emulation below generalises the torch reference (``sage_diffusers/reference/sagebwd.py``: the
same quantizers, 64-token blocks, online-softmax forward and operation order), so the variant
``shipped`` reproduces ``sagebwd_forward`` + ``sagebwd_backward`` bit for bit
(tests/test_sagebwd_error_budget.py). Every other variant changes the named steps only:

- ``q`` (Q for the scores, forward and backward recomputation): ``block64`` (INT8 per 64 queries,
  shipped), ``token`` (per query), ``smooth64`` (Q minus its 64-query block mean, INT8 per block; the
  mean's scores q_mean . k added back in float32), ``none``;
- ``k`` (smoothed K for the scores): ``block64`` (shipped), ``token``, ``none``;
- ``s_bwd``: the backward recomputes S from the forward's operands (``fwd``, shipped) or exactly in
  float32 (``exact``); ``stats``: the backward's row max and LSE are the forward's (``fwd``) or those of
  the backward's own scores (``recompute``, an extra pass over the keys in a kernel);
- ``pv`` (forward P~ V): ``int8`` (P~ codes rint(127 P~) x V INT8 per 64 keys, shipped), ``uint8``
  (rint(255 P~)), ``fp16`` (P~ and V in the 16-bit compute dtype: the reference's ``pv="fp16"``),
  ``none`` (float32);
- ``out``: O rounded to the input dtype before delta = rowsum(dO o O) (``dtype``, shipped), or kept in
  float32 (``fp32``); ``delta``: from O (``o``, shipped) or rowsum(P o dP) of the backward's own P and
  dP (``p``, consistent with dS by construction; a kernel needs it before dS, so an extra pass);
- ``p_dv`` (P~ of dV = P~^T dO'): ``int8`` (shipped), ``uint8``, ``none``; ``do_dv`` (dO' = dO / l):
  ``block64`` (shipped), ``none``;
- ``dp`` (dP = dO V^T): ``fp16`` (dO and V in the 16-bit compute dtype, shipped), ``none`` (float32);
- ``ds_dq`` (dS for dQ = dS K): ``tile`` (one scale per 64x64 tile, shipped), ``row`` (per query row
  of the tile: the output row of dQ's MMA), ``dtype`` (dS rounded to the 16-bit compute dtype, no
  scale: a 16-bit dQ product), ``none``; ``ds_dk`` (dS for dK = dS^T Q): ``tile``
  (shipped), ``col`` (per key column of the tile: dK's output row), ``dtype``, ``none``;
- ``k_dq`` (smoothed K as dQ's operand) and ``q_dk`` (Q as dK's operand): ``block64`` (shipped),
  ``token`` (the per-token scale, on the reduction axis, is folded into dS before it is quantized),
  ``none``; ``k_dq`` also ``dtype`` (the smoothed K rounded to the 16-bit compute dtype) and ``raw``
  (K as the 16-bit scores read it: not smoothed, masked rows 0; a dK/dV kernel that also sums dQ by
  a 16-bit product would find this K in shared memory already); ``q_dk`` also ``dtype`` (Q in the
  16-bit compute dtype, as the 16-bit scores read it).

Inputs: ``sage_diffusers.realistic.CASES`` at 1x2x2x512x512 (``--seq``), D 64 and 128, bf16 (not causal)
and fp16 (causal), dO ~ N(0, 1) in the input dtype. The reference is float64 autograd of exact
attention of the same inputs (masked keys' NaN zeroed; tests/test_sagebwd.py ``exact_grads``), so every
number is the emulation's error alone. Gradients are compared in float32; the ``cast`` rows give the
floor of storing float64's gradients in the input dtype and where they overflow it.

    python bench/sagebwd_error_budget.py --out eval/results/sagebwd_error_budget_cpu.json \
        --tables eval/results/sagebwd_error_budget_tables.md
    python bench/sagebwd_error_budget.py --quick     # D 64, bf16 and fp16, seq 256
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_utils import git_head  # noqa: E402

from sage_diffusers import realistic  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1  # noqa: E402
from sage_diffusers.reference import sagebwd as ref  # noqa: E402
from sage_diffusers.reference._common import expand_heads  # noqa: E402
from sage_diffusers.reference.formats import INT8_MAX  # noqa: E402
from sage_diffusers.reference.online_softmax import LOG2E, online_softmax_attention, visible_keys  # noqa: E402
from sage_diffusers.reference.quant import _div, _int8_from_scale, quantize_int8_per_block, quantize_int8_per_token  # noqa: E402

BQ, BKV = ref.BLOCK_Q, ref.BLOCK_KV
UINT8_MAX = 255.0
MODES = dict(
    q=("block64", "token", "smooth64", "none"), k=("block64", "token", "none"), s_bwd=("fwd", "exact"),
    stats=("fwd", "recompute"), pv=("int8", "uint8", "fp16", "none"), out=("dtype", "fp32"), delta=("o", "p"),
    p_dv=("int8", "uint8", "none"), do_dv=("block64", "channel", "none"), dp=("fp16", "none"),
    ds_dq=("tile", "row", "dtype", "none"), ds_dk=("tile", "col", "dtype", "none"),
    k_dq=("block64", "token", "dtype", "raw", "none"), q_dk=("block64", "token", "dtype", "none"),
)
P_UNIT = {"int8": INT8_MAX, "uint8": UINT8_MAX}


@dataclass(frozen=True)
class Variant:
    """One setting of every step; the defaults are the shipped reference's."""

    name: str
    q: str = "block64"
    k: str = "block64"
    s_bwd: str = "fwd"
    stats: str = "fwd"
    pv: str = "int8"
    out: str = "dtype"
    delta: str = "o"
    p_dv: str = "int8"
    do_dv: str = "block64"
    dp: str = "fp16"
    ds_dq: str = "tile"
    ds_dk: str = "tile"
    k_dq: str = "block64"
    q_dk: str = "block64"
    what: str = ""

    def __post_init__(self):
        for field, allowed in MODES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}: expected one of {allowed}, got {getattr(self, field)!r}")


EXACT = dict(q="none", k="none", pv="none", out="fp32", p_dv="none", do_dv="none", dp="none",
             ds_dq="none", ds_dk="none", k_dq="none", q_dk="none")


class Grads(NamedTuple):
    """float32 out (B, Hq, Sq, D), dq (B, Hq, Sq, D), dk and dv (B, Hkv, Skv, D)."""

    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


class Operand(NamedTuple):
    """An operand of the INT8 products: codes (float32 values of the int8 codes, or the exact values),
    ``tok`` (B, H, S) a per-token scale, or ``blk`` (B, H, nb) a per-64-token-block scale, or neither."""

    codes: torch.Tensor
    tok: Optional[torch.Tensor] = None
    blk: Optional[torch.Tensor] = None

    def per_token(self) -> torch.Tensor:
        """(B, H, S) scale of each token (ones for an exact operand)."""
        if self.tok is not None:
            return self.tok
        s = self.codes.shape[2]
        if self.blk is not None:
            return ref._per_token(self.blk, BQ, s)
        return torch.ones(self.codes.shape[:3])


def quantize_operand(x: torch.Tensor, mode: str) -> Operand:
    """x float32 (B, H, S, D) -> :class:`Operand` in ``mode`` (block64 / token / none)."""
    if mode == "none":
        return Operand(x.float())
    if mode == "token":
        codes, scale = quantize_int8_per_token(x)
        return Operand(codes.float(), tok=scale)
    codes, scale = quantize_int8_per_block(x, BQ)
    return Operand(codes.float(), blk=scale)


def block_mean(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H, S, D): each token replaced by the mean of its ``block``-token block."""
    s = x.shape[2]
    xb = ref._block_rows(x, block)  # (B, H, nb, block, D), zero-padded
    count = torch.clamp(s - torch.arange(xb.shape[2]) * block, max=block).float()  # tokens per block
    mean = xb.sum(3, keepdim=True) / count[:, None, None]
    return mean.expand_as(xb).flatten(2, 3)[:, :, :s]


def quantize_ds(ds: torch.Tensor, mode: str, cdt: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """dS float32 (B, H, Sq, Skv) -> (codes as tiles (B, H, nq, BQ, nk, BKV), scale (B, H, nq, BQ, nk, BKV)
    broadcastable: (.., 1, .., 1) per tile, (.., BQ, .., 1) per row, (.., 1, .., BKV) per column)."""
    if mode == "tile":  # the reference's function: the same bits
        codes, scale = ref.quantize_ds_tiles(ds)
        return codes, scale[:, :, :, None, :, None]
    tiles = ref.tile_view(ds)
    if mode == "none":
        return tiles, torch.ones(())
    if mode == "dtype":
        return tiles.to(cdt).float(), torch.ones(())
    axis = 5 if mode == "row" else 3
    scale = _div(tiles.abs().amax(axis, keepdim=True), INT8_MAX)
    return _int8_from_scale(tiles, scale).float(), scale


def forward(x: realistic.Inputs, var: Variant, is_causal: bool):
    """The emulated forward: (out float32, m2, lse2 (B, Hq, Sq, 1) of its scores, score function of
    the quantized operands over all keys, the operands' pieces the backward reuses)."""
    q, k, v, key_mask = x
    b, hq, sq_len, d = q.shape
    skv = k.shape[2]
    qk_scale = 1.0 / math.sqrt(d) * LOG2E
    ks, vz, _ = ref.masked_kv(k, v, key_mask)  # float32, smoothed K and masked V
    qf = q.float()
    q_mean = block_mean(qf, BQ) if var.q == "smooth64" else None
    qo = quantize_operand(qf - q_mean if q_mean is not None else qf, "block64" if var.q == "smooth64" else var.q)
    ko = quantize_operand(ks, var.k)
    sq_tok, k8 = qo.per_token(), expand_heads(ko.codes, hq)
    sk_tok = expand_heads(ko.per_token(), hq)
    ksx = expand_heads(ks, hq)  # (B, Hq, Skv, D)

    def score(j0: int, j1: int) -> torch.Tensor:
        s = ref.scores_log2(qo.codes, sq_tok, k8[:, :, j0:j1], sk_tok[:, :, j0:j1], qk_scale)
        if q_mean is not None:  # the block means' scores, float32 (one GEMV per query block in a kernel)
            s = s + (q_mean @ ksx[:, :, j0:j1].transpose(-1, -2)) * qk_scale
        return s

    vo = quantize_operand(vz, "block64")
    v8, sv = expand_heads(vo.codes, hq), expand_heads(vo.blk, hq)
    vx = expand_heads(vz, hq)

    def pv_q(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        unit = P_UNIT[var.pv]
        dots = torch.round(p * unit) @ v8[:, :, j0:j1]
        return dots * (sv[:, :, j0 // BKV, None, None] * (ref.P_SCALE if var.pv == "int8" else 1.0 / unit))

    def pv_exact(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        return p @ vx[:, :, j0:j1]

    cdt = ref.compute_dtype(v.dtype)
    vc = vx.to(cdt).float()

    def pv_16(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        return p.to(cdt).float() @ vc[:, :, j0:j1]

    pv_fn = {"none": pv_exact, "fp16": pv_16}.get(var.pv, pv_q)
    acc, l, m = online_softmax_attention(score, pv_fn, shape=(b, hq, sq_len, d),
                                         skv=skv, key_mask=key_mask, is_causal=is_causal, device=q.device,
                                         block_kv=BKV)
    empty = l == 0
    one = torch.ones(())
    out = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, one, l))
    lse2 = torch.where(empty, torch.full_like(l, -math.inf), m + torch.log2(torch.where(empty, one, l)))
    m2 = torch.where(empty, torch.full_like(m, -math.inf), m)
    kz = ref.masked_v(k, key_mask).float()  # K as the 16-bit scores read it: not smoothed, masked rows 0
    return out, m2, lse2, score, dict(ks=ks, kz=kz, vz=vz, qf=qf, qk_scale=qk_scale)


def row_stats(s2: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and LSE (log2 domain, (B, H, Sq, 1)) of the visible scores of s2; -inf on empty rows."""
    s = s2.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l = torch.exp2(s - m_safe).sum(-1, keepdim=True)
    lse = torch.where(l > 0, m_safe + torch.log2(torch.where(l > 0, l, torch.ones(()))), torch.full_like(l, -math.inf))
    return m, lse


def emulate(x: realistic.Inputs, do: torch.Tensor, var: Variant, is_causal: bool = False,
            probe: Optional[dict] = None) -> Grads:
    """SageBwd forward and backward of BHSD inputs ``x`` with ``var``'s steps: float32 :class:`Grads`.
    ``probe``, when given, receives ``ds_absmax``: the largest |dS| (the Triton kernels hold dS times
    2**32, ``DS_PRESCALE``, in float32: finite while this stays under 2**96)."""
    q, k, v, key_mask = x
    b, hq, sq_len, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(d)
    out, m2, lse2, score, pre = forward(x, var, is_causal)
    out_d = out.to(q.dtype).float() if var.out == "dtype" else out  # what delta reads

    # Recompute the scores and P (the reference's order of operations).
    if var.s_bwd == "fwd":
        s2 = score(0, skv)  # (B, Hq, Sq, Skv)
    else:
        s2 = ref.scores_log2(pre["qf"], torch.ones(b, hq, sq_len), expand_heads(pre["ks"], hq),
                             torch.ones(b, hq, skv), pre["qk_scale"])
    vis = visible_keys(0, skv, sq_len, key_mask, is_causal, q.device)
    if var.stats == "recompute":
        keep_all = torch.ones_like(s2, dtype=torch.bool) if vis is None else vis.expand_as(s2)
        m2, lse2 = row_stats(s2, keep_all)
    live = torch.isfinite(lse2)
    zero = torch.zeros(())
    lse_safe, m_safe = torch.where(live, lse2, zero), torch.where(live, m2, zero)
    keep = live if vis is None else live & vis
    p_tilde = torch.where(keep, torch.exp2(s2 - m_safe), zero)  # (B, Hq, Sq, Skv)
    inv_l = torch.exp2(m_safe - lse_safe)  # (B, Hq, Sq, 1)
    p = p_tilde * inv_l

    # dV = P~^T dO'
    dos = do.float() * inv_l
    sdo_channel = torch.ones(1, 1, 1, 1)  # (B, Hq, 1, D) in channel mode: scales dV's output columns
    if var.do_dv == "block64":
        dos8, sdos = quantize_int8_per_block(dos, BQ)
        dos8 = dos8.float()
    else:
        dos8, sdos = dos, torch.ones(b, hq, -(-sq_len // BQ))
        if var.do_dv == "channel":
            sdo_channel = _div(dos.abs().amax(2, keepdim=True), INT8_MAX)
            dos8 = _int8_from_scale(dos, sdo_channel).float()
    if var.p_dv == "none":
        p8, p_scale = ref.tile_view(p_tilde), 1.0
    else:
        p8, p_scale = ref.tile_view(torch.round(p_tilde * P_UNIT[var.p_dv])), 1.0 / P_UNIT[var.p_dv]
        if var.p_dv == "int8":
            p_scale = ref.P_SCALE
    dv_tiles = torch.einsum("bhiqjk,bhiqd->bhijkd", p8, ref._block_rows(dos8, BQ))
    dv = (dv_tiles * (sdos * p_scale)[:, :, :, None, None, None]).sum(2) * sdo_channel[:, :, None]
    dv = ref._group_sum(dv.flatten(2, 3)[:, :, :skv], hkv)

    # dP, delta, dS
    vz = expand_heads(pre["vz"], hq)
    if var.dp == "fp16":
        cdt = ref.compute_dtype(v.dtype)
        dp = do.to(cdt).float() @ vz.to(cdt).float().transpose(-1, -2)
    else:
        dp = do.float() @ vz.transpose(-1, -2)
    if var.delta == "o":
        delta = (do.float() * out_d).sum(-1, keepdim=True)
    else:
        delta = (p * dp).sum(-1, keepdim=True)
    ds = p * (dp - delta)  # (B, Hq, Sq, Skv)
    if probe is not None:
        probe["ds_absmax"] = float(ds.abs().max())

    # dQ = dS K: K's per-token scale (token mode) folded into dS's columns, a block scale per tile.
    cdt = ref.compute_dtype(q.dtype)
    if var.k_dq in ("dtype", "raw"):
        ko = Operand(pre["ks" if var.k_dq == "dtype" else "kz"].to(cdt).float())
    else:
        ko = quantize_operand(pre["ks"], var.k_dq)
    ds_q = ds * expand_heads(ko.tok, hq)[:, :, None, :] if ko.tok is not None else ds
    codes, sds = quantize_ds(ds_q, var.ds_dq, cdt)
    k_blocks = ref._block_rows(expand_heads(ko.codes, hq), BKV)  # (B, Hq, nk, BKV, D)
    dq_tiles = torch.einsum("bhiqjk,bhjkd->bhijqd", codes, k_blocks)  # (B, H, nq, nk, BQ, D)
    ksc = expand_heads(ko.blk, hq)[:, :, None, None, :, None] if ko.blk is not None else torch.ones(())
    # (B, H, nq, 1 or BQ, nk, 1): never per column (K's per-key scale is folded into dS)
    dq_scale = (sds * ksc * sm_scale).expand(*codes.shape[:5], 1).permute(0, 1, 2, 4, 3, 5)  # (.., nk, BQ, 1)
    dq = (dq_tiles * dq_scale).sum(3).flatten(2, 3)[:, :, :sq_len]

    # dK = dS^T Q: Q's per-token scale folded into dS's rows, a block scale per tile.
    qo = Operand(pre["qf"].to(cdt).float()) if var.q_dk == "dtype" else quantize_operand(pre["qf"], var.q_dk)
    ds_k = ds * qo.tok[..., None] if qo.tok is not None else ds
    codes, sds = quantize_ds(ds_k, var.ds_dk, cdt)
    q_blocks = ref._block_rows(qo.codes, BQ)  # (B, Hq, nq, BQ, D)
    dk_tiles = torch.einsum("bhiqjk,bhiqd->bhijkd", codes, q_blocks)  # (B, H, nq, nk, BKV, D)
    qsc = qo.blk[:, :, :, None, None, None] if qo.blk is not None else torch.ones(())
    # (B, H, nq, 1, nk, 1 or BKV): never per row (Q's per-query scale is folded into dS)
    dk_scale = (sds * qsc * sm_scale).expand(*codes.shape[:3], 1, *codes.shape[4:]).permute(0, 1, 2, 4, 5, 3)
    dk = (dk_tiles * dk_scale).sum(2).flatten(2, 3)[:, :, :skv]
    dk = ref._group_sum(dk, hkv)
    return Grads(out, dq, dk, dv)


def exact_grads(x: realistic.Inputs, do: torch.Tensor, is_causal: bool, dtype=torch.float64) -> Grads:
    """SDPA (math) output and gradients of ``x`` in ``dtype`` (float64: the reference; float32: what a GPU
    measurement compares against) with masked keys' values zeroed (their NaN too); rows with no
    visible key give 0 (tests/test_sagebwd.py ``exact_grads``)."""
    q, k, v, key_mask = x
    if key_mask is not None:
        hidden = ~key_mask[:, None, :, None]
        k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    sq, skv = q.shape[2], k.shape[2]
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if is_causal:
        tri = torch.ones(sq, skv, dtype=torch.bool).tril()
        mask = tri if mask is None else mask & tri
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if mask is not None:
        out = torch.where(mask.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype))
    out.backward(do.to(dtype))
    return Grads(out.detach(), qd.grad, kd.grad, vd.grad)


def reference_grads(x: realistic.Inputs, do: torch.Tensor, is_causal: bool) -> Grads:
    """The torch reference's float32 output and gradients (what ``shipped`` must reproduce)."""
    st = ref.sagebwd_forward(x.q, x.k, x.v, key_mask=x.key_mask, is_causal=is_causal)
    dq, dk, dv = ref.sagebwd_backward(do, st, key_mask=x.key_mask, is_causal=is_causal)
    return Grads(st.out.float(), dq, dk, dv)


def _v(name: str, what: str, **kw) -> Variant:
    return Variant(name, what=what, **kw)


# Group "one": from exact attention (float32), one step quantized; "drop": the shipped pipeline with
# one step exact; "fix": candidate changes on the shipped pipeline. Names are unique.
VARIANTS: tuple[tuple[str, Variant], ...] = (
    ("one", _v("exact", "float32 emulation, nothing quantized (the floor)", **EXACT)),
    ("one", _v("16-bit floor", "O stored in the input dtype + dP in 16 bits: a FlashAttention backward's steps",
               **{**EXACT, "out": "dtype", "dp": "fp16"})),
    ("one", _v("QK scores", "Q per 64 queries + K per 64 keys in the scores (fwd and bwd)",
               **{**EXACT, "q": "block64", "k": "block64"})),
    ("one", _v("PV int8", "forward P~ V in INT8", **{**EXACT, "pv": "int8"})),
    ("one", _v("O in dtype", "O rounded to the input dtype before delta", **{**EXACT, "out": "dtype"})),
    ("one", _v("P~ int8 (dV)", "P~ codes of dV", **{**EXACT, "p_dv": "int8"})),
    ("one", _v("dO' int8 (dV)", "dO' per 64 queries in dV", **{**EXACT, "do_dv": "block64"})),
    ("one", _v("dO' channel (dV)", "dO' per channel over all queries in dV", **{**EXACT, "do_dv": "channel"})),
    ("one", _v("dP fp16", "dO V^T in the 16-bit dtype", **{**EXACT, "dp": "fp16"})),
    ("one", _v("dS tile (dQ)", "dS per 64x64 tile for dQ", **{**EXACT, "ds_dq": "tile"})),
    ("one", _v("dS tile (dK)", "dS per 64x64 tile for dK", **{**EXACT, "ds_dk": "tile"})),
    ("one", _v("K int8 (dQ)", "smoothed K per 64 keys as dQ's operand", **{**EXACT, "k_dq": "block64"})),
    ("one", _v("Q int8 (dK)", "Q per 64 queries as dK's operand", **{**EXACT, "q_dk": "block64"})),
    ("drop", _v("shipped", "the reference: every step as shipped")),
    ("drop", _v("- QK scores", "shipped, scores exact in fwd and bwd", q="none", k="none")),
    ("drop", _v("- QK bwd only, fwd stats", "scores exact in the backward, m / LSE from the INT8 forward",
                s_bwd="exact")),
    ("drop", _v("- QK bwd only, recomputed stats", "scores exact in the backward with their own m / LSE",
                s_bwd="exact", stats="recompute")),
    ("drop", _v("- PV int8", "shipped, forward P~ V exact", pv="none")),
    ("drop", _v("- O in dtype", "shipped, delta from the float32 O", out="fp32")),
    ("drop", _v("- delta from O", "shipped, delta = rowsum(P o dP)", delta="p")),
    ("drop", _v("- P~ int8 (dV)", "shipped, P~ of dV exact", p_dv="none")),
    ("drop", _v("- dO' int8 (dV)", "shipped, dO' of dV exact", do_dv="none")),
    ("drop", _v("- dP fp16", "shipped, dP in float32", dp="none")),
    ("drop", _v("- dS (dQ, dK)", "shipped, dS exact in dQ and dK", ds_dq="none", ds_dk="none")),
    ("drop", _v("- K, Q operands", "shipped, K of dQ and Q of dK exact", k_dq="none", q_dk="none")),
    ("fix", _v("Q token", "Q per query in the scores", q="token")),
    ("fix", _v("Q smooth64", "Q minus its block mean, per block, mean scores in float32", q="smooth64")),
    ("fix", _v("QK token", "Q per query, K per key in the scores", q="token", k="token")),
    ("fix", _v("dS row/col", "dS per row for dQ, per column for dK", ds_dq="row", ds_dk="col")),
    ("fix", _v("dS row/col, ops token", "dS per row / column, K and Q operands per token", ds_dq="row",
               ds_dk="col", k_dq="token", q_dk="token")),
    ("fix", _v("dO' channel", "dO' per channel over all queries: dV sums in int32 in place",
               do_dv="channel")),
    ("fix", _v("P~ uint8", "P~ codes rint(255 P~) in forward and dV", pv="uint8", p_dv="uint8")),
    ("fix", _v("O fp32 + dS row/col", "delta from float32 O, dS per row / column", out="fp32", ds_dq="row",
               ds_dk="col")),
    ("fix", _v("QK token + dS row/col", "Q/K per token in the scores, dS per row / column", q="token",
               k="token", ds_dq="row", ds_dk="col")),
    ("fix", _v("QK 16-bit", "scores exact (16-bit Q K^T in fwd and bwd), rest shipped", q="none", k="none")),
    ("fix", _v("QK 16-bit + dS row/col", "scores exact, dS per row / column", q="none", k="none",
               ds_dq="row", ds_dk="col")),
    ("fix", _v("delta from P", "delta = rowsum(P o dP) (an extra pass over the keys)", delta="p")),
    ("fix", _v("PV fp16", "forward P~ V in 16 bits (the reference's pv='fp16')", pv="fp16")),
    ("fix", _v("PV fp16 + O fp32", "forward P~ V in 16 bits, delta from the float32 O", pv="fp16", out="fp32")),
    ("fix", _v("QK token + PV fp16", "Q/K per token in the scores, P~ V in 16 bits", q="token", k="token",
               pv="fp16")),
    ("fix", _v("QK 16-bit + PV fp16", "scores and P~ V in 16 bits (a 16-bit forward), INT8 backward",
               q="none", k="none", pv="fp16")),
    ("fix", _v("QK 16-bit + PV fp16 + dS row/col", "the same, dS per row / column", q="none", k="none",
               pv="fp16", ds_dq="row", ds_dk="col")),
    ("fix", _v("QK 16-bit + PV fp16 + dQ 16-bit", "the 16-bit forward; dQ = dS K as a 16-bit product of the "
               "smoothed K", q="none", k="none", pv="fp16", ds_dq="dtype", k_dq="dtype")),
    ("fix", _v("QK 16-bit + PV fp16 + dQ 16-bit, K raw", "the same with K as the scores read it (not smoothed)",
               q="none", k="none", pv="fp16", ds_dq="dtype", k_dq="raw")),
    ("fix", _v("QK 16-bit + PV fp16 + dQ, dK 16-bit", "the 16-bit forward; dQ = dS K (smoothed K) and "
               "dK = dS^T Q as 16-bit products: only dV in INT8", q="none", k="none", pv="fp16", ds_dq="dtype",
               k_dq="dtype", ds_dk="dtype", q_dk="dtype")),
    ("fix", _v("QK 16-bit + delta from P", "scores in 16 bits, INT8 P~ V, delta = rowsum(P o dP)",
               q="none", k="none", delta="p")),
    ("fix", _v("QK 16-bit + dS row/col + O fp32", "scores exact, dS per row / column, delta from float32 O",
               q="none", k="none", ds_dq="row", ds_dk="col", out="fp32")),
)


class Config(NamedTuple):
    """A shape and dtype the cases run at: (B, Hq, Hkv, S, D, causal, dtype)."""

    b: int
    hq: int
    hkv: int
    s: int
    d: int
    causal: bool
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return (f"{self.b}x{self.hq}/{self.hkv}x{self.s}x{self.d} {str(self.dtype).split('.')[-1]}"
                + (" causal" if self.causal else ""))


def case_data(cfg: Config, case: realistic.Case, seed: int):
    """(inputs, dO) of one case: realistic.case_inputs and dO ~ N(0, 1) in the input dtype."""
    x = realistic.case_inputs(case, cfg.b, cfg.hq, cfg.hkv, cfg.s, cfg.s, cfg.d, seed=seed, dtype=cfg.dtype)
    do = torch.randn(x.q.shape, generator=torch.Generator().manual_seed(seed + 1000)).to(cfg.dtype)
    return x, do


NAMES = ("O", "dQ", "dK", "dV")


def metrics(got, want, dtype: Optional[torch.dtype] = None) -> dict:
    """{name: {cos, rel_l1}} over the four tensors (non-finite entries make both NaN); with ``dtype``
    also ``nonfinite``: the entries that overflow when ``got`` is stored in it (as the kernels return)."""
    res = {n: dict(cos=cosine(g, w), rel_l1=relative_l1(g, w)) for n, g, w in zip(NAMES, got, want)}
    if dtype is not None:
        for n, g in zip(NAMES, got):
            res[n]["nonfinite"] = int((~torch.isfinite(g.to(dtype))).sum())
    return res


def cast_floor(want: Grads, dtype: torch.dtype) -> dict:
    """float64 results stored in the input dtype: cos / rel-L1 and how many entries leave its range."""
    res = {}
    for n, w in zip(NAMES, want):
        c = w.to(dtype)
        fin = torch.isfinite(c)
        res[n] = dict(cos=cosine(torch.where(fin, c, 0).double(), w), rel_l1=relative_l1(torch.where(fin, c, 0).double(), w),
                      nonfinite=int((~fin).sum()), max_abs=float(w.abs().max()))
    return res


def run(configs, cases, seeds, variants=VARIANTS, log=print, on_progress=None) -> list[dict]:
    """Every variant on every (config, case, seed): one row each, plus a ``cast`` row per case."""
    rows = []
    for cfg in configs:
        for case in cases:
            for seed in seeds:
                x, do = case_data(cfg, case, seed)
                want = exact_grads(x, do, cfg.causal)
                base = dict(config=cfg.label, case=case.name, seed=seed)
                rows.append(dict(base, group="cast", name=f"float64 in {str(cfg.dtype).split('.')[-1]}",
                                 **cast_floor(want, cfg.dtype)))
                rows.append(dict(base, group="cast", name="float32 SDPA",
                                 **metrics(exact_grads(x, do, cfg.causal, torch.float32), want, cfg.dtype)))
                for group, var in variants:
                    t0 = time.time()
                    probe = {}
                    got = emulate(x, do, var, cfg.causal, probe)
                    row = dict(base, group=group, name=var.name, **metrics(got, want, cfg.dtype),
                               ds_absmax=probe["ds_absmax"], variant=asdict(var), seconds=round(time.time() - t0, 2))
                    rows.append(row)
                    log(f"{cfg.label} {case.name:32s} {var.name:34s} " + " ".join(
                        f"{n} {row[n]['cos']:.5f}" for n in NAMES) + f" ({row['seconds']} s)")
                if on_progress is not None:
                    on_progress(rows)
    return rows


def tables(rows: list[dict], metric: str = "cos") -> str:
    """Markdown: per config and case, each variant's O / dQ / dK / dV ``metric`` (mean over seeds)."""
    out = []
    for cfg in dict.fromkeys(r["config"] for r in rows):
        for case in dict.fromkeys(r["case"] for r in rows if r["config"] == cfg):
            sub = [r for r in rows if r["config"] == cfg and r["case"] == case]
            seeds = sorted({r["seed"] for r in sub})
            out.append(f"#### {cfg}, {case} (seeds {seeds}): cos / rel-L1 against float64\n")
            out.append("| group | variant | O | dQ | dK | dV |")
            out.append("|---|---|---:|---:|---:|---:|")
            for group, name in dict.fromkeys((r["group"], r["name"]) for r in sub):
                rs = [r for r in sub if r["group"] == group and r["name"] == name]
                cells = []
                for n in NAMES:
                    c = sum(r[n]["cos"] for r in rs) / len(rs)
                    l1 = sum(r[n]["rel_l1"] for r in rs) / len(rs)
                    extra = f" ({sum(r[n].get('nonfinite', 0) for r in rs)} inf)" if any(
                        r[n].get("nonfinite") for r in rs) else ""
                    cells.append(f"{c:.5f} / {l1:.4f}{extra}")
                out.append(f"| {group} | {name} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _rounded(x):
    """x with every float at 6 significant digits (the tables print 5)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON file of every row (rewritten as the run goes)")
    ap.add_argument("--tables", type=Path, default=None, help="markdown file of the per-case tables")
    ap.add_argument("--quick", action="store_true", help="seq 256, D 64, one seed")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--cases", nargs="+", default=None, help="case names (default all of realistic.CASES)")
    ap.add_argument("--only", nargs="+", default=None, help="variant names to run (default all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seq, dims, seeds = (256, [64], [0]) if args.quick else (args.seq, args.dims, args.seeds)
    # bf16 self-attention without a mask shape as the H100's first shape, fp16 causal as its second
    configs = [Config(1, 2, 2, seq, d, causal, dt) for d in dims
               for causal, dt in ((False, torch.bfloat16), (True, torch.float16))]
    cases = [c for c in realistic.CASES if args.cases is None or c.name in args.cases]
    variants = VARIANTS if args.only is None else tuple(gv for gv in VARIANTS if gv[1].name in args.only)
    t0 = time.time()
    meta = dict(commit=git_head(), torch=torch.__version__, threads=args.threads,
                configs=[c.label for c in configs], seeds=seeds,
                reference="float64 autograd of exact attention of the same inputs (masked keys zeroed)",
                variants={v.name: dict(group=g, what=v.what) for g, v in variants})

    def save(rows, done=False):
        if args.out:  # one row per line, 6 significant digits: the full run has ~2,000 rows
            head = json.dumps(dict(meta=dict(meta, seconds=round(time.time() - t0), complete=done)))[:-1]
            body = ",\n".join(json.dumps(_rounded(r)) for r in rows)
            args.out.write_text(f'{head}, "rows": [\n{body}\n]}}\n')

    rows = run(configs, cases, seeds, variants, on_progress=save)
    save(rows, done=True)
    if args.tables:
        args.tables.write_text(tables(rows) + "\n")


if __name__ == "__main__":
    main()
