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
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return b, hq, hkv, sq, k.shape[2], d


def expand_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...) for grouped-query attention (query head h uses kv head h // g)."""
    g = hq // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def default_scale(scale: Optional[float], d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
