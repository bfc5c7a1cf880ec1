"""How many attention calls each transformer block of a ComfyUI diffusion model makes.

Read once at patch time from the model's modules (attribute names of ComfyUI's own classes), so
the node can count blocks on ComfyUI versions that do not put ``block_index`` into
``transformer_options``. Only models whose blocks make a number of calls other than one are
described; for every other model :func:`calls_per_block` returns None and the call order is the
block order. This module must not import ComfyUI.
"""
from __future__ import annotations

import enum
from typing import Optional


class AttentionCalls(enum.IntEnum):
    """Attention calls per block of the block kinds described here, in the order they run."""

    ONE = 1  # one joint / self attention
    MMDIT_X = 2  # SD3.5 MMDiT-X block (x_block_self_attn): joint attention, then the image self-attention
    WAN_T2V = 2  # Wan block: self-attention, then text cross-attention
    WAN_I2V = 3  # Wan i2v block: self-attention, then image cross-attention, then text cross-attention
    LTXV = 2  # LTX-Video block: attn1 (self), then attn2 (text cross-attention, masked)


def calls_per_block(diffusion_model) -> Optional[tuple]:
    """Attention calls of each block in forward order, or None when one per block (or unknown).

    Parameters
    ----------
    diffusion_model : ComfyUI's ``model.model.diffusion_model`` (an ``nn.Module``), or anything.

    Returns
    -------
    tuple of ints (one per block), or None.
    """
    joint_blocks = getattr(diffusion_model, "joint_blocks", None)
    if joint_blocks is not None:  # comfy/ldm/modules/diffusionmodules/mmdit.py: MMDiT
        layout = tuple(AttentionCalls.MMDIT_X if getattr(getattr(b, "x_block", None), "x_block_self_attn", False)
                       else AttentionCalls.ONE for b in joint_blocks)
        return tuple(int(n) for n in layout) if any(n != AttentionCalls.ONE for n in layout) else None
    blocks = getattr(diffusion_model, "blocks", None)
    if blocks is not None and hasattr(diffusion_model, "patch_embedding") and hasattr(diffusion_model, "text_embedding"):
        # comfy/ldm/wan/model.py: WanModel and its variants. VACE interleaves extra blocks whose
        # calls this layout does not describe, so it stays unknown.
        if getattr(diffusion_model, "vace_blocks", None) is not None:
            return None
        layout = []
        for block in blocks:
            cross = getattr(block, "cross_attn", None)
            if cross is None or getattr(block, "self_attn", None) is None:
                return None
            layout.append(AttentionCalls.WAN_I2V if hasattr(cross, "k_img") else AttentionCalls.WAN_T2V)
        return tuple(int(n) for n in layout) or None
    transformer_blocks = getattr(diffusion_model, "transformer_blocks", None)
    if transformer_blocks is not None and hasattr(diffusion_model, "patchify_proj"):
        # comfy/ldm/lightricks/model.py: LTXVModel (QwenImage also has transformer_blocks, one joint call each).
        if all(getattr(b, "attn1", None) is not None and getattr(b, "attn2", None) is not None
               for b in transformer_blocks):
            return tuple(int(AttentionCalls.LTXV) for _ in transformer_blocks) or None
    return None
