"""Pieces of the API's exact (SDPA) path that SageBwd uses too: the scale check, query chunks with
their masks, and the exact log-sum-exp.

They sit below both ``api`` and the SageBwd autograd function so that neither imports the other
(``api`` routes gradient calls to SageBwd; SageBwd needs the same scale rule and the same LSE).
"""
from __future__ import annotations

import math

import torch

# Score elements per query chunk wherever the SDPA path works chunk by chunk (LSE, causal with a
# mask): 2**24 float32 scores = 64 MiB, whatever the sequence length.
CHUNK_ELEMENTS = 1 << 24


def check_scale(scale, d: int) -> float:
    """The softmax scale of a call: ``scale`` as a finite float, or 1/sqrt(d) when None.

    Raises
    ------
    ValueError
        A tensor, a bool, or a value that is not a finite float.
    """
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, torch.Tensor):
        raise ValueError("scale: expected a Python float, got a tensor")
    if isinstance(scale, bool):  # float(True) == 1.0 would pass silently
        raise ValueError(f"scale: expected a finite float, got the bool {scale}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale: expected a finite float, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite float, got {value}")
    return value


def query_chunks(sq: int, skv: int, per_row: int, is_causal: bool):
    """Yield (i0, i1, kend): query rows i0..i1-1 and the keys 0..kend-1 they can see.

    ``per_row`` is the number of score elements one query row costs per key; chunks hold about
    ``CHUNK_ELEMENTS`` scores. Causal rows i < i1 see no key beyond i1 - 1 (top-left aligned).
    """
    step = max(1, CHUNK_ELEMENTS // max(1, per_row * skv))
    for i0 in range(0, sq, step):
        i1 = min(i0 + step, sq)
        yield i0, i1, (min(i1, skv) if is_causal else skv)


def chunk_mask(key_mask, attn_mask, is_causal: bool, i0: int, i1: int, kend: int, device):
    """The SDPA mask of query rows i0..i1-1 and keys 0..kend-1, or None: bool (True = attend), or
    additive float when ``attn_mask`` is float. Shape broadcastable to (B, Hq, i1 - i0, kend)."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask[..., :kend] if attn_mask.shape[2] == 1 else attn_mask[:, :, i0:i1, :kend]
    bool_parts = []
    if key_mask is not None:
        bool_parts.append(key_mask[:, None, None, :kend])  # (B, 1, 1, kend)
    if is_causal:
        rows = torch.arange(i0, i1, device=device)[:, None]
        cols = torch.arange(kend, device=device)[None, :]
        bool_parts.append(cols <= rows)  # (n, kend)
    for part in bool_parts:
        if mask is None:
            mask = part
        elif mask.dtype == torch.bool:
            mask = mask & part
        else:
            mask = mask.masked_fill(~part, -math.inf)
    return mask


def exact_lse(q, k, key_mask, attn_mask, is_causal: bool, scale: float) -> torch.Tensor:
    """Exact float32 log-sum-exp of the masked scores: (B, Hq, Sq).

    Query chunks of about ``CHUNK_ELEMENTS`` scores; grouped-query heads are handled by viewing
    q as (B, Hkv, g * n, D) per chunk, so K is never repeated per query head.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    kf = k.float()  # (B, Hkv, Skv, D)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for i0, i1, kend in query_chunks(sq, skv, b * hq, is_causal):
        n = i1 - i0
        qc = q[:, :, i0:i1].float().reshape(b, hkv, g * n, d)  # (B, Hkv, g*n, D): head h = kv head h // g
        s = (qc @ kf[:, :, :kend].transpose(-1, -2)).reshape(b, hq, n, kend) * scale  # (B, Hq, n, kend)
        mask = chunk_mask(key_mask, attn_mask, is_causal, i0, i1, kend, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.float()
        lse[:, :, i0:i1] = torch.logsumexp(s, dim=-1)
    return lse


def to_output_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in the caller's ``dtype``, finite values beyond its range clamped to its largest finite value.

    The references compute in float32; the kernels' epilogues saturate the same way (csrc/common/
    numeric_conversion.cuh, saturate_finite): exact attention is bounded by max |V|, so an output a few
    percent past fp16's range (quantized P or V scales rounded up) must not become infinite. NaN and the
    infinities that came from V stay.

    Parameters
    ----------
    out : (B, H, S, D) tensor, any floating dtype
    dtype : the caller's dtype
    """
    if out.dtype == dtype or not dtype.is_floating_point or torch.finfo(dtype).max >= torch.finfo(out.dtype).max:
        return out.to(dtype)
    top = torch.finfo(dtype).max
    out = torch.where(torch.isfinite(out) & (out.abs() > top), out.sign() * top, out)
    return out.to(dtype)
