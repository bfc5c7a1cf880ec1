"""Option enums of the ComfyUI node; parsed once at the node boundary, compared as members below.

This module must not import ComfyUI: CI tests it without ComfyUI installed.
"""
from __future__ import annotations

import enum
from typing import Optional

from sage_diffusers.options import Mode, ParsedEnum


class NodeMode(ParsedEnum):
    """What the node does with the attention calls it is allowed to touch.

    AUTO, FP4, INT8 and SDPA hand the call to ``sage_diffusers.attention`` with that mode (SDPA
    checks the plumbing: same maths as ComfyUI, through our reshapes and mask conversion); OFF
    passes every call to ComfyUI's own attention and only counts it.
    """

    AUTO = "auto"
    FP4 = "fp4"
    INT8 = "int8"
    SDPA = "sdpa"
    OFF = "off"

    @classmethod
    def option_name(cls) -> str:
        return "mode"

    def api_mode(self) -> Mode:
        """The ``sage_diffusers`` mode this node mode runs; OFF has none."""
        if self is NodeMode.OFF:
            raise ValueError("mode 'off' does not call sage_diffusers")
        return Mode(self.value)


class NodePrecision(ParsedEnum):
    """The 8-bit path's P~.V product, as the node offers it: DEFAULT follows
    ``SAGE_DIFFUSERS_INT8_PRECISION`` (itself "fast" unless set), FAST and ACCURATE pick
    ``sage_diffusers.attention``'s ``int8_precision`` for this model."""

    DEFAULT = "default"
    FAST = "fast"
    ACCURATE = "accurate"

    @classmethod
    def option_name(cls) -> str:
        return "int8_precision"

    def api_precision(self) -> Optional[str]:
        """``int8_precision`` for ``sage_diffusers.attention`` (None: its default)."""
        return None if self is NodePrecision.DEFAULT else self.value


class Route(str, enum.Enum):
    """Where one attention call went; the first key of every counter entry."""

    SAGE = "sage_diffusers"  # handed to sage_diffusers.attention (detail: the mode)
    COMFY = "comfyui"  # handed back to ComfyUI's attention (detail: why)


class Reason(str, enum.Enum):
    """Why a call was handed back to ComfyUI's attention (``Route.COMFY``)."""

    MODE_OFF = "mode is off"
    LOW_PRECISION_OFF = "the model asked for full precision (low_precision_attention=False)"
    FULL_PRECISION_STEP = "full-precision step"
    BLOCK_NOT_SELECTED = "attention call not in the selected blocks"
    UNSUPPORTED_KWARGS = "unsupported keyword arguments"
    UNSUPPORTED_SHAPE = "unsupported tensor shapes"
    UNSUPPORTED_MASK = "mask is not a key-padding mask"
    API_REJECTED = "sage_diffusers.attention raised ValueError"

    @property
    def expected(self) -> bool:
        """True for reasons the user asked for (logged quietly), False for limits of this node."""
        return self in (Reason.MODE_OFF, Reason.LOW_PRECISION_OFF, Reason.FULL_PRECISION_STEP,
                        Reason.BLOCK_NOT_SELECTED)
