"""Patch a ComfyUI MODEL (a ``ModelPatcher``) with the sage_diffusers attention override.

Only :func:`patch_model` touches ComfyUI objects, and it imports ComfyUI lazily (for the wrapper
type constant), so CI can test it with a stand-in model.
"""
from __future__ import annotations

import logging

from .model_layout import block_frames, calls_per_block
from .override import OVERRIDE_KEY, SageAttentionOverride, make_config, make_sampling_summary_wrapper
from .stats import LOG_PREFIX

logger = logging.getLogger("sage_diffusers.comfyui")
WRAPPER_KEY = "sage_diffusers"


def patch_model(model, mode="auto", full_precision_first_steps: int = 0, full_precision_last_steps: int = 0,
                blocks: str = "", int8_precision: str = "default"):
    """Return a clone of ``model`` whose attention goes through sage_diffusers.

    Parameters
    ----------
    model : ComfyUI ``ModelPatcher`` (anything with ``clone()`` and ``model_options``).
    mode : "auto", "fp4", "int8", "sdpa" or "off".
    full_precision_first_steps, full_precision_last_steps : sampling steps at the start and end
        that keep ComfyUI's own attention.
    blocks : transformer-block selection such as "0-3,10"; empty selects all.
    int8_precision : "default" (``SAGE_DIFFUSERS_INT8_PRECISION``), "fast" or "accurate": the 8-bit
        algorithm's P~.V product (``sage_diffusers.attention``'s ``int8_precision``).

    Raises
    ------
    ValueError
        On an invalid option, before anything is cloned.
    """
    config = make_config(mode, full_precision_first_steps, full_precision_last_steps, blocks, int8_precision)
    _warn_if_comfyui_lacks_override()
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE_KEY)
    if isinstance(previous, SageAttentionOverride):
        previous = previous.previous  # applying the node twice replaces ours, keeps what was below
    diffusion_model = _diffusion_model(patched)
    layout = calls_per_block(diffusion_model)
    override = SageAttentionOverride(config, previous=previous, calls_per_block=layout,
                                     block_frames=block_frames(diffusion_model))
    options[OVERRIDE_KEY] = override
    _add_summary_wrapper(patched, override)
    logger.info("%s patched model: %s%s%s", LOG_PREFIX, config,
                f" (attention calls per block: {_runs(layout)})" if layout is not None else "",
                f" (chained to earlier override {previous!r})" if previous is not None else "")
    return patched


def _diffusion_model(patched):
    # ModelPatcher.model is comfy.model_base.BaseModel; its diffusion_model is the DiT / UNet module.
    return getattr(getattr(patched, "model", None), "diffusion_model", None)


def _runs(layout: tuple) -> str:
    """(2, 2, 1) -> "2 x2, 1 x1": short enough for one log line with 40 blocks."""
    parts, start = [], 0
    for i in range(1, len(layout) + 1):
        if i == len(layout) or layout[i] != layout[start]:
            parts.append(f"{layout[start]} x{i - start}")
            start = i
    return ", ".join(parts)


def _warn_if_comfyui_lacks_override() -> None:
    # ComfyUI gained the override hook (attention.wrap_attn) in 0.3.60; before it the patch is inert.
    try:
        import comfy.ldm.modules.attention as comfy_attention
    except ImportError:
        return  # not inside ComfyUI (tests, scripts)
    if not hasattr(comfy_attention, "wrap_attn"):
        logger.warning("%s this ComfyUI has no optimized_attention_override hook (added in 0.3.60): "
                       "the node will not change attention", LOG_PREFIX)


def _add_summary_wrapper(patched, override: SageAttentionOverride) -> None:
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:
        logger.debug("%s comfy.patcher_extension not importable: no per-run summary line", LOG_PREFIX)
        return
    if not hasattr(patched, "add_wrapper_with_key"):
        logger.debug("%s this ComfyUI has no model wrappers: no per-run summary line", LOG_PREFIX)
        return
    patched.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    patched.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, make_sampling_summary_wrapper(override))
