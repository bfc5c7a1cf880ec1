"""Between ComfyUI's attention tensors and ``sage_diffusers.attention``'s 4-D layouts, as views.

ComfyUI's ``attention_X(q, k, v, heads, ..., skip_reshape, skip_output_reshape)`` takes
q (B, Sq, H*D), k/v (B, Skv, H*D) by default, or (B, H, S, D) with ``skip_reshape``; it returns
(B, Sq, H*D), or (B, H, Sq, D) with ``skip_output_reshape``. Splitting the last dim into (H, D)
is a view in BSHD order, so contiguous inputs are not copied.

This module must not import ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sage_diffusers.options import Layout


@dataclass(frozen=True)
class ApiInputs:
    """Views of q, k, v in ``layout``; ``unsupported`` set (and tensors None) when not convertible."""

    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    layout: Layout = Layout.BHSD
    unsupported: Optional[str] = None

    @property
    def dims(self) -> tuple:
        """(B, H, Sq, Skv) of the call (H = query heads)."""
        if self.layout is Layout.BHSD:
            return self.q.shape[0], self.q.shape[1], self.q.shape[2], self.k.shape[2]
        return self.q.shape[0], self.q.shape[2], self.q.shape[1], self.k.shape[1]


def _shapes(*ts) -> str:
    return ", ".join(str(tuple(t.shape)) for t in ts)


def to_api(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, skip_reshape: bool,
           enable_gqa: bool = False) -> ApiInputs:
    """Views of ComfyUI's q, k, v for ``sage_diffusers.attention``.

    Parameters
    ----------
    q : (B, Sq, H*D), or (B, H, Sq, D) when ``skip_reshape``.
    k, v : (B, Skv, H*D) or any shape holding (B, Skv, H, D) in that order (ComfyUI views them
        so), or (B, H, Skv, D) when ``skip_reshape``. With ``enable_gqa`` (ComfyUI 0.38+) they
        hold Hkv heads instead of H, H a multiple of Hkv: (B, Skv, Hkv*D) or (B, Hkv, Skv, D).
    heads : H, as ComfyUI passes it.
    enable_gqa : ComfyUI's flag for grouped-query attention; without it k, v must have H heads
        (ComfyUI's own attention would misread anything else).

    Returns
    -------
    ApiInputs with q (B, Sq, H, D) / k, v (B, Skv, Hkv, D) in BSHD, or the 4-D inputs as they are
    in BHSD; ``unsupported`` names the mismatch otherwise (differing value dims included).
    """
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return ApiInputs(unsupported="q, k, v are not all tensors")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        return ApiInputs(unsupported=f"heads={heads!r}")
    if skip_reshape:
        if any(t.dim() != 4 for t in tensors):
            return ApiInputs(unsupported=f"skip_reshape with shapes {_shapes(*tensors)}")
        b, h, _, d = q.shape
        if h != heads:
            # ComfyUI would reshape its output with `heads`; keep its behaviour by not touching the call.
            return ApiInputs(unsupported=f"heads={heads} but q has {h} heads")
        hkv = k.shape[1]
        if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != d or v.shape[3] != d \
                or not _heads_ok(h, hkv, enable_gqa):
            return ApiInputs(unsupported=f"mismatched shapes {_shapes(*tensors)}{_gqa_note(enable_gqa)}")
        return ApiInputs(q, k, v, Layout.BHSD)
    if q.dim() != 3:
        return ApiInputs(unsupported=f"q of shape {tuple(q.shape)} without skip_reshape (expected (B, Sq, H*D))")
    b, _, inner = q.shape
    if inner % heads:
        return ApiInputs(unsupported=f"q width {inner} not divisible by heads={heads}")
    d = inner // heads
    if enable_gqa:
        # ComfyUI reads the KV head count from the last dim of 3-D k and v (B, Skv, Hkv*D).
        if any(t.dim() != 3 or t.shape[0] != b or t.shape[-1] % d for t in (k, v)) or k.shape != v.shape \
                or not _heads_ok(heads, k.shape[-1] // d, True):
            return ApiInputs(unsupported=f"mismatched shapes {_shapes(*tensors)}{_gqa_note(True)}")
        hkv = k.shape[-1] // d
        return ApiInputs(q.reshape(b, -1, heads, d), k.reshape(b, -1, hkv, d), v.reshape(b, -1, hkv, d), Layout.BSHD)
    # Like ComfyUI, k and v only need to hold (B, S, H, D) elements in that order: SD3's MMDiT
    # passes v already split as (B, S, H, D) next to q and k as (B, S, H*D).
    per_token = b * heads * d
    if any(t.dim() < 2 or t.shape[0] != b or t.numel() % per_token for t in (k, v)) or k.numel() != v.numel():
        return ApiInputs(unsupported=f"mismatched shapes {_shapes(*tensors)}")
    qs, ks, vs = (t.reshape(b, -1, heads, d) for t in tensors)
    return ApiInputs(qs, ks, vs, Layout.BSHD)


def _heads_ok(hq: int, hkv: int, enable_gqa: bool) -> bool:
    return hkv == hq or (enable_gqa and hkv >= 1 and hq % hkv == 0)


def _gqa_note(enable_gqa: bool) -> str:
    return " (enable_gqa: query heads must be a multiple of KV heads)" if enable_gqa else ""


def from_api(out: torch.Tensor, layout: Layout, skip_output_reshape: bool) -> torch.Tensor:
    """ComfyUI's output form of an API result.

    Parameters
    ----------
    out : (B, H, Sq, D) for BHSD or (B, Sq, H, D) for BSHD.

    Returns
    -------
    (B, H, Sq, D) when ``skip_output_reshape``, else (B, Sq, H*D).
    """
    bhsd = out if layout is Layout.BHSD else out.transpose(1, 2)
    if skip_output_reshape:
        return bhsd
    b, h, sq, d = bhsd.shape
    return bhsd.transpose(1, 2).reshape(b, sq, h * d)
