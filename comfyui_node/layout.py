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
        """(B, H, Sq, Skv) of the call."""
        if self.layout is Layout.BHSD:
            return self.q.shape[0], self.q.shape[1], self.q.shape[2], self.k.shape[2]
        return self.q.shape[0], self.q.shape[2], self.q.shape[1], self.k.shape[1]


def _shapes(*ts) -> str:
    return ", ".join(str(tuple(t.shape)) for t in ts)


def to_api(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, skip_reshape: bool) -> ApiInputs:
    """Views of ComfyUI's q, k, v for ``sage_diffusers.attention``.

    Parameters
    ----------
    q : (B, Sq, H*D), or (B, H, Sq, D) when ``skip_reshape``.
    k, v : (B, Skv, H*D) or any shape holding (B, Skv, H, D) in that order (ComfyUI views them
        so), or (B, H, Skv, D) when ``skip_reshape``.
    heads : H, as ComfyUI passes it.

    Returns
    -------
    ApiInputs with q (B, Sq, H, D) / k, v (B, Skv, H, D) in BSHD, or the 4-D inputs as they are in
    BHSD; ``unsupported`` names the mismatch otherwise (GQA and differing value dims included:
    ComfyUI's own attention does not take them either).
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
        if k.shape[:2] != (b, h) or v.shape[:3] != k.shape[:3] or k.shape[3] != d or v.shape[3] != d:
            return ApiInputs(unsupported=f"mismatched shapes {_shapes(*tensors)}")
        return ApiInputs(q, k, v, Layout.BHSD)
    if q.dim() != 3:
        return ApiInputs(unsupported=f"q of shape {tuple(q.shape)} without skip_reshape (expected (B, Sq, H*D))")
    b, _, inner = q.shape
    if inner % heads:
        return ApiInputs(unsupported=f"q width {inner} not divisible by heads={heads}")
    d = inner // heads
    # Like ComfyUI, k and v only need to hold (B, S, H, D) elements in that order: SD3's MMDiT
    # passes v already split as (B, S, H, D) next to q and k as (B, S, H*D).
    per_token = b * heads * d
    if any(t.dim() < 2 or t.shape[0] != b or t.numel() % per_token for t in (k, v)) or k.numel() != v.numel():
        return ApiInputs(unsupported=f"mismatched shapes {_shapes(*tensors)}")
    qs, ks, vs = (t.reshape(b, -1, heads, d) for t in tensors)
    return ApiInputs(qs, ks, vs, Layout.BSHD)

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
