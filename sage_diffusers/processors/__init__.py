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

A family whose diffusers class the installed diffusers lacks is left out of ``PROCESSOR_FOR`` (``enable`` then
refuses its models) and its sage processor raises ``DiffusersCompatError`` when constructed; without the
dispatcher hooks every dispatcher family is left out (``_diffusers_compat``).
"""

from __future__ import annotations

import inspect
import logging
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
from sage_diffusers.options import Int8Precision, Mode
from sage_diffusers.policy import Policy, PolicyState
from sage_diffusers.processors import _diffusers_compat as compat
from sage_diffusers.processors._core import SageProcessorMixin
from sage_diffusers.processors._diffusers_compat import DiffusersCompatError
from sage_diffusers.processors.backend import BACKEND_NAMES, POLICY_BACKEND_NAME, register_backend, sage_attention_backend
from sage_diffusers.processors.cogvideox import CogVideoXAttnProcessor2_0, SageCogVideoXAttnProcessor, apply_rotary_emb
from sage_diffusers.processors.dispatched import (
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttnProcessor,
    FluxAttnProcessor,
    HunyuanVideo15AttnProcessor2_0,
    HunyuanVideoAttnProcessor2_0,
    LTXVideoAttnProcessor,
    QwenDoubleStreamAttnProcessor2_0,
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
    WanAttnProcessor,
    _DispatchedSageMixin,
)
from sage_diffusers.processors.mochi import MochiAttnProcessor2_0, SageMochiAttnProcessor
from sage_diffusers.processors.sd3 import JointAttnProcessor2_0, SageJointAttnProcessor

logger = logging.getLogger("sage_diffusers")

# What a family needs beyond the processor class it replaces.
_ALSO_NEEDS: dict[type, tuple[Any, ...]] = {SageCogVideoXAttnProcessor: (apply_rotary_emb,)}


def _family_problem(base: type, sage: type[SageProcessorMixin]) -> str | None:
    """Why this diffusers cannot serve the family of ``base`` (None: it can)."""
    for needed in (base, *_ALSO_NEEDS.get(sage, ())):
        if compat.is_missing(needed):
            return compat.missing_what(needed)
    if issubclass(sage, _DispatchedSageMixin):
        return compat.backend_problem() or compat.dispatcher_problem(base)
    return None


def _families(table: dict[type, type[SageProcessorMixin]]) -> dict[type, type[SageProcessorMixin]]:
    """``table`` without the families the installed diffusers cannot serve (each left out with a debug log)."""
    problem = compat.backend_problem()
    if problem is not None:  # turns off every dispatcher family: said once, as a warning
        compat.warn_once(problem)
    served = {}
    for base, sage in table.items():
        why = _family_problem(base, sage)
        if why is None:
            served[base] = sage
        else:
            logger.debug("sage_diffusers: %s left out: %s", sage.__name__, why)
    return served


# Exact diffusers processor class -> its sage replacement. Exact types only: a subclass may change the maths.
# Families the installed diffusers lacks are left out, so ``enable`` refuses their models with its ValueError.
PROCESSOR_FOR: dict[type, type[SageProcessorMixin]] = _families({
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
})


def _call_parameters(cls: type) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(cls.__call__).parameters.values())[2:]  # drop self, attn
    return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


# Keywords SageAttnProcessor.__call__ names: diffusers' attention modules pass only the keywords the processor's
# signature names, so it must name every keyword a family processor takes (checked below).
_UNIVERSAL_KEYWORDS = ("hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb", "rotary_emb")


def _module_families(table: dict[str, tuple[str, type[SageProcessorMixin]]]) -> dict[type, type[SageProcessorMixin]]:
    """Attention module class -> sage processor, for the served families whose keywords SageAttnProcessor passes.

    ``table`` maps a module class name to (its diffusers module, the family's sage processor). A family whose
    processor takes a keyword ``SageAttnProcessor`` does not name (a newer diffusers) is left out with a warning:
    that keyword would be dropped. Its processor and ``enable`` still serve it.
    """
    served_sage = set(PROCESSOR_FOR.values())
    result = {}
    for name, (module, sage) in table.items():
        cls = compat.diffusers_class(module, name, f"SageAttnProcessor on {name} modules")
        if compat.is_missing(cls) or sage not in served_sage:
            why = "not in this diffusers" if compat.is_missing(cls) else f"{sage.__name__} is left out"
            logger.debug("sage_diffusers: SageAttnProcessor does not serve %s (%s)", name, why)
            continue
        missing = set(_call_parameters(sage)) - set(_UNIVERSAL_KEYWORDS)
        if missing:
            compat.warn_once(compat.changed_message(
                f"calls {name}'s processor with the keywords {sorted(missing)}, which SageAttnProcessor does not "
                "pass on",
                f"SageAttnProcessor on {name} modules",
                f"sage_diffusers.enable and {sage.__name__}",
            ))
            continue
        result[cls] = sage
    return result


# Attention module classes that identify their family (``SageAttnProcessor``). diffusers' generic ``Attention``
# serves SD3, CogVideoX, HunyuanVideo, HunyuanVideo 1.5 and QwenImage alike, so it is not here.
PROCESSOR_FOR_MODULE: dict[type, type[SageProcessorMixin]] = _module_families({
    "FluxAttention": ("diffusers.models.transformers.transformer_flux", SageFluxAttnProcessor),
    "Flux2Attention": ("diffusers.models.transformers.transformer_flux2", SageFlux2AttnProcessor),
    "Flux2ParallelSelfAttention": (
        "diffusers.models.transformers.transformer_flux2", SageFlux2ParallelSelfAttnProcessor
    ),
    "WanAttention": ("diffusers.models.transformers.transformer_wan", SageWanAttnProcessor),
    "LTXAttention": ("diffusers.models.transformers.transformer_ltx", SageLTXVideoAttnProcessor),
    "MochiAttention": ("diffusers.models.attention_processor", SageMochiAttnProcessor),
})


class SageAttnProcessor(SageProcessorMixin):
    """One processor for a whole model: ``transformer.set_attn_processor(SageAttnProcessor(mode="int8"))``.

    Each attention module that calls it is served by the sage processor of its family, found from the module's
    class (Flux and Chroma, Flux.2, Wan, LTX-Video, Mochi); layers are numbered in the order modules first call
    it (the block order). Models built on diffusers' generic ``Attention`` class (SD3, CogVideoX, HunyuanVideo,
    HunyuanVideo 1.5, QwenImage) cannot be told apart from the module: their calls raise ``ValueError`` naming
    the module; use ``sage_diffusers.enable(model, ...)`` or the family's processor there.

    Parameters are those of ``SageProcessorMixin``: ``mode``, ``policy``, ``layer``, ``state``, ``int8_precision``.
    """

    def __init__(
        self,
        mode: Mode | str = Mode.AUTO,
        policy: Policy | None = None,
        *,
        layer: int | None = None,
        state: PolicyState | None = None,
        int8_precision: Int8Precision | str | None = None,
    ) -> None:
        super().__init__(mode, policy, layer=layer, state=state, int8_precision=int8_precision)
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
    "DiffusersCompatError",
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
