"""The node in ComfyUI's original (V1) form: ``INPUT_TYPES``, ``RETURN_TYPES``, ``FUNCTION``.

Used by ComfyUI versions without ``comfy_api.latest``. This module must not import ComfyUI.
"""
from __future__ import annotations

from . import node_spec as spec
from .blocks import validate_blocks
from .patch import patch_model


class SageDiffusersAttentionLegacy:
    """MODEL -> MODEL: clone with the sage_diffusers attention override."""

    DESCRIPTION = spec.DESCRIPTION
    CATEGORY = spec.CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        t = spec.TOOLTIPS
        steps = {"default": 0, "min": 0, "max": spec.MAX_STEPS, "step": 1}
        return {
            "required": {
                "model": ("MODEL", {"tooltip": t["model"]}),
                "mode": (spec.MODE_OPTIONS, {"default": spec.MODE_DEFAULT, "tooltip": t["mode"]}),
                "full_precision_first_steps": ("INT", {**steps, "tooltip": t["full_precision_first_steps"]}),
                "full_precision_last_steps": ("INT", {**steps, "tooltip": t["full_precision_last_steps"]}),
                "blocks": ("STRING", {"default": "", "multiline": False, "tooltip": t["blocks"]}),
            },
            # optional and last: prompts and workflows saved before it existed still validate and load
            "optional": {
                "int8_precision": (spec.PRECISION_OPTIONS, {"default": spec.PRECISION_DEFAULT,
                                                            "tooltip": t["int8_precision"]}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, blocks):  # noqa: N802 (ComfyUI's name); only `blocks` so min/max/combo checks stay ComfyUI's
        return validate_blocks(blocks)

    def patch(self, model, mode, full_precision_first_steps, full_precision_last_steps, blocks,
              int8_precision=spec.PRECISION_DEFAULT):
        return (patch_model(model, mode, full_precision_first_steps, full_precision_last_steps, blocks,
                            int8_precision),)
