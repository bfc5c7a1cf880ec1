"""Names, defaults and help texts shared by the V3 and the legacy node definitions.

This module must not import ComfyUI.
"""
from __future__ import annotations

from .options import NodeMode

NODE_ID = "SageDiffusersAttention"
DISPLAY_NAME = "Sage Attention (sage_diffusers)"
CATEGORY = "advanced/model"
DESCRIPTION = (
    "Routes the model's attention through sage_diffusers (SageAttention3 FP4 / 8-bit) via "
    "ComfyUI's optimized_attention_override. Calls it cannot take (other masks, shapes) keep "
    "ComfyUI's attention; every call is counted and the console gets a summary per sampling run."
)
MODE_OPTIONS = [m.value for m in NodeMode]
MODE_DEFAULT = NodeMode.AUTO.value
MAX_STEPS = 10000

TOOLTIPS = {
    "model": "The diffusion model to patch (a clone is returned; the input is unchanged).",
    "mode": "auto: best kernel for the GPU (SDPA where none); fp4 / int8: force that algorithm "
            "(torch reference where no kernel exists: slow); sdpa: torch SDPA through this node "
            "(plumbing check); off: ComfyUI's attention, calls only counted.",
    "full_precision_first_steps": "Number of sampling steps at the start that keep ComfyUI's attention.",
    "full_precision_last_steps": "Number of sampling steps at the end that keep ComfyUI's attention.",
    "blocks": "Transformer blocks to replace (0-based), e.g. '0-3,10'; empty = all. Double-stream "
              "blocks first, then single-stream blocks (Flux). Blocks with several attention calls "
              "(SD3.5 MMDiT-X, Wan, LTX-Video) count as one block.",
}
