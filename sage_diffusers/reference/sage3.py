"""Torch reference of SageAttention3's FP4 microscaling attention.

NVFP4 (or MXFP4) Q, K, V; K smoothed by its token mean; Q smoothed by the mean of each 128-token
query block with the correction qbar.K^T added to the scores; P~ quantized per 128-key tile either
directly or with the two-level scheme (a per-row FP32 factor s1 = rowmax / (448 * 6), then FP4 of
P~ / s1). Walks the keys in the kernel's tiles with the kernel's running max.

Per-tensor scale: Q (after smoothing), K (after smoothing) and V each get one FP32 scale per
(batch, head), s = amax / (448 * 6) (:func:`~sage_diffusers.reference.quant.fp4_tensor_scale`),
and x / s is block-quantized, so FP4 keeps its accuracy at any magnitude; the dequantized operands
are multiplied by s again (the kernels fold s_q * s_k into the softmax scale and s_v into O).

Masked keys never influence the result (K mean over attended keys, masked K and V rows 0 before
any scale); non-finite values stay where they are (the Q block mean averages only all-finite rows,
amaxes ignore NaN/Inf, a NaN/Inf query row gives a NaN output row, +-Inf/NaN in V reach exactly
the rows that see them).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..options import FP4Format, PQuant
from ._common import attended_mean, check_bhsd, default_scale, expand_heads, nonfinite_rows, zero_masked
from .formats import E2M1_MAX, E4M3_MAX
from .online_softmax import BLOCK_KV, LOG2E, finish, nonfinite_v, online_softmax_attention
from .quant import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    dequantize_mxfp4,
    dequantize_nvfp4,
    fp4_tensor_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)

Q_SMOOTH_BLOCK = 128
TWO_LEVEL_RANGE = E4M3_MAX * E2M1_MAX  # 2688: P~ / s1 fills the whole NVFP4 range
# A tile whose s1 is below this contributes nothing (its largest P~ < 2^-52.6 of the running max:
# no change to the fp32 row sum, < 2^-45 of V's range in O). The kernels need it: 1 / s1 of a
# subnormal s1 is inf, and the sm_90 path keeps O / s1, which overflowed for s1 near FLT_MIN.
TWO_LEVEL_MIN_S1 = 2.0**-64


def fp4_roundtrip(x: torch.Tensor, dim: int, fmt: FP4Format) -> torch.Tensor:
    """Quantize then dequantize along ``dim`` (length padded with zeros to the block size)."""
    block = NVFP4_BLOCK if fmt is FP4Format.NVFP4 else MXFP4_BLOCK
    n = x.shape[dim]
    pad = (-n) % block
    if pad:
        moved = x.movedim(dim, -1)
        x = F.pad(moved, (0, pad)).movedim(-1, dim)
    if fmt is FP4Format.NVFP4:
        out = dequantize_nvfp4(*quantize_nvfp4(x, dim), dim)
    else:
        out = dequantize_mxfp4(*quantize_mxfp4(x, dim), dim)
    return out.narrow(dim, 0, n)


def fp4_tensor_roundtrip(x: torch.Tensor, dim: int, fmt: FP4Format) -> torch.Tensor:
    """x (B, H, S, D) float32 -> deq(FP4(x / s)) * s with s = ``fp4_tensor_scale(x)`` (B, H, 1, 1),
    blocks along ``dim`` (D for Q and K, tokens for V); non-finite entries are quantized as 0."""
    s = fp4_tensor_scale(x)  # (B, H, 1, 1)
    scaled = x / s.expand_as(x)  # IEEE division by a full tensor, as the kernels
    scaled = torch.where(torch.isfinite(scaled), scaled, torch.zeros((), device=x.device))
    return fp4_roundtrip(scaled, dim, fmt) * s


def smooth_q(q: torch.Tensor, block: int = Q_SMOOTH_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Sq, D) -> (q - qbar, qbar) both float32 (B, H, Sq, D); qbar is the mean of each
    ``block``-token query block over its all-finite rows (the last block counts only its real
    tokens; a block without a finite row has qbar 0), so a NaN/Inf row cannot reach its neighbours."""
    qf = q.float()
    sq = qf.shape[2]
    nb = -(-sq // block)
    finite = ~nonfinite_rows(qf)  # (B, H, Sq, 1)
    q0 = torch.where(finite, qf, torch.zeros((), device=q.device))
    padded = F.pad(q0, (0, 0, 0, nb * block - sq)).unflatten(2, (nb, block))  # (B, H, nb, blk, D)
    counts = F.pad(finite.float(), (0, 0, 0, nb * block - sq)).unflatten(2, (nb, block)).sum(3)  # (B, H, nb, 1)
    qbar = padded.sum(3) / counts.clamp_min(1)  # (B, H, nb, D)
    qbar_rows = qbar.repeat_interleave(block, dim=2)[:, :, :sq]  # (B, H, Sq, D)
    return qf - qbar_rows, qbar_rows


def sage3_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    fmt: "str | FP4Format" = FP4Format.NVFP4,
    p_quant: "str | PQuant" = PQuant.TWO_LEVEL,
    return_lse: bool = False,
    smooth_k: bool = True,
    smooth_q_blocks: bool = True,
    block_kv: int = BLOCK_KV,
):
    """FP4 SageAttention3, computed the way the kernel computes it.

    Parameters
    ----------
    q : (B, Hq, Sq, D); k, v : (B, Hkv, Skv, D), Hq % Hkv == 0.
    key_mask : bool (B, Skv), True = attend, or None.
    is_causal : top-left aligned, as torch SDPA.
    fmt : "nvfp4" or "mxfp4".  p_quant : "two_level" or "direct".
    smooth_k, smooth_q_blocks : switch the smoothing steps off (ablations only).

    Returns
    -------
    out float32 (B, Hq, Sq, D) [, lse float32 (B, Hq, Sq)].
    """
    fmt = FP4Format.parse(fmt)
    p_quant = PQuant.parse(p_quant)
    b, hq, _, sq_len, skv, d = check_bhsd(q, k, v)
    scale = default_scale(scale, d)
    if 0 in (b, hq, sq_len, skv):  # nothing to quantize (the amaxes need elements): no visible key
        out = torch.zeros(b, hq, sq_len, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, sq_len), -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out

    k_mean = attended_mean(k, key_mask) if smooth_k else torch.zeros_like(k[:, :, :1], dtype=torch.float32)
    ks = zero_masked(k.float() - k_mean, key_mask)  # (B, Hkv, Skv, D)
    v0 = zero_masked(v.float(), key_mask)  # (B, Hkv, Skv, D)
    kq = expand_heads(fp4_tensor_roundtrip(ks, -1, fmt), hq)  # (B, Hq, Skv, D), s_k * deq(Kq)
    vq = expand_heads(fp4_tensor_roundtrip(v0, 2, fmt), hq)  # (B, Hq, Skv, D), blocks along tokens
    if smooth_q_blocks:
        qs, qbar = smooth_q(q)  # (B, Hq, Sq, D) each
    else:
        qs, qbar = q.float(), None
    qq = fp4_tensor_roundtrip(qs, -1, fmt)  # (B, Hq, Sq, D), s_q * deq(Qq)
    log2_scale = scale * LOG2E

    def score(j0: int, j1: int) -> torch.Tensor:
        kt = kq[:, :, j0:j1].transpose(-1, -2)  # (B, Hq, D, n)
        s = qq @ kt  # (B, Hq, Sq, n)
        if qbar is not None:
            s = s + qbar @ kt  # the smoothing correction, kept in FP32
        return s * log2_scale

    def pv(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        if p_quant is PQuant.TWO_LEVEL:
            s1 = p.amax(-1, keepdim=True) * (1.0 / TWO_LEVEL_RANGE)  # (B, Hq, Sq, 1), as the kernel
            s1 = torch.where(s1 >= TWO_LEVEL_MIN_S1, s1, torch.zeros_like(s1))  # negligible tile: 0
            p2 = torch.where(s1 > 0, p / torch.where(s1 > 0, s1, torch.ones_like(s1)), torch.zeros_like(p))
            pq = s1 * fp4_roundtrip(p2, -1, fmt)  # (B, Hq, Sq, n)
        else:
            pq = fp4_roundtrip(p, -1, fmt)
        return pq @ vq[:, :, j0:j1]  # (B, Hq, Sq, D)

    acc, l, m = online_softmax_attention(
        score, pv, shape=(b, hq, sq_len, d), skv=skv, key_mask=key_mask,
        is_causal=is_causal, device=q.device, block_kv=block_kv,
    )
    shift = log2_scale / LOG2E * (q.float() @ expand_heads(k_mean, hq).transpose(-1, -2)).squeeze(-1)
    v_nf = nonfinite_v(v0, key_mask, is_causal, sq_len)
    out, lse = finish(acc, l, m, shift, bad_q_rows=nonfinite_rows(q),
                      v_nonfinite=tuple(expand_heads(t, hq) for t in v_nf))
    return (out, lse) if return_lse else out


def sage3_backend(q, k, v, *, key_mask, is_causal, scale, return_lse):
    """:func:`sage3_reference` (NVFP4, two-level P~) under the backend contract
    (``sage_diffusers.backends``): always (out float32 (B, Hq, Sq, D), lse float32 (B, Hq, Sq) or None)."""
    res = sage3_reference(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
    return res if return_lse else (res, None)
