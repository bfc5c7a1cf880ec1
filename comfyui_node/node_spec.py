"""Names, defaults and help texts shared by the V3 and the legacy node definitions.

This module must not import ComfyUI.
"""
from __future__ import annotations

from .options import NodeMode, NodePrecision

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
PRECISION_OPTIONS = [p.value for p in NodePrecision]
PRECISION_DEFAULT = NodePrecision.DEFAULT.value
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
    "int8_precision": "The 8-bit algorithm's P~.V product (mode int8, or auto choosing it): fast (FP8) or "
                      "accurate (16-bit: about a third of the error, 0-20 % more attention time on an "
                      "H100); default follows SAGE_DIFFUSERS_INT8_PRECISION (fast unless set).",
}
