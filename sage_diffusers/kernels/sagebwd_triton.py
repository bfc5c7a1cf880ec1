"""SageBwd in Triton: the quantization pre-pass, the forward and the backward (dK/dV, dQ).

The numerics are those of ``sage_diffusers.reference.sagebwd`` (the spec): same blocks, same
quantized operands bit for bit (IEEE division, round half to even), the scale factors multiplied
in the same order. The kernels run on CUDA GPUs (tensor-core INT8 ``tl.dot``) and, for testing,
on the CPU under ``TRITON_INTERPRET=1`` (tests/test_sagebwd_triton.py).

Passes (one ``@triton.jit`` source each, precision choices as ``tl.constexpr``):

- ``_quant_kernel``: per-block INT8 of Q, smoothed K, V, dO and dO' = dO / l (masked rows 0).
- ``_fwd_kernel``: INT8 QK^T, online softmax, P~.V as INT8 (``PV_INT8``) or 16-bit; O, m, LSE.
- ``_bwd_dkdv_kernel`` (one program per key block, all query heads of its group) and
  ``_bwd_dq_kernel`` (one per query block): both recompute the same dS tiles with ``_ds_tile``,
  dP = dO.V^T 16-bit or INT8 (``DOV_INT8``); or, with ``SAGE_DIFFUSERS_SAGEBWD_DQ=atomic``, the
  dK/dV kernel alone adds each tile's dQ share with FP32 atomics (``FUSED_DQ``).

On GPUs without this project's CUDA kernels (sm_80/86/89) the forward is also the inference path
of ``mode="int8"``: :func:`attention_int8_triton` follows the kernels' backend contract.
"""
from __future__ import annotations

import enum
import math
import os
from typing import Optional

import torch

