"""Attention processors that run diffusers models' core attention through ``sage_diffusers.attention``.

One class per diffusers processor; each behaves like the processor it replaces (same ``__call__`` signature,
projections, norms, RoPE, token order and outputs) and subclasses it, so ``isinstance`` checks still hold. Users
construct them like diffusers' own::

    transformer.set_attn_processor(SageFluxAttnProcessor(mode="int8"))
    transformer.set_attn_processor(SageAttnProcessor(policy=DEFAULT_POLICY))   # picks the family per module

- Dispatcher families (Flux, Chroma, HunyuanVideo, HunyuanVideo 1.5, Wan, LTX-Video, QwenImage, Flux.2):
  diffusers' own ``__call__`` is kept; the processor selects a ``sage_diffusers_*`` dispatcher backend
  (``dispatched.py``, ``backend.py``).
- SDPA families (CogVideoX, SD3/SD3.5, Mochi): diffusers calls SDPA inline, so ``__call__`` is restated with the
  SDPA line replaced (Mochi's per-sample loop becomes one batched, key-masked call).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

try:
    import diffusers  # noqa: F401  (an optional dependency: the extra sage-diffusers[diffusers])
except ModuleNotFoundError as exc:
    if exc.name != "diffusers":
        raise
    raise ModuleNotFoundError(
        "sage_diffusers' diffusers integration (sd.enable, sd.disable, sd.enable_context_parallel, "
        "sage_diffusers.processors) needs diffusers: pip install 'sage-diffusers[diffusers]'",
        name="diffusers",
    ) from exc
from diffusers.models.attention_processor import (
    CogVideoXAttnProcessor2_0,
    JointAttnProcessor2_0,
    MochiAttention,
    MochiAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
)
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from sage_diffusers.options import Mode
from sage_diffusers.policy import Policy, PolicyState
from sage_diffusers.processors._core import SageProcessorMixin
from sage_diffusers.processors.backend import BACKEND_NAMES, POLICY_BACKEND_NAME, register_backend, sage_attention_backend
from sage_diffusers.processors.cogvideox import SageCogVideoXAttnProcessor
from sage_diffusers.processors.dispatched import (
    SageFlux2AttnProcessor,
    SageFlux2KVAttnProcessor,
    SageFlux2KVParallelSelfAttnProcessor,
    SageFlux2ParallelSelfAttnProcessor,
    SageFluxAttnProcessor,
    SageHunyuanVideo15AttnProcessor,
    SageHunyuanVideoAttnProcessor,
    SageLTXVideoAttnProcessor,
    SageQwenDoubleStreamAttnProcessor,
    SageWanAttnProcessor,
)
from sage_diffusers.processors.mochi import SageMochiAttnProcessor
from sage_diffusers.processors.sd3 import SageJointAttnProcessor

# Exact diffusers processor class -> its sage replacement. Exact types only: a subclass may change the maths.
PROCESSOR_FOR: dict[type, type[SageProcessorMixin]] = {
    CogVideoXAttnProcessor2_0: SageCogVideoXAttnProcessor,
    HunyuanVideoAttnProcessor2_0: SageHunyuanVideoAttnProcessor,
    HunyuanVideo15AttnProcessor2_0: SageHunyuanVideo15AttnProcessor,
    MochiAttnProcessor2_0: SageMochiAttnProcessor,
    FluxAttnProcessor: SageFluxAttnProcessor,
    JointAttnProcessor2_0: SageJointAttnProcessor,
    WanAttnProcessor: SageWanAttnProcessor,
    LTXVideoAttnProcessor: SageLTXVideoAttnProcessor,
    QwenDoubleStreamAttnProcessor2_0: SageQwenDoubleStreamAttnProcessor,
    Flux2AttnProcessor: SageFlux2AttnProcessor,
    Flux2ParallelSelfAttnProcessor: SageFlux2ParallelSelfAttnProcessor,
    Flux2KVAttnProcessor: SageFlux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor: SageFlux2KVParallelSelfAttnProcessor,
}

# Attention module classes that identify their family (``SageAttnProcessor``). diffusers' generic ``Attention``
# serves SD3, CogVideoX, HunyuanVideo, HunyuanVideo 1.5 and QwenImage alike, so it is not here.
PROCESSOR_FOR_MODULE: dict[type, type[SageProcessorMixin]] = {
    FluxAttention: SageFluxAttnProcessor,
    Flux2Attention: SageFlux2AttnProcessor,
    Flux2ParallelSelfAttention: SageFlux2ParallelSelfAttnProcessor,
    WanAttention: SageWanAttnProcessor,
    LTXAttention: SageLTXVideoAttnProcessor,
    MochiAttention: SageMochiAttnProcessor,
}


def _call_parameters(cls: type) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(cls.__call__).parameters.values())[2:]  # drop self, attn
    return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


# Keywords SageAttnProcessor.__call__ names: diffusers' attention modules pass only the keywords the processor's
# signature names, so it must name every keyword a family processor takes (checked at import below).
_UNIVERSAL_KEYWORDS = ("hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb", "rotary_emb")
_missing = {name for cls in PROCESSOR_FOR_MODULE.values() for name in _call_parameters(cls)} - set(_UNIVERSAL_KEYWORDS)
if _missing:
    raise ImportError(f"sage_diffusers: SageAttnProcessor must also take {sorted(_missing)} (diffusers changed)")


class SageAttnProcessor(SageProcessorMixin):
    """One processor for a whole model: ``transformer.set_attn_processor(SageAttnProcessor(mode="int8"))``.

    Each attention module that calls it is served by the sage processor of its family, found from the module's
    class (Flux and Chroma, Flux.2, Wan, LTX-Video, Mochi); layers are numbered in the order modules first call
    it (the block order). Models built on diffusers' generic ``Attention`` class (SD3, CogVideoX, HunyuanVideo,
    HunyuanVideo 1.5, QwenImage) cannot be told apart from the module: their calls raise ``ValueError`` naming
    the module; use ``sage_diffusers.enable(model, ...)`` or the family's processor there.

    Parameters are those of ``SageProcessorMixin``: ``mode``, ``policy``, ``layer``, ``state``.
    """

    def __init__(
        self,
        mode: Mode | str = Mode.AUTO,
        policy: Policy | None = None,
        *,
        layer: int | None = None,
        state: PolicyState | None = None,
    ) -> None:
        super().__init__(mode, policy, layer=layer, state=state)
        self._delegates: dict[type, SageProcessorMixin] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for delegate in self._delegates.values():
            delegate._layers_seen = self._layers_seen  # one numbering across families, also after loading

    def delegate_for(self, attn: torch.nn.Module) -> SageProcessorMixin:
        """The family processor that serves ``attn`` (created on first use, sharing this processor's state)."""
        cls = PROCESSOR_FOR_MODULE.get(type(attn))
        if cls is None:
            served = ", ".join(sorted(c.__name__ for c in PROCESSOR_FOR_MODULE))
            heads = getattr(attn, "heads", "?")
            raise ValueError(
                f"SageAttnProcessor cannot serve the attention module {type(attn).__name__}(heads={heads}) of "
                f"{type(attn).__module__}: its class does not tell which diffusers processor it had (it serves "
                f"{served}). Call sage_diffusers.enable(model, mode=..., policy=...) instead, or give the module "
                f"its family's processor, e.g. SageJointAttnProcessor(mode=...) for SD3."
            )
        delegate = self._delegates.get(cls)
        if delegate is None:
            delegate = cls(state=self.state, layer=self.layer)
            delegate._layers_seen = self._layers_seen
            self._delegates[cls] = delegate
        return delegate

    def __call__(
        self,
        attn: torch.nn.Module,
        *args: Any,
        hidden_states: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
        rotary_emb: Any = None,
    ) -> Any:
        """Run ``attn``'s family processor; positional arguments pass through in the order the module gave them."""
        delegate = self.delegate_for(attn)
        accepted = _call_parameters(type(delegate))
        named = dict(
            hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb, rotary_emb=rotary_emb,
        )
        by_position = set(list(accepted)[: len(args)])  # the family's parameters args already fill
        # Unset keywords the family does not take are dropped; a set one it does not take raises in its call.
        kwargs = {k: v for k, v in named.items() if k not in by_position and (k in accepted or v is not None)}
        return delegate(attn, *args, **kwargs)


__all__ = [
    "BACKEND_NAMES",
    "POLICY_BACKEND_NAME",
    "PROCESSOR_FOR",
    "PROCESSOR_FOR_MODULE",
    "SageAttnProcessor",
    "SageCogVideoXAttnProcessor",
    "SageFlux2AttnProcessor",
    "SageFlux2KVAttnProcessor",
    "SageFlux2KVParallelSelfAttnProcessor",
    "SageFlux2ParallelSelfAttnProcessor",
    "SageFluxAttnProcessor",
    "SageHunyuanVideo15AttnProcessor",
    "SageHunyuanVideoAttnProcessor",
    "SageJointAttnProcessor",
    "SageLTXVideoAttnProcessor",
    "SageMochiAttnProcessor",
    "SageProcessorMixin",
    "SageQwenDoubleStreamAttnProcessor",
    "SageWanAttnProcessor",
    "register_backend",
    "sage_attention_backend",
]
