"""Argument handling shared by the reference attentions."""
from __future__ import annotations

import math
from typing import Optional

import torch


def check_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate BHSD shapes; return (B, Hq, Hkv, Sq, Skv, D)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected 4-D (B, H, S, D) tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    b, hq, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[:3] != v.shape[:3] or k.shape[3] != d:
        raise ValueError(f"incompatible shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    hkv = k.shape[1]
    if (hq % hkv if hkv else hq):  # no key/value head: only zero query heads fit (no ZeroDivisionError)
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return b, hq, hkv, sq, k.shape[2], d


def expand_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...) for grouped-query attention (query head h uses kv head h // g)."""
    g = hq // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def default_scale(scale: Optional[float], d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def zero_masked(x: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """x (B, H, S, D) with the rows of masked keys replaced by 0 (torch.where: NaN/Inf vanish too).

    key_mask : bool (B, S), True = attended, or None (x returned as is).
    """
    if key_mask is None:
        return x
    return torch.where(key_mask[:, None, :, None], x, torch.zeros((), dtype=x.dtype, device=x.device))


def attended_mean(x: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Token mean of x (B, H, S, D) over attended keys only: float32 (B, H, 1, D).

    The sum runs over ``zero_masked(x)`` (masked rows contribute exactly 0), with each NaN / Inf
    element of an attended key taken as 0 (so one cannot make its channel's mean, and every key's
    smoothed value there, NaN), and is divided by the number of attended keys of the batch row (1
    where there is none, giving a zero mean).
    """
    x0 = zero_masked(x.float(), key_mask)
    x0 = torch.where(torch.isfinite(x0), x0, 0.0)
    if key_mask is None:
        count = torch.full((1, 1, 1, 1), float(x.shape[2]), device=x.device)
    else:
        count = key_mask.sum(1).clamp_min(1).float()[:, None, None, None]  # (B, 1, 1, 1)
    return x0.sum(2, keepdim=True) / count


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """bool (B, H, S, 1): rows of x (B, H, S, D) holding a NaN or +-Inf."""
    return ~torch.isfinite(x).all(-1, keepdim=True)


def to_output_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in the caller's ``dtype``, finite values beyond its range clamped to its largest finite value.

    The references compute in float32; the kernels' epilogues saturate the same way (csrc/common/
    numeric_conversion.cuh, saturate_finite; SageBwd's Triton forward, ``_fwd_store``): exact attention is bounded by max |V|, so an output a few
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
