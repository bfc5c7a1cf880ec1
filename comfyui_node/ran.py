"""What ``sage_diffusers.attention`` actually ran for one call, for the node's counters.

The API answers a call with its output only; what ran is read from its documented behaviour and
from :func:`sage_diffusers.fallback_stats` (the reasons counted during the call):

- a counted reason "<mode>: no kernel on ..." means the torch reference of the mode ran; any
  other counted reason means SDPA ran;
- nothing counted: mode "sdpa" ran SDPA; off CUDA, "auto" runs SDPA and "int8"/"fp4" their torch
  reference (by design, uncounted); on CUDA "int8"/"fp4" ran their kernel and "auto" the kernel
  of its GPU (8-bit on sm_90, FP4 on sm_120; anything else would have been counted).

This module must not import ComfyUI.
"""
from __future__ import annotations

import enum

import torch

from sage_diffusers.options import Mode

_REFERENCE_MARK = "no kernel on"  # the API's reason text when an explicit mode runs its torch reference
_AUTO_KERNEL_BY_MAJOR = {9: Mode.INT8, 12: Mode.FP4}  # the API's "auto" choice per compute capability


class Ran(str, enum.Enum):
    """Implementation that computed a call."""

    KERNEL = "kernel"
    REFERENCE = "reference"
    SDPA = "SDPA"


def what_ran(mode: Mode, device: torch.device, counted: dict) -> str:
    """A short text such as ``"int8 kernel"``, ``"fp4 reference"`` or ``"SDPA"``.

    Parameters
    ----------
    mode : the mode passed to ``sage_diffusers.attention``.
    device : q's device.
    counted : fallback reasons the API counted during the call ({reason: count}).
    """
    if counted:
        if mode in (Mode.INT8, Mode.FP4) and all(_REFERENCE_MARK in r for r in counted):
            return f"{mode.value} {Ran.REFERENCE.value}"
        return Ran.SDPA.value
    if mode is Mode.SDPA:
        return Ran.SDPA.value
    if device.type != "cuda":
        return Ran.SDPA.value if mode is Mode.AUTO else f"{mode.value} {Ran.REFERENCE.value}"
    if mode is Mode.AUTO:
        algo = _AUTO_KERNEL_BY_MAJOR.get(torch.cuda.get_device_capability(device)[0])
        return f"{algo.value} {Ran.KERNEL.value}" if algo is not None else f"low-bit {Ran.KERNEL.value}"
    return f"{mode.value} {Ran.KERNEL.value}"
