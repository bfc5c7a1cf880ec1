"""Torch reference of SageAttention3's FP4 microscaling attention.

NVFP4 (or MXFP4) Q, K, V; K smoothed by its token mean; Q smoothed by the mean of each 128-token
query block with the correction qbar.K^T added to the scores; P~ quantized per 128-key tile either
directly or with the two-level scheme (a per-row FP32 factor s1 = rowmax / (448 * 6), then FP4 of
P~ / s1). Walks the keys in the kernel's tiles with the kernel's running max.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..options import FP4Format, PQuant
from ._common import check_bhsd, default_scale, expand_heads
from .formats import E2M1_MAX, E4M3_MAX
from .online_softmax import BLOCK_KV, LOG2E, finish, online_softmax_attention
from .quant import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)

Q_SMOOTH_BLOCK = 128
TWO_LEVEL_RANGE = E4M3_MAX * E2M1_MAX  # 2688: P~ / s1 fills the whole NVFP4 range


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


def smooth_q(q: torch.Tensor, block: int = Q_SMOOTH_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Sq, D) -> (q - qbar, qbar) both float32 (B, H, Sq, D); qbar is the mean of each
    ``block``-token query block (the last block averages only its real tokens), per row."""
    qf = q.float()
    sq = qf.shape[2]
    nb = -(-sq // block)
    padded = F.pad(qf, (0, 0, 0, nb * block - sq)).unflatten(2, (nb, block))  # (B, H, nb, blk, D)
    counts = torch.full((nb,), float(block), device=q.device)
    counts[-1] = sq - (nb - 1) * block
    qbar = padded.sum(3) / counts[:, None]  # (B, H, nb, D)
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

    kf = k.float()  # (B, Hkv, Skv, D)
    k_mean = kf.mean(dim=2, keepdim=True) if smooth_k else torch.zeros_like(kf[:, :, :1])  # (B, Hkv, 1, D)
    kq = expand_heads(fp4_roundtrip(kf - k_mean, -1, fmt), hq)  # (B, Hq, Skv, D), deq(Kq)
    vq = expand_heads(fp4_roundtrip(v.float(), 2, fmt), hq)  # (B, Hq, Skv, D), blocks along tokens
    if smooth_q_blocks:
        qs, qbar = smooth_q(q)  # (B, Hq, Sq, D) each
    else:
        qs, qbar = q.float(), None
    qq = fp4_roundtrip(qs, -1, fmt)  # (B, Hq, Sq, D), deq(Qq)
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
    out, lse = finish(acc, l, m, shift)
    return (out, lse) if return_lse else out
