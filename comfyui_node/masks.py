"""Turn a ComfyUI attention mask into the bool key-padding mask ``sage_diffusers`` runs natively.

ComfyUI's default attention (``attention_pytorch`` in comfy/ldm/modules/attention.py) gives masks
SDPA semantics after adding missing leading dims: 2-D masks are (Sq, Skv), 3-D are (B, Sq, Skv),
4-D are (B, H, Sq, Skv), each dim broadcasting from 1. Bool masks mean True = attend; float masks
are added to the scores. Models use the key-padding special case: HunyuanVideo passes an additive
(1, 1, Skv) text mask (0 or -finfo.max), QwenImage a (B, 1, Skv) one with each sample's text
padding. HunyuanVideo's token refiner adds its (B, 1, S, S) text mask to its transpose, so padded
query rows see no key: not a key mask, its two short calls stay with ComfyUI.

Only masks that are the same for every head and every query row can be expressed as a
(B, Skv) key mask; everything else is reported unsupported and the caller hands the call back
to ComfyUI. This module must not import ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# An additive value at or below this hides its key: exp(-1e4 + s - max) is exactly 0 in fp32,
# fp16 and bf16 unless the scores themselves are near 1e4. ComfyUI's models use -finfo(dtype).max.
MASKED_ADDITIVE_MAX = -1.0e4


@dataclass(frozen=True)
class KeyMask:
    """Result of a conversion: ``mask`` (B, Skv) bool (True = attend) or None for "no mask";
    ``unsupported`` names why the mask cannot be a key mask (then ``mask`` is None)."""

    mask: Optional[torch.Tensor] = None
    unsupported: Optional[str] = None


def to_key_mask(mask: Optional[torch.Tensor], b: int, h: int, sq: int, skv: int) -> KeyMask:
    """Convert a ComfyUI mask for attention of shape (B=b, H=h, Sq=sq, Skv=skv).

    Parameters
    ----------
    mask : None; bool or floating tensor of shape (Sq', Skv'), (B', Sq', Skv') or
        (B', H', Sq', Skv'), each primed dim 1 or equal to the full size.

    Returns
    -------
    KeyMask with ``mask`` bool (b, skv) contiguous, a new tensor (the caller's is never changed);
    or with ``unsupported`` set when the mask varies over heads or query rows, has additive values
    other than 0 and large negatives, hides every key of some sample (ComfyUI averages or gives NaN
    there, sage_diffusers gives 0, so the call stays with ComfyUI), or does not broadcast.
    """
    if mask is None:
        return KeyMask()
    if not isinstance(mask, torch.Tensor):
        return KeyMask(unsupported=f"mask of type {type(mask).__name__}")
    if mask.dim() not in (2, 3, 4):
        return KeyMask(unsupported=f"{mask.dim()}-D mask")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return KeyMask(unsupported=f"mask dtype {mask.dtype}")
    # The same leading-dim rule as ComfyUI's attention_pytorch: (Sq,Skv) -> (1,1,Sq,Skv), (B,Sq,Skv) -> (B,1,Sq,Skv).
    m = mask
    if m.dim() == 2:
        m = m[None, None]
    elif m.dim() == 3:
        m = m[:, None]
    full = (b, h, sq, skv)
    if any(got not in (1, want) for got, want in zip(m.shape, full)):
        return KeyMask(unsupported=f"mask shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Skv) = {full}")
    if m.shape[3] != skv:
        # A mask broadcast along keys carries no key information; SDPA would accept it, so keep ComfyUI's path.
        return KeyMask(unsupported=f"mask shape {tuple(mask.shape)} broadcasts along keys")
    if m.shape[1] != 1 and not torch.equal(m, m[:, :1].expand_as(m)):
        return KeyMask(unsupported=f"mask {tuple(mask.shape)} differs between heads")
    m = m[:, :1]
    if m.shape[2] != 1 and not torch.equal(m, m[:, :, :1].expand_as(m)):
        return KeyMask(unsupported=f"mask {tuple(mask.shape)} differs between query rows")
    row = m[:, 0, 0, :]  # (B' in {1, b}, Skv)

    if row.dtype == torch.bool:
        attend = row
    else:
        attend = row == 0
        hidden = row <= MASKED_ADDITIVE_MAX  # includes -inf
        if not bool((attend | hidden).all()):
            return KeyMask(unsupported="additive mask with values other than 0 and <= -1e4")
    if not bool(attend.any(dim=-1).all()):
        return KeyMask(unsupported="mask hides every key of a sample")
    return KeyMask(mask=attend.expand(b, skv).contiguous())