from ..reference import sagebwd as ref
from ..reference.online_softmax import LOG2E
from ..reference.sagebwd import BLOCK_KV, BLOCK_Q, DoVPrecision, PVPrecision, SageBwdState

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR = None
except ImportError as exc:  # triton is optional on CPU-only installs
    triton = tl = None
    _IMPORT_ERROR = exc

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Launch parameters are autotuned on GPUs unless SAGE_DIFFUSERS_TRITON_AUTOTUNE=0 (then the
# first config of each list runs: quick start for tests); the interpreter ignores them.
AUTOTUNE = not INTERPRET and os.environ.get("SAGE_DIFFUSERS_TRITON_AUTOTUNE", "1") != "0"


def is_available() -> tuple[bool, str]:
    """(ok, reason): Triton importable and either a CUDA device or the interpreter."""
    if triton is None:
        return False, f"triton not importable ({_IMPORT_ERROR})"
    if not (torch.cuda.is_available() or INTERPRET):
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    return True, ""


class DQPass(str, enum.Enum):
    """How the backward produces dQ (``SAGE_DIFFUSERS_SAGEBWD_DQ``; same numerics, other sum order)."""

    SEPARATE = "separate"  # its own kernel, one program per query block, recomputing the dS tiles
    ATOMIC = "atomic"  # in the dK/dV kernel, FP32 atomic adds of each tile's dS.K (no recomputation)


def dq_pass() -> DQPass:
    return DQPass(os.environ.get("SAGE_DIFFUSERS_SAGEBWD_DQ", DQPass.SEPARATE.value))


def _autotuned(configs, key: list, reset_to_zero: Optional[list] = None):
    """triton.autotune on a GPU (launch parameters only, never the numerics); the interpreter runs
    the kernels as called. ``reset_to_zero``: outputs accumulated with atomics, zeroed between trials."""
    def wrap(kernel):
        if INTERPRET:
            return kernel
        return triton.autotune(configs=configs if AUTOTUNE else configs[:1], key=key,
                               reset_to_zero=reset_to_zero)(kernel)
    return wrap


def build() -> None:
    """Nothing to build ahead of time: Triton compiles each kernel variant on its first launch."""


if triton is not None:
    # Tile rows of the forward (a multiple of BLOCK_Q: each row reads its own block's Q scale),
    # warps and pipeline depth; the backward tiles are fixed by the dS quantization tile.
    _FWD_CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=st)
                    for m in (128, 64) for w in (8, 4) for st in (2, 3)]
    _BWD_CONFIGS = [triton.Config({}, num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3)]

    @triton.jit
    def _rint(x):
        """Round half to even (torch.round) for |x| < 2**22: adding 1.5 * 2**23 drops the fraction."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _dot16(a, b, AS_F32: tl.constexpr):
        """16-bit a (M, K) @ b (K, N) with FP32 accumulation; AS_F32 multiplies FP32 copies (exact
        products, the same sums): the CPU interpreter's bfloat16 dot is wrong."""
        if AS_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), out_dtype=tl.float32)
        return tl.dot(a, b, out_dtype=tl.float32)

    @triton.jit
    def _quant_kernel(
        x_ptr, sxb, sxh, sxs, sxd,  # input (B, H, S, D), any float dtype, any strides
        mean_ptr,  # float32 (B, H, D), subtracted when HAS_MEAN
        mask_ptr,  # int8 (B, S), 0 = masked row (becomes 0), when HAS_MASK
        rs_ptr,  # float32 (B, H, S), per-row factor when HAS_ROWSCALE
        q_ptr,  # int8 (B, H, S, D) contiguous
        scale_ptr,  # float32 (B, H, ceil(S / BLOCK))
        H, S,
        D: tl.constexpr, BLOCK: tl.constexpr,
        HAS_MEAN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    ):
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        inb = rows < S
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd,
                    mask=inb[:, None], other=0.0).to(tl.float32)
        keep = inb
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * S + rows, mask=inb, other=0) != 0)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + bh * D + cols)[None, :]
        if HAS_ROWSCALE:
            x = x * tl.load(rs_ptr + bh * S + rows, mask=inb, other=0.0)[:, None]
        x = tl.where(keep[:, None], x, 0.0)  # masked rows: 0 (NaN/Inf there vanish)
        scale = tl.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        qv = tl.minimum(tl.maximum(_rint(tl.div_rn(x, safe)), -127.0), 127.0)
        qv = tl.where(scale > 0, qv, 0.0)
        tl.store(q_ptr + (bh * S + rows[:, None]) * D + cols[None, :], qv.to(tl.int8), mask=inb[:, None])
        tl.store(scale_ptr + bh * tl.cdiv(S, BLOCK) + blk, scale)

    @triton.jit
    def _visible(rows, cols, mask_ptr, b, SKV, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr):
        """bool (M, N): key cols visible to query rows (in range, key mask, top-left causal)."""
        vis = (cols < SKV)[None, :] & (rows >= 0)[:, None]
        if HAS_MASK:
            km = tl.load(mask_ptr + b * SKV + cols, mask=cols < SKV, other=0) != 0
            vis = vis & km[None, :]
        if IS_CAUSAL:
            vis = vis & (cols[None, :] <= rows[:, None])
        return vis

    @_autotuned(_FWD_CONFIGS, key=["D", "IS_CAUSAL", "HAS_MASK", "PV_INT8"])
    @triton.jit
    def _fwd_kernel(
        q8_ptr, sq_ptr,  # int8 (B, Hq, Sq, D), float32 (B, Hq, ceil(Sq/BLOCK_Q))
        k8_ptr, sk_ptr,  # int8 (B, Hkv, Skv, D) smoothed, float32 (B, Hkv, ceil(Skv/BLOCK_N))
        v8t_ptr, sv_ptr,  # int8 (B, Hkv, D, Skv): V^ transposed (8-bit MMAs want K-major operands)
        vc_ptr,  # 16-bit (B, Hkv, Skv, D), masked V (read when not PV_INT8)
        mask_ptr,  # int8 (B, Skv)
        o_ptr, m_ptr, lse_ptr,  # (B, Hq, Sq, D) out dtype; float32 (B, Hq, Sq) x2
        qk_scale, HQ, GROUP, SQ, SKV,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, PV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        bkv = b * (HQ // GROUP) + h // GROUP
        nqb = tl.cdiv(SQ, BLOCK_Q)
        nkb = tl.cdiv(SKV, BLOCK_N)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        inq = rows < SQ
        q8 = tl.load(q8_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], mask=inq[:, None], other=0)
        sq_row = tl.load(sq_ptr + bh * nqb + rows // BLOCK_Q, mask=inq, other=0.0)
        row_scale = sq_row * qk_scale  # (M,)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        n_end = SKV
        if IS_CAUSAL:
            n_end = tl.minimum(SKV, (pid_m + 1) * BLOCK_M)
        for start_n in range(0, n_end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            ink = cols < SKV
            kv_off = (bkv * SKV + cols[:, None]) * D + dims[None, :]
            k8 = tl.load(k8_ptr + kv_off, mask=ink[:, None], other=0)
            sk = tl.load(sk_ptr + bkv * nkb + start_n // BLOCK_N)
            s = tl.dot(q8, tl.trans(k8), out_dtype=tl.int32).to(tl.float32) * row_scale[:, None] * sk
            if HAS_MASK or IS_CAUSAL or start_n + BLOCK_N > SKV:  # full unmasked tiles skip the test
                s = tl.where(_visible(rows, cols, mask_ptr, b, SKV, HAS_MASK, IS_CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2 gives 0, not NaN
            p = tl.exp2(s - m_safe[:, None])  # (M, N) in [0, 1]
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_INT8:
                v8t = tl.load(v8t_ptr + (bkv * D + dims[:, None]) * SKV + cols[None, :], mask=ink[None, :], other=0)
                sv = tl.load(sv_ptr + bkv * nkb + start_n // BLOCK_N)
                p8 = _rint(p * 127.0).to(tl.int8)
                pv = tl.dot(p8, tl.trans(v8t), out_dtype=tl.int32).to(tl.float32) * (sv * (1.0 / 127.0))
            else:
                vc = tl.load(vc_ptr + kv_off, mask=ink[:, None], other=0.0)
                pv = _dot16(p.to(vc.dtype), vc, DOT16_AS_F32)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        empty = l_i == 0
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        m_out = tl.where(empty, float("-inf"), m_i)
        tl.store(o_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=inq[:, None])
        tl.store(m_ptr + bh * SQ + rows, m_out, mask=inq)
        tl.store(lse_ptr + bh * SQ + rows, lse, mask=inq)

    @triton.jit
    def _ds_tile(
        bh, bkv, b, start_m, start_n,
        q8_ptr, sq_ptr, k8, sk, v8, sv, vc,
        m_ptr, lse_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, mask_ptr,
        qk_scale, SQ, SKV,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
    ):
        """One BLOCK_M x BLOCK_N tile of the backward: returns (q8, P~, dS, sq)."""
        rows = start_m + tl.arange(0, BLOCK_M)
        cols = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        inq = rows < SQ
        qi = start_m // BLOCK_M
        nqb = tl.cdiv(SQ, BLOCK_M)
        q_off = (bh * SQ + rows[:, None]) * D + dims[None, :]
        q8 = tl.load(q8_ptr + q_off, mask=inq[:, None], other=0)
        sq = tl.load(sq_ptr + bh * nqb + qi)
        s = tl.dot(q8, tl.trans(k8), out_dtype=tl.int32).to(tl.float32) * (sq * qk_scale) * sk
        lse = tl.load(lse_ptr + bh * SQ + rows, mask=inq, other=float("-inf"))
        m = tl.load(m_ptr + bh * SQ + rows, mask=inq, other=float("-inf"))
        live = lse != float("-inf")
        keep = _visible(rows, cols, mask_ptr, b, SKV, HAS_MASK, IS_CAUSAL) & live[:, None]
        lse_safe = tl.where(live, lse, 0.0)
        m_safe = tl.where(live, m, 0.0)
        inv_l = tl.exp2(m_safe - lse_safe)  # 1 / row sum of P~
        pt = tl.where(keep, tl.exp2(s - m_safe[:, None]), 0.0)  # P~ in [0, 1]
        p = pt * inv_l[:, None]  # softmax
        if DOV_INT8:
            do8 = tl.load(do8_ptr + q_off, mask=inq[:, None], other=0)
            sdo = tl.load(sdo_ptr + bh * nqb + qi)
            dp = tl.dot(do8, tl.trans(v8), out_dtype=tl.int32).to(tl.float32) * sdo * sv
        else:
            do = tl.load(do_ptr + q_off, mask=inq[:, None], other=0.0)
            dp = _dot16(do, tl.trans(vc), DOT16_AS_F32)
        delta = tl.load(delta_ptr + bh * SQ + rows, mask=inq, other=0.0)
        ds = p * (dp - delta[:, None])
        return q8, pt, ds, sq

    @triton.jit
    def _quant_ds(ds):
        """Per-tile INT8 of dS: (codes int8 (M, N), scale)."""
        scale = tl.div_rn(tl.max(tl.max(tl.abs(ds), axis=1), axis=0), 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        qv = tl.minimum(tl.maximum(_rint(tl.div_rn(ds, safe)), -127.0), 127.0)
        return tl.where(scale > 0, qv, 0.0).to(tl.int8), scale

    @_autotuned(_BWD_CONFIGS, key=["D", "IS_CAUSAL", "HAS_MASK", "DOV_INT8", "FUSED_DQ"], reset_to_zero=["dq_ptr"])
    @triton.jit
    def _bwd_dkdv_kernel(
        q8_ptr, sq_ptr, k8_ptr, sk_ptr, v8_ptr, sv_ptr, vc_ptr,
        m_ptr, lse_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, dos8t_ptr, sdos_ptr, mask_ptr,
        q8t_ptr,  # int8 (B, Hq, D, Sq): Q^ transposed, like dO'^ (dos8t): K-major for dK and dV
        k8t_ptr,  # int8 (B, Hkv, D, Skv): K^ transposed, read with FUSED_DQ
        dk_ptr, dv_ptr,  # float32 (B, Hkv, Skv, D)
        dq_ptr,  # float32 (B, Hq, Sq, D), zeroed, accumulated with atomics when FUSED_DQ
        qk_scale, sm_scale, HKV, GROUP, SQ, SKV,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        FUSED_DQ: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        bkv = tl.program_id(1)
        b = bkv // HKV
        hkv = bkv % HKV
        start_n = pid_n * BLOCK_N
        cols = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        ink = cols < SKV
        nkb = tl.cdiv(SKV, BLOCK_N)
        nqb = tl.cdiv(SQ, BLOCK_M)
        kv_off = (bkv * SKV + cols[:, None]) * D + dims[None, :]
        k8 = tl.load(k8_ptr + kv_off, mask=ink[:, None], other=0)
        sk = tl.load(sk_ptr + bkv * nkb + pid_n)
        v8 = tl.load(v8_ptr + kv_off, mask=ink[:, None], other=0)
        sv = tl.load(sv_ptr + bkv * nkb + pid_n)
        vc = tl.load(vc_ptr + kv_off, mask=ink[:, None], other=0.0)
        if FUSED_DQ:
            k8t = tl.load(k8t_ptr + (bkv * D + dims[:, None]) * SKV + cols[None, :], mask=ink[None, :], other=0)
        dk = tl.zeros((BLOCK_N, D), tl.float32)
        dv = tl.zeros((BLOCK_N, D), tl.float32)
        m_lo = 0
        if IS_CAUSAL:
            m_lo = (start_n // BLOCK_M) * BLOCK_M  # earlier query rows see none of these keys
        for g in range(0, GROUP):
            bh = (b * HKV + hkv) * GROUP + g
            for start_m in range(m_lo, SQ, BLOCK_M):
                q8, pt, ds, sq = _ds_tile(
                    bh, bkv, b, start_m, start_n, q8_ptr, sq_ptr, k8, sk, v8, sv, vc,
                    m_ptr, lse_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, mask_ptr, qk_scale, SQ, SKV,
                    D, BLOCK_M, BLOCK_N, HAS_MASK, IS_CAUSAL, DOV_INT8, DOT16_AS_F32)
                rows = start_m + tl.arange(0, BLOCK_M)
                qt_off = (bh * D + dims[:, None]) * SQ + rows[None, :]  # (D, M) tile of a transposed copy
                inq = (rows < SQ)[None, :]
                dos8t = tl.load(dos8t_ptr + qt_off, mask=inq, other=0)
                sdos = tl.load(sdos_ptr + bh * nqb + start_m // BLOCK_M)
                p8 = _rint(pt * 127.0).to(tl.int8)
                dv += tl.dot(tl.trans(p8), tl.trans(dos8t), out_dtype=tl.int32).to(tl.float32) * (sdos * (1.0 / 127.0))
                ds8, sds = _quant_ds(ds)
                q8t = tl.load(q8t_ptr + qt_off, mask=inq, other=0)
                dk += tl.dot(tl.trans(ds8), tl.trans(q8t), out_dtype=tl.int32).to(tl.float32) * (sds * sq * sm_scale)
                if FUSED_DQ:
                    dq_part = tl.dot(ds8, tl.trans(k8t), out_dtype=tl.int32).to(tl.float32) * (sds * sk * sm_scale)
                    tl.atomic_add(dq_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], dq_part,
                                  mask=(rows < SQ)[:, None])
        tl.store(dk_ptr + kv_off, dk, mask=ink[:, None])
        tl.store(dv_ptr + kv_off, dv, mask=ink[:, None])

    @_autotuned(_BWD_CONFIGS, key=["D", "IS_CAUSAL", "HAS_MASK", "DOV_INT8"])
    @triton.jit
    def _bwd_dq_kernel(
        q8_ptr, sq_ptr, k8_ptr, sk_ptr, v8_ptr, sv_ptr, vc_ptr,
        m_ptr, lse_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, mask_ptr,
        k8t_ptr,  # int8 (B, Hkv, D, Skv): K^ transposed (K-major for dQ = dS.K)
        dq_ptr,  # float32 (B, Hq, Sq, D)
        qk_scale, sm_scale, HQ, GROUP, SQ, SKV,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        bkv = b * (HQ // GROUP) + h // GROUP
        start_m = pid_m * BLOCK_M
        rows = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        nkb = tl.cdiv(SKV, BLOCK_N)
        dq = tl.zeros((BLOCK_M, D), tl.float32)
        n_end = SKV
        if IS_CAUSAL:
            n_end = tl.minimum(SKV, start_m + BLOCK_M)
        for start_n in range(0, n_end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            ink = cols < SKV
            kv_off = (bkv * SKV + cols[:, None]) * D + dims[None, :]
            k8 = tl.load(k8_ptr + kv_off, mask=ink[:, None], other=0)
            sk = tl.load(sk_ptr + bkv * nkb + start_n // BLOCK_N)
            v8 = k8  # placeholders when DOV_INT8 is off (not read by _ds_tile then)
            sv = sk
            vc = tl.zeros((BLOCK_N, D), vc_ptr.dtype.element_ty)
            if DOV_INT8:
                v8 = tl.load(v8_ptr + kv_off, mask=ink[:, None], other=0)
                sv = tl.load(sv_ptr + bkv * nkb + start_n // BLOCK_N)
            else:
                vc = tl.load(vc_ptr + kv_off, mask=ink[:, None], other=0.0)
            q8, pt, ds, sq = _ds_tile(
                bh, bkv, b, start_m, start_n, q8_ptr, sq_ptr, k8, sk, v8, sv, vc,
                m_ptr, lse_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, mask_ptr, qk_scale, SQ, SKV,
                D, BLOCK_M, BLOCK_N, HAS_MASK, IS_CAUSAL, DOV_INT8, DOT16_AS_F32)
            ds8, sds = _quant_ds(ds)
            k8t = tl.load(k8t_ptr + (bkv * D + dims[:, None]) * SKV + cols[None, :], mask=ink[None, :], other=0)
            dq += tl.dot(ds8, tl.trans(k8t), out_dtype=tl.int32).to(tl.float32) * (sds * sk * sm_scale)
        tl.store(dq_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], dq, mask=(rows < SQ)[:, None])


def _transposed(x8: torch.Tensor) -> torch.Tensor:
    """int8 (B, H, S, D) -> contiguous (B, H, D, S): the K-major copy the 8-bit MMAs read when the
    token axis is their reduction axis (P~.V, P~^T.dO', dS^T.Q, dS.K)."""
    return x8.transpose(-1, -2).contiguous()


def _mask_arg(key_mask: Optional[torch.Tensor], device) -> tuple[torch.Tensor, bool]:
    """int8 (B, Skv) view of the bool key mask, or a 1-element dummy."""
    if key_mask is None:
        return torch.ones(1, dtype=torch.int8, device=device), False
    return key_mask.contiguous().view(torch.int8), True


def quantize_blocks(x: torch.Tensor, block: int, mean: Optional[torch.Tensor] = None,
                    key_mask: Optional[torch.Tensor] = None, row_scale: Optional[torch.Tensor] = None):
    """Per-block INT8 of x (B, H, S, D): (int8 (B, H, S, D) contiguous, float32 (B, H, ceil(S/block))).

    ``mean`` float32 (B, H, D) is subtracted, rows with ``key_mask`` (B, S) False become 0,
    ``row_scale`` float32 (B, H, S) multiplies each row, all before the block absmax.
    """
    b, h, s, d = x.shape
    nb = triton.cdiv(s, block)
    q = torch.empty((b, h, s, d), dtype=torch.int8, device=x.device)
    scale = torch.empty((b, h, nb), dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, scale.zero_()
    mask, has_mask = _mask_arg(key_mask, x.device)
    dummy = scale
    _quant_kernel[(nb, b * h)](
        x, *x.stride(), mean.contiguous() if mean is not None else dummy, mask,
        row_scale.contiguous() if row_scale is not None else dummy, q, scale, h, s,
        D=d, BLOCK=block, HAS_MEAN=mean is not None, HAS_MASK=has_mask, HAS_ROWSCALE=row_scale is not None,
    )
    return q, scale


def _forward_impl(q, k, v, key_mask, is_causal: bool, scale: Optional[float], pv: PVPrecision) -> SageBwdState:
    b, hq, sq_len, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q8, sq = quantize_blocks(q, BLOCK_Q)
    k8, sk = quantize_blocks(k, BLOCK_KV, mean=ref.key_mean(k, key_mask), key_mask=key_mask)
    v8, sv = quantize_blocks(v, BLOCK_KV, key_mask=key_mask)
    vc = ref.masked_v(v, key_mask).to(ref.compute_dtype(v.dtype)).contiguous()
    if vc.data_ptr() == v.data_ptr():  # a custom op's outputs never alias its inputs
        vc = vc.clone()
    out = torch.empty((b, hq, sq_len, d), dtype=q.dtype, device=q.device)
    m2 = torch.empty((b, hq, sq_len), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(m2)
    if out.numel():
        if skv == 0:  # no key at all: rows are 0, lse -inf
            out.zero_()
            m2.fill_(-math.inf)
            lse2.fill_(-math.inf)
        else:
            mask, has_mask = _mask_arg(key_mask, q.device)
            launch = dict(D=d, BLOCK_N=BLOCK_KV, BLOCK_Q=BLOCK_Q, HAS_MASK=has_mask, IS_CAUSAL=bool(is_causal),
                          PV_INT8=pv is PVPrecision.INT8, DOT16_AS_F32=INTERPRET)
            if INTERPRET:
                launch.update(BLOCK_M=BLOCK_Q)
            grid = lambda meta: (triton.cdiv(sq_len, meta["BLOCK_M"]), b * hq)  # noqa: E731
            v8t = _transposed(v8)  # (B, Hkv, D, Skv)
            _fwd_kernel[grid](q8, sq, k8, sk, v8t, sv, vc, mask, out, m2, lse2,
                              sm_scale * LOG2E, hq, hq // hkv, sq_len, skv, **launch)
    return SageBwdState(q8=q8, sq=sq, k8=k8, sk=sk, v8=v8, sv=sv, vc=vc, out=out, m2=m2, lse2=lse2)


def _backward_impl(do, state: SageBwdState, key_mask, is_causal: bool, scale: Optional[float], dov: DoVPrecision):
    b, hq, sq_len, d = state.q8.shape
    hkv, skv = state.k8.shape[1], state.k8.shape[2]
    dev = do.device
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dq = torch.zeros((b, hq, sq_len, d), dtype=torch.float32, device=dev)
    dk = torch.zeros((b, hkv, skv, d), dtype=torch.float32, device=dev)
    dv = torch.zeros_like(dk)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    # The same torch expressions as the reference, so dO' and delta carry the same bits.
    live = torch.isfinite(state.lse2)
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    inv_l = torch.exp2(torch.where(live, state.m2, zero) - torch.where(live, state.lse2, zero))  # (B, Hq, Sq)
    delta = (do.float() * state.out.float()).sum(-1).contiguous()  # (B, Hq, Sq)
    dos8, sdos = quantize_blocks(do, BLOCK_Q, row_scale=inv_l)
    do16 = do.to(state.vc.dtype).contiguous()
    if dov is DoVPrecision.INT8:
        do8, sdo = quantize_blocks(do, BLOCK_Q)
    else:
        do8, sdo = dos8, sdos  # not read
    mask, has_mask = _mask_arg(key_mask, dev)
    common = dict(D=d, BLOCK_M=BLOCK_Q, BLOCK_N=BLOCK_KV, HAS_MASK=has_mask, IS_CAUSAL=bool(is_causal),
                  DOV_INT8=dov is DoVPrecision.INT8, DOT16_AS_F32=INTERPRET)
    qk_scale = sm_scale * LOG2E
    fused = dq_pass() is DQPass.ATOMIC
    k8t = _transposed(state.k8)
    _bwd_dkdv_kernel[(triton.cdiv(skv, BLOCK_KV), b * hkv)](
        state.q8, state.sq, state.k8, state.sk, state.v8, state.sv, state.vc,
        state.m2, state.lse2, delta, do16, do8, sdo, _transposed(dos8), sdos, mask, _transposed(state.q8), k8t,
        dk, dv, dq, qk_scale, sm_scale, hkv, hq // hkv, sq_len, skv, FUSED_DQ=fused, **common,
    )
    if not fused:
        _bwd_dq_kernel[(triton.cdiv(sq_len, BLOCK_Q), b * hq)](
            state.q8, state.sq, state.k8, state.sk, state.v8, state.sv, state.vc,
            state.m2, state.lse2, delta, do16, do8, sdo, mask, k8t, dq,
            qk_scale, sm_scale, hq, hq // hkv, sq_len, skv, **common,
        )
    return dq, dk, dv


# One torch op per pass (opaque to torch.compile, with shape-only fake implementations), so the
# autograd function and compiled graphs never trace into Triton launches.
_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("sage_diffusers::sagebwd_triton_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
            is_causal: bool, scale: float, pv: str) -> _State:
    return tuple(_forward_impl(q, k, v, key_mask, is_causal, scale, PVPrecision(pv)))


@_fwd_op.register_fake
def _(q, k, v, key_mask, is_causal, scale, pv):
    b, hq, sq_len, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    i8 = dict(dtype=torch.int8)
    nq, nk = -(-sq_len // BLOCK_Q), -(-skv // BLOCK_KV)
    return (q.new_empty(q.shape, **i8), q.new_empty((b, hq, nq), dtype=torch.float32),
            k.new_empty(k.shape, **i8), k.new_empty((b, hkv, nk), dtype=torch.float32),
            v.new_empty(v.shape, **i8), v.new_empty((b, hkv, nk), dtype=torch.float32),
            v.new_empty(v.shape, dtype=ref.compute_dtype(v.dtype)), q.new_empty(q.shape),
            q.new_empty((b, hq, sq_len), dtype=torch.float32), q.new_empty((b, hq, sq_len), dtype=torch.float32))


@torch.library.custom_op("sage_diffusers::sagebwd_triton_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q8: torch.Tensor, sq: torch.Tensor, k8: torch.Tensor, sk: torch.Tensor,
            v8: torch.Tensor, sv: torch.Tensor, vc: torch.Tensor, out: torch.Tensor, m2: torch.Tensor,
            lse2: torch.Tensor, key_mask: Optional[torch.Tensor], is_causal: bool, scale: float,
            dov: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state = SageBwdState(q8, sq, k8, sk, v8, sv, vc, out, m2, lse2)
    return _backward_impl(do, state, key_mask, is_causal, scale, DoVPrecision(dov))


@_bwd_op.register_fake
def _(do, q8, sq, k8, sk, v8, sv, vc, out, m2, lse2, key_mask, is_causal, scale, dov):
    return (do.new_empty(q8.shape, dtype=torch.float32), do.new_empty(k8.shape, dtype=torch.float32),
            do.new_empty(k8.shape, dtype=torch.float32))


def sagebwd_forward(q, k, v, key_mask=None, is_causal=False, scale=None,
                    pv: "str | PVPrecision" = PVPrecision.INT8) -> SageBwdState:
    """Same contract as :func:`sage_diffusers.reference.sagebwd.sagebwd_forward` (the torch op)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return SageBwdState(*_fwd_op(q, k, v, key_mask, bool(is_causal), sm_scale, PVPrecision.parse(pv).value))


def sagebwd_backward(do, state: SageBwdState, key_mask=None, is_causal=False, scale=None,
                     dov: "str | DoVPrecision" = DoVPrecision.FP16):
    """Same contract as :func:`sage_diffusers.reference.sagebwd.sagebwd_backward` (the torch op)."""
    sm_scale = 1.0 / math.sqrt(state.q8.shape[-1]) if scale is None else float(scale)
    return _bwd_op(do, *state, key_mask, bool(is_causal), sm_scale, DoVPrecision.parse(dov).value)


def attention_int8_triton(q, k, v, *, key_mask=None, is_causal=False, scale=None, return_lse=False,
                          pv: "str | PVPrecision" = PVPrecision.FP16):
    """Inference backend (the kernels' contract): SageBwd's Triton forward on BHSD views.

    ``mode="int8"`` runs it on GPUs without this project's CUDA kernels (sm_80/86/89); P~.V in
    16 bits by default (SageAttention2's sm_80 choice: more accurate than INT8 P~, and inference
    needs no INT8 P~ for a backward).

    Returns (out like q, natural-log lse float32 (B, Hq, Sq) with the smoothing shift added back,
    or None).
    """
    state = sagebwd_forward(q, k, v, key_mask, is_causal, scale, pv)
    if not return_lse:
        return state.out, None
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    hq = q.shape[1]
    k_mean = ref.key_mean(k, key_mask).repeat_interleave(hq // k.shape[1], dim=1)  # (B, Hq, D)
    shift = sm_scale * (q.float() @ k_mean[..., None]).squeeze(-1)  # (B, Hq, Sq)
    return state.out, state.lse2 * (1.0 / LOG2E) + shift
