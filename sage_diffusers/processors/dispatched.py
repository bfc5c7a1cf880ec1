"""Processors of the families whose diffusers processor already calls the attention dispatcher.

Flux and Chroma (``FluxAttnProcessor``), HunyuanVideo (``HunyuanVideoAttnProcessor2_0``), HunyuanVideo 1.5
(``HunyuanVideo15AttnProcessor2_0``), Wan 2.1/2.2 (``WanAttnProcessor``), LTX-Video (``LTXVideoAttnProcessor``),
QwenImage (``QwenDoubleStreamAttnProcessor2_0``) and Flux.2 (``Flux2AttnProcessor``,
``Flux2ParallelSelfAttnProcessor`` and their KV-cache variants) pass ``backend=self._attention_backend`` to
``dispatch_attention_fn``. Their sage processors keep diffusers' ``__call__`` (projections, norms, RoPE, token
order, outputs are diffusers' own code) and only answer ``_attention_backend`` with a ``sage_diffusers_*``
backend: the fixed mode's, or, with a policy, ``sage_diffusers_policy`` while the processor publishes the mode of
the call it is making (``backend.ACTIVE``).

Masks reach the backend as diffusers builds them; the backend turns key-padding structure into the API's native
``key_mask`` (HunyuanVideo's (B, 1, 1, N), QwenImage's (B, 1, 1, N), HunyuanVideo 1.5's and Chroma's (B, 1, N, N)
outer products). LTX-Video's cross-attention mask is an additive float bias, (1 - keep) * -10000; its processor
turns it back into the bool mask it encodes (exact: exp(-10000) is 0 in every float type) before diffusers' code
runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sage_diffusers._masks import classify_in_scope
from sage_diffusers.processors._core import SageProcessorMixin
from sage_diffusers.processors._diffusers_compat import diffusers_class
from sage_diffusers.processors.backend import ACTIVE, backend_member
from sage_diffusers.processors.context_parallel import any_across_ranks

# A class this diffusers lacks is a stand-in: its sage processor still exists but cannot be constructed, and
# ``sage_diffusers.processors`` leaves that family out.
_TRANSFORMERS = "diffusers.models.transformers"
FluxAttnProcessor = diffusers_class(f"{_TRANSFORMERS}.transformer_flux", "FluxAttnProcessor")
Flux2AttnProcessor = diffusers_class(f"{_TRANSFORMERS}.transformer_flux2", "Flux2AttnProcessor")
Flux2KVAttnProcessor = diffusers_class(f"{_TRANSFORMERS}.transformer_flux2", "Flux2KVAttnProcessor")
Flux2KVParallelSelfAttnProcessor = diffusers_class(
    f"{_TRANSFORMERS}.transformer_flux2", "Flux2KVParallelSelfAttnProcessor"
)
Flux2ParallelSelfAttnProcessor = diffusers_class(f"{_TRANSFORMERS}.transformer_flux2", "Flux2ParallelSelfAttnProcessor")
HunyuanVideoAttnProcessor2_0 = diffusers_class(
    f"{_TRANSFORMERS}.transformer_hunyuan_video", "HunyuanVideoAttnProcessor2_0"
)
HunyuanVideo15AttnProcessor2_0 = diffusers_class(
    f"{_TRANSFORMERS}.transformer_hunyuan_video15", "HunyuanVideo15AttnProcessor2_0"
)
LTXVideoAttnProcessor = diffusers_class(f"{_TRANSFORMERS}.transformer_ltx", "LTXVideoAttnProcessor")
QwenDoubleStreamAttnProcessor2_0 = diffusers_class(
    f"{_TRANSFORMERS}.transformer_qwenimage", "QwenDoubleStreamAttnProcessor2_0"
)
WanAttnProcessor = diffusers_class(f"{_TRANSFORMERS}.transformer_wan", "WanAttnProcessor")

# An additive bias at or below this drops its key exactly: exp(-10000 + s - max) is 0 in fp32/bf16/fp16.
_DROPPED_BIAS = -1.0e4


class _DispatchedSageMixin(SageProcessorMixin):
    """Answers ``_attention_backend`` with the sage backend of this processor's mode or policy.

    ``ModelMixin.set_attention_backend(name)`` assigns ``_attention_backend`` on every processor; an explicit
    assignment is kept as an override (the user asked for that backend) until ``reset_attention_backend()``
    assigns None, which gives control back to the processor's mode.
    """

    _backend_override: Any = None

    @property
    def _attention_backend(self) -> Any:
        if self._backend_override is not None:
            return self._backend_override
        # None (a policy): the backend that reads ACTIVE
        return backend_member(self._fixed, self.int8_precision)

    @_attention_backend.setter
    def _attention_backend(self, backend: Any) -> None:
        self._backend_override = backend

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__:
            return
        bases = (b for b in cls.__mro__ if b.__module__.startswith("diffusers.") and "__call__" in b.__dict__)
        base = next(bases, None)
        if base is None:  # built on a stand-in for a class this diffusers lacks: it cannot be constructed anyway
            return

        # diffusers' attention modules pass only the keywords the processor's signature names: ``__wrapped__``
        # (set by functools.wraps) shows the base's signature to inspect.signature, also when dynamo traces it.
        @functools.wraps(base.__call__)
        def __call__(self: _DispatchedSageMixin, attn: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self._dispatch(attn, *args, **kwargs)

        cls.__call__ = __call__  # type: ignore[method-assign]

    def _dispatch(self, attn: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """diffusers' ``__call__``, with the mode of this call published for the policy backend."""
        call = super(_DispatchedSageMixin, self).__call__
        if self._fixed is not None or self._backend_override is not None:
            return call(attn, *args, **kwargs)
        ACTIVE.push(self.choice(attn))
        try:
            return call(attn, *args, **kwargs)
        finally:
            ACTIVE.pop()


