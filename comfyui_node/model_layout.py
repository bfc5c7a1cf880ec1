"""Which transformer block of a ComfyUI diffusion model an attention call comes from.

For models (or ComfyUI versions) that do not put ``block_index`` into ``transformer_options``:

- :class:`BlockFrames` finds the block whose ``forward`` made the call on the call stack. That is
  exact however many calls a block makes in a given forward pass: LTX-2 blocks make 2 to 6 (audio
  stream, audio/video cross attention), LTX-Video's guide mask splits a self-attention into up to
  3 calls, STG and skip-layer guidance skip calls or whole blocks;
- calls made from a part of the model that is not one of its transformer blocks but is known to
  call attention (HunyuanVideo's token refiner, which runs before the double blocks) belong to no
  block (:data:`OUTSIDE_BLOCKS`): only an empty / "all" selection replaces them;
- :func:`calls_per_block` is the fallback for calls made outside any block: attention calls per
  block read once at patch time from the model's modules (attribute names of ComfyUI's own
  classes), counted in call order. Only models whose blocks make a fixed number of calls other
  than one are described; for every other model it returns None and the call order is the block
  order.

This module must not import ComfyUI.
"""
from __future__ import annotations

import enum
import sys
from typing import Optional, Sequence

import torch


class AttentionCalls(enum.IntEnum):
    """Attention calls per block of the block kinds described here, in the order they run."""

    ONE = 1  # one joint / self attention
    MMDIT_X = 2  # SD3.5 MMDiT-X block (x_block_self_attn): joint attention, then the image self-attention
    WAN_T2V = 2  # Wan block: self-attention, then text cross-attention
    WAN_I2V = 3  # Wan i2v block: self-attention, then image cross-attention, then text cross-attention
    LTXV = 2  # LTX-Video block: attn1 (self), then attn2 (text cross-attention, masked)


# BlockFrames.block_of_caller's answer for a call made from a known non-block part of the model.
OUTSIDE_BLOCKS = -1


class _Family(enum.Enum):
    """The model families whose blocks this module knows, told apart by ComfyUI's attribute names."""

    MMDIT = "mmdit"  # comfy/ldm/modules/diffusionmodules/mmdit.py: SD3, SD3.5
    WAN = "wan"  # comfy/ldm/wan/model.py: WanModel and its variants, VACE excluded
    LTX = "ltx"  # comfy/ldm/lightricks: LTXVModel, LTX-2's LTXAVModel
    HUNYUAN_VIDEO = "hunyuan_video"  # comfy/ldm/hunyuan_video/model.py: double then single blocks, token refiner


def _is_hunyuan_video(diffusion_model) -> bool:
    # Flux and Chroma have double/single blocks too, but a plain Linear txt_in (no token refiner).
    return (isinstance(getattr(diffusion_model, "double_blocks", None), torch.nn.ModuleList)
            and isinstance(getattr(diffusion_model, "single_blocks", None), torch.nn.ModuleList)
            and isinstance(getattr(diffusion_model, "txt_in", None), torch.nn.Module)
            and hasattr(diffusion_model.txt_in, "individual_token_refiner"))


def _family_blocks(diffusion_model) -> Optional[tuple]:
    """(family, its transformer blocks in forward order) for the families of :class:`_Family`, else None."""
    if _is_hunyuan_video(diffusion_model):
        return _Family.HUNYUAN_VIDEO, list(diffusion_model.double_blocks) + list(diffusion_model.single_blocks)
    if getattr(diffusion_model, "joint_blocks", None) is not None:
        return _Family.MMDIT, diffusion_model.joint_blocks
    blocks = getattr(diffusion_model, "blocks", None)
    if blocks is not None and hasattr(diffusion_model, "patch_embedding") and hasattr(diffusion_model, "text_embedding"):
        # VACE interleaves extra blocks whose calls neither the layout nor the block list describes
        return None if getattr(diffusion_model, "vace_blocks", None) is not None else (_Family.WAN, blocks)
    # QwenImage also has transformer_blocks (one joint call each), but no patchify_proj
    if getattr(diffusion_model, "transformer_blocks", None) is not None and hasattr(diffusion_model, "patchify_proj"):
        return _Family.LTX, diffusion_model.transformer_blocks
    return None


