"""Processors of the families whose diffusers processor already calls the attention dispatcher.

Flux (``FluxAttnProcessor``) and HunyuanVideo (``HunyuanVideoAttnProcessor2_0``) pass
``backend=self._attention_backend`` to ``dispatch_attention_fn``. Their sage processors therefore keep
diffusers' ``__call__`` untouched (projections, norms, RoPE, token order, outputs are diffusers' own code) and
only answer ``_attention_backend`` with the registered ``sage3_<mode>`` backend of the current mode.

HunyuanVideo's pipeline mask arrives as bool (B, 1, 1, N) (latent then text, padding False); the backend hands it
to ``sage_diffusers.attention`` as a (B, N) key-padding mask, one batched call.
"""

from __future__ import annotations

from typing import Any

from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

from sage_diffusers.processors._core import ModeSource, SageProcessorMixin
from sage_diffusers.processors.backend import backend_member, register_backend


class _DispatchedSageMixin(SageProcessorMixin):
    """Answers ``_attention_backend`` with the sage backend of the current mode.

    ``ModelMixin.set_attention_backend(name)`` assigns ``_attention_backend`` on every processor; an explicit
    assignment is kept as an override (the user asked for that backend) until ``reset_attention_backend()``
    assigns None, which gives control back to the mode source.
    """

    def __init__(self, source: ModeSource, layer: int) -> None:
        register_backend()
        SageProcessorMixin.__init__(self, source, layer)
        self._backend_override = None

    @property
    def _attention_backend(self) -> Any:
        if self._backend_override is not None:
            return self._backend_override
        return backend_member(self.mode)

    @_attention_backend.setter
    def _attention_backend(self, backend: Any) -> None:
        self._backend_override = backend


class SageFluxAttnProcessor(_DispatchedSageMixin, FluxAttnProcessor):
    """``FluxAttnProcessor`` whose core attention runs through ``sage_diffusers.attention``.

    Parameters
    ----------
    source : ModeSource
        Gives the mode of each call.
    layer : int
        Index of this attention module (double-stream blocks first, then single-stream blocks).
    """

    def __init__(self, source: ModeSource, layer: int) -> None:
        FluxAttnProcessor.__init__(self)
        _DispatchedSageMixin.__init__(self, source, layer)


class SageHunyuanVideoAttnProcessor(_DispatchedSageMixin, HunyuanVideoAttnProcessor2_0):
    """``HunyuanVideoAttnProcessor2_0`` whose core attention runs through ``sage_diffusers.attention``.

    Parameters
    ----------
    source : ModeSource
        Gives the mode of each call.
    layer : int
        Index of this attention module (dual-stream blocks first, then single-stream blocks; the token refiner's
        attention keeps its own processor and is not counted).
    """

    def __init__(self, source: ModeSource, layer: int) -> None:
        HunyuanVideoAttnProcessor2_0.__init__(self)
        _DispatchedSageMixin.__init__(self, source, layer)