def _mixin_doc(base: type, note: str = "") -> str:
    return (
        f"``{base.__name__}`` whose core attention runs through ``sage_diffusers.attention``.{note}\n\n"
        "    Parameters are those of ``SageProcessorMixin``: ``mode``, ``policy``, ``layer``, ``state``.\n"
    )


class SageFluxAttnProcessor(_DispatchedSageMixin, FluxAttnProcessor):
    __doc__ = _mixin_doc(FluxAttnProcessor, " Flux.1 and Chroma.")


class SageHunyuanVideoAttnProcessor(_DispatchedSageMixin, HunyuanVideoAttnProcessor2_0):
    __doc__ = _mixin_doc(HunyuanVideoAttnProcessor2_0, " Its bool (B, 1, 1, N) mask runs as a key mask.")


class SageHunyuanVideo15AttnProcessor(_DispatchedSageMixin, HunyuanVideo15AttnProcessor2_0):
    __doc__ = _mixin_doc(HunyuanVideo15AttnProcessor2_0, " Its (B, 1, N, N) outer-product mask runs as a key mask.")


class SageWanAttnProcessor(_DispatchedSageMixin, WanAttnProcessor):
    __doc__ = _mixin_doc(WanAttnProcessor, " Wan 2.1 and 2.2 (t2v, i2v: both attention calls).")


class SageQwenDoubleStreamAttnProcessor(_DispatchedSageMixin, QwenDoubleStreamAttnProcessor2_0):
    __doc__ = _mixin_doc(QwenDoubleStreamAttnProcessor2_0, " Its (B, 1, 1, N) text-padding mask runs as a key mask.")


class SageFlux2AttnProcessor(_DispatchedSageMixin, Flux2AttnProcessor):
    __doc__ = _mixin_doc(Flux2AttnProcessor)


class SageFlux2ParallelSelfAttnProcessor(_DispatchedSageMixin, Flux2ParallelSelfAttnProcessor):
    __doc__ = _mixin_doc(Flux2ParallelSelfAttnProcessor)


class SageFlux2KVAttnProcessor(_DispatchedSageMixin, Flux2KVAttnProcessor):
    __doc__ = _mixin_doc(Flux2KVAttnProcessor)


class SageFlux2KVParallelSelfAttnProcessor(_DispatchedSageMixin, Flux2KVParallelSelfAttnProcessor):
    __doc__ = _mixin_doc(Flux2KVParallelSelfAttnProcessor)


def padding_bias_to_keep(bias: torch.Tensor, parallel_config: Any = None) -> torch.Tensor:
    """The bool keep-mask an additive padding bias encodes (0 = keep, <= -10000 = drop), same shape.

    A row whose keys are all dropped keeps them all: with one bias on every key, SDPA attends uniformly, which
    is the unmasked result. A bias with other values (a real bias, not padding) is returned unchanged; under
    ``torch.compile`` that is an asynchronous assert instead. Eagerly the check reads the
    bias on the host (a sync), once per bias tensor within a ``sage_diffusers.mask_scope`` (the integration
    opens one per transformer forward, which hands the same bias to every block); outside a scope nothing is
    read and the bias stays a bias.

    Under context parallelism (``parallel_config`` with a ``context_parallel_config``) ``bias`` is this rank's
    shard of the keys, so both questions are answered over every rank's shard by one collective that every
    rank makes: whether a row keeps a key (a shard holding only padding is not a row without keys), and
    whether the bias is padding everywhere (so that all ranks return the same kind of mask). That reads the
    bias on the host once per call (nothing is kept between calls).
    """
    cp = getattr(parallel_config, "context_parallel_config", None) is not None
    if torch.compiler.is_compiling():  # no host read while tracing
        keep, padding = _keep_and_padding(bias)
        torch._assert_async(padding.all(), "sage_diffusers: LTX attention bias is not a padding mask")
        any_kept = keep.any(dim=-1, keepdim=True)
        return keep | ~(any_across_ranks(any_kept, parallel_config) if cp else any_kept)
    if cp:
        keep, padding = _keep_and_padding(bias)
        any_kept = keep.any(dim=-1, keepdim=True)
        flags = any_across_ranks(torch.cat([~padding.all().reshape(1), any_kept.flatten()]), parallel_config)
        if bool(flags[0]):  # a real bias on some rank: every rank keeps its bias
            return bias
        return keep | ~flags[1:].reshape(any_kept.shape)
    keep = classify_in_scope(bias, _padding_keep_of)
    return bias if keep is None else keep


def _keep_and_padding(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = bias == 0
    return keep, keep | (bias <= _DROPPED_BIAS)


def _padding_keep_of(bias: torch.Tensor) -> torch.Tensor | None:
    """The keep-mask of :func:`padding_bias_to_keep` without context parallelism, or None when ``bias`` is not
    padding (one host sync)."""
    keep, padding = _keep_and_padding(bias)
    return keep | ~keep.any(dim=-1, keepdim=True) if bool(padding.all()) else None




class SageLTXVideoAttnProcessor(_DispatchedSageMixin, LTXVideoAttnProcessor):
    __doc__ = _mixin_doc(
        LTXVideoAttnProcessor, " The cross-attention bias (1 - keep) * -10000 runs as the bool key mask it encodes."
    )

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None and attention_mask.is_floating_point():
            # (B, 1, St) bias -> bool, diffusers' shape; under context parallelism St is this rank's text shard
            attention_mask = padding_bias_to_keep(attention_mask, self._parallel_config)
        return self._dispatch(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