def calls_per_block(diffusion_model) -> Optional[tuple]:
    """Attention calls of each block in forward order, or None when one per block (or unknown).

    Parameters
    ----------
    diffusion_model : ComfyUI's ``model.model.diffusion_model`` (an ``nn.Module``), or anything.

    Returns
    -------
    tuple of ints (one per block), or None.
    """
    found = _family_blocks(diffusion_model)
    if found is None:
        return None
    family, blocks = found
    if family is _Family.HUNYUAN_VIDEO:
        return None  # one call per block
    if family is _Family.MMDIT:
        layout = tuple(AttentionCalls.MMDIT_X if getattr(getattr(b, "x_block", None), "x_block_self_attn", False)
                       else AttentionCalls.ONE for b in blocks)
        return tuple(int(n) for n in layout) if any(n != AttentionCalls.ONE for n in layout) else None
    if family is _Family.WAN:
        layout = []
        for block in blocks:
            cross = getattr(block, "cross_attn", None)
            if cross is None or getattr(block, "self_attn", None) is None:
                return None
            layout.append(AttentionCalls.WAN_I2V if hasattr(cross, "k_img") else AttentionCalls.WAN_T2V)
        return tuple(int(n) for n in layout) or None
    # LTX-2 (av_model.py, LTXAVModel) blocks make 2 to 6 calls depending on the inputs: no fixed layout.
    if any(getattr(b, "audio_attn1", None) is not None for b in blocks):
        return None
    if all(getattr(b, "attn1", None) is not None and getattr(b, "attn2", None) is not None for b in blocks):
        return tuple(int(AttentionCalls.LTXV) for _ in blocks) or None
    return None


class BlockFrames:
    """Finds the transformer block an attention call is made from: the nearest frame on the call
    stack that runs the ``forward`` of one of ``blocks`` (index = position in ``blocks``), or of one
    of ``outside`` (:data:`OUTSIDE_BLOCKS`).

    Parameters
    ----------
    blocks : the model's transformer blocks in the order a forward pass runs them (``nn.Module``s).
    outside : modules of the model that call attention but are none of its transformer blocks.
    """

    MAX_DEPTH = 48  # frames searched: override -> ComfyUI's wrapper -> attention module -> block

    def __init__(self, blocks: Sequence, outside: Sequence = ()):
        self._blocks = tuple(blocks)  # held, so that the ids below stay theirs
        self._outside = tuple(outside)
        self._index = {id(module): OUTSIDE_BLOCKS for module in self._outside}
        self._index.update({id(block): i for i, block in enumerate(self._blocks)})
        codes = (getattr(getattr(type(m), "forward", None), "__code__", None) for m in self._blocks + self._outside)
        self._codes = frozenset(code for code in codes if code is not None)

    def __len__(self) -> int:
        return len(self._blocks)

    def block_of_caller(self) -> Optional[int]:
        """The block whose forward is running below this call, :data:`OUTSIDE_BLOCKS` for a call from
        one of ``outside``, or None when the call is made from none of them."""
        frame = sys._getframe(1)
        for _ in range(self.MAX_DEPTH):
            if frame is None:
                return None
            code = frame.f_code
            if code in self._codes:  # compare code objects first: reading f_locals costs more
                index = self._index.get(id(_first_argument(frame, code)))  # forward's self
                if index is not None:
                    return index
            frame = frame.f_back
        return None


def _first_argument(frame, code):
    """The first argument of the function running in ``frame``, leaving its other locals alone.

    Up to CPython 3.12 ``frame.f_locals`` is a snapshot dict kept on the frame until the function
    returns: it would hold every local of the block's forward as of this call (activations such as
    LTX-2's ``vx_scaled``, which the forward ``del``s right after the attention call to lower its peak
    memory) for the rest of the block. Emptying the snapshot drops those references; the function's
    own variables are unaffected. From 3.13 on ``f_locals`` is a view that holds nothing.
    """
    local_vars = frame.f_locals
    try:
        return local_vars.get(code.co_varnames[0]) if code.co_argcount else None
    finally:
        if type(local_vars) is dict:
            local_vars.clear()


def block_frames(diffusion_model) -> Optional[BlockFrames]:
    """A :class:`BlockFrames` for the models :func:`calls_per_block` describes (and LTX-2,
    HunyuanVideo), else None.

    Only ``nn.Module`` blocks are used (their ``forward`` is what runs). For models that put
    ``block_index`` into ``transformer_options`` ComfyUI's own index wins; the frames then only
    place the calls made without one (HunyuanVideo's token refiner: :data:`OUTSIDE_BLOCKS`).
    """
    found = _family_blocks(diffusion_model)
    if found is None:
        return None
    family, blocks = found
    outside = ()
    if family is _Family.HUNYUAN_VIDEO:
        outside = (diffusion_model.txt_in,)  # the token refiner's attention calls, before the double blocks
    elif not isinstance(blocks, torch.nn.ModuleList):
        return None
    blocks = list(blocks)
    if not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks):
        return None
    return BlockFrames(blocks, outside)
