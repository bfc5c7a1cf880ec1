"""Attention processors that run diffusers models' core attention through ``sage_diffusers.attention``.

One class per family; each behaves like the diffusers processor it replaces (same ``__call__`` signature,
projections, norms, RoPE, token order and outputs) and subclasses it, so ``isinstance`` checks still hold.

- Dispatcher families (Flux, HunyuanVideo): diffusers' own ``__call__`` is kept; the processor only selects the
  registered ``sage3_<mode>`` dispatcher backend (``dispatched.py``, ``backend.py``).
- SDPA families (CogVideoX, SD3/SD3.5, Mochi): diffusers calls SDPA inline, so ``__call__`` is restated with the
  SDPA line replaced (Mochi's per-sample loop becomes one batched, key-masked call).

The mode of each call comes from a ``ModeSource`` shared by the processors of one
``sage_diffusers.integration.enable`` call (``_core.py``).
"""

from __future__ import annotations

from typing import Callable

from diffusers.models.attention_processor import (
    CogVideoXAttnProcessor2_0,
    JointAttnProcessor2_0,
    MochiAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

from sage_diffusers.processors._core import ModeSource, SageProcessorMixin
from sage_diffusers.processors.backend import BACKEND_NAMES, register_backend, sage_attention_backend
from sage_diffusers.processors.cogvideox import SageCogVideoXAttnProcessor
from sage_diffusers.processors.dispatched import SageFluxAttnProcessor, SageHunyuanVideoAttnProcessor
from sage_diffusers.processors.mochi import SageMochiAttnProcessor
from sage_diffusers.processors.sd3 import SageJointAttnProcessor

# Exact diffusers processor class -> its sage replacement. Exact types only: a subclass may change the maths.
PROCESSOR_FOR: dict[type, Callable[[ModeSource, int], SageProcessorMixin]] = {
    CogVideoXAttnProcessor2_0: SageCogVideoXAttnProcessor,
    HunyuanVideoAttnProcessor2_0: SageHunyuanVideoAttnProcessor,
    MochiAttnProcessor2_0: SageMochiAttnProcessor,
    FluxAttnProcessor: SageFluxAttnProcessor,
    JointAttnProcessor2_0: SageJointAttnProcessor,
}

__all__ = [
    "BACKEND_NAMES",
    "PROCESSOR_FOR",
    "ModeSource",
    "SageCogVideoXAttnProcessor",
    "SageFluxAttnProcessor",
    "SageHunyuanVideoAttnProcessor",
    "SageJointAttnProcessor",
    "SageMochiAttnProcessor",
    "SageProcessorMixin",
    "register_backend",
    "sage_attention_backend",
]
