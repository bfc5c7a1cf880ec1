"""The part every processor shares: where its mode comes from and the one attention call.

A processor never decides its precision itself. It holds a ``ModeSource`` (shared by all processors that one
``sage_diffusers.integration.enable`` call installed) and its ``layer`` index, and asks the source for the mode
right before attending, so a policy can change the mode per denoising step and per layer without touching the
processors.
"""

from __future__ import annotations

from typing import Protocol

import torch

import sage_diffusers
from sage_diffusers.options import Layout, Mode


class ModeSource(Protocol):
    """Anything that can name the attention mode of one layer at the current denoising step."""

    def mode_for(self, layer: int) -> Mode:
        """Return the mode layer ``layer`` must use now."""
        ...


class SageProcessorMixin:
    """State shared by all sage processors: the mode source and the layer index.

    Parameters
    ----------
    source : ModeSource
        Where the current mode comes from (a fixed mode or a step/layer policy).
    layer : int
        Index of the attention module among the processors replaced in its model, in ``named_modules()`` order
        (equals the transformer block index for the five supported families).
    """

    def __init__(self, source: ModeSource, layer: int) -> None:
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        self._source = source
        self.layer = layer

    @property
    def mode(self) -> Mode:
        """The mode this processor attends with right now."""
        return self._source.mode_for(self.layer)

    def extra_repr(self) -> str:  # shown by repr() of the processor, handy when listing attn_processors
        return f"layer={self.layer}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mode: Mode,
    layout: Layout,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the core attention of one processor through ``sage_diffusers.attention``.

    Parameters
    ----------
    query, key, value : torch.Tensor
        (B, H, S, D) for ``Layout.BHSD``, (B, S, H, D) for ``Layout.BSHD``.
    mode : Mode
        Precision mode of this call.
    layout : Layout
        Layout of the inputs; the output has the same layout.
    key_mask : torch.Tensor or None
        Bool (B, Skv) key-padding mask, True = attend; any other mask the API accepts is passed through.

    Returns
    -------
    torch.Tensor
        Attention output, same shape, layout and dtype as ``query``.
    """
    # Looked up on the package at call time (not imported by name) so that a test can wrap the public entry
    # point and see every call the processors make.
    return sage_diffusers.attention(query, key, value, attn_mask=key_mask, layout=layout, mode=mode)
