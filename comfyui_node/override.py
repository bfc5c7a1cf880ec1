"""The ``optimized_attention_override`` that routes ComfyUI attention calls to sage_diffusers.

ComfyUI's ``@wrap_attn`` (comfy/ldm/modules/attention.py) calls
``transformer_options["optimized_attention_override"](original_func, *args, **kwargs)`` where
``args``/``kwargs`` are those of ``attention_X(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)`` and ``kwargs`` carries
``transformer_options`` plus the wrapper's ``_inside_attn_wrapper`` flag (0.3.60+). Current
releases (0.38.x) add, when the model sets them, ``scale`` (softmax scale), ``enable_gqa`` (k, v
with fewer heads) and ``low_precision_attention`` (False: the model wants full precision for this
call), and may hand q, k, v over as ``AttentionTensorContainer`` objects. The wrapper takes the
tensors out of the containers before calling an override that has no ``container_function``; this
one deliberately has none: ComfyUI calls ``container_function`` without ``original_func``, which
every hand-back below needs, and sage_diffusers holds the tensors for the whole call either way.
Containers that still reach the override (e.g. from another override chained in front) are
emptied here the same way.

Calls this override cannot or should not take go back to ``original_func`` unchanged (or to an
override installed before ours), each counted with its reason.

This module must not import ComfyUI.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import sage_diffusers
from sage_diffusers.options import Mode

from .blocks import BlockCounter, BlockSelection, parse_blocks
from .layout import from_api, to_api
from .masks import KeyMask, to_key_mask
from .model_layout import BlockFrames
from .options import NodeMode, NodePrecision, Reason, Route
from .ran import what_ran
from .stats import GLOBAL_STATS, LOG_PREFIX, AttentionStats
from .steps import StepInfo, StepPolicy, step_from_transformer_options

logger = logging.getLogger("sage_diffusers.comfyui")

OVERRIDE_KEY = "optimized_attention_override"  # ComfyUI's transformer_options key
FORWARD_STATE_KEY = "sage_diffusers_forward_state"  # ours, in ComfyUI's per-call transformer_options
# Keyword arguments of ComfyUI's convention (0.3.60: the first two; 0.38: the rest); any other
# one is a calling convention we do not know.
SCALE_KEY, GQA_KEY, LOW_PRECISION_KEY = "scale", "enable_gqa", "low_precision_attention"
_KNOWN_KWARGS = frozenset({"transformer_options", "_inside_attn_wrapper", SCALE_KEY, GQA_KEY, LOW_PRECISION_KEY})


@dataclass(frozen=True)
class OverrideConfig:
    """What the node was asked to do; built by :func:`make_config` from the node's widget values."""

    mode: NodeMode = NodeMode.AUTO
    policy: StepPolicy = StepPolicy()
    blocks: BlockSelection = BlockSelection()
    precision: NodePrecision = NodePrecision.DEFAULT

    def __str__(self) -> str:
        return (f"mode={self.mode.value}, full-precision steps first={self.policy.first} "
                f"last={self.policy.last}, blocks={self.blocks}, int8_precision={self.precision.value}")


def make_config(mode, full_precision_first_steps: int = 0, full_precision_last_steps: int = 0,
                blocks: str = "", int8_precision="default") -> OverrideConfig:
    """Parse the node's inputs; raises ``ValueError`` naming the bad input."""
    return OverrideConfig(
        mode=NodeMode.parse(mode),
        policy=StepPolicy(int(full_precision_first_steps), int(full_precision_last_steps)),
        blocks=parse_blocks(blocks),
        precision=NodePrecision.parse(int8_precision),
    )


class _ForwardState:
    """Per model call: attention-call and block counters, the step, and converted masks.

    Lives in the ``transformer_options`` dict ComfyUI builds afresh for every model call
    (comfy/samplers.py), so it starts at 0 for each forward pass. It is also renewed when the
    ``sigmas`` tensor changes, should a caller reuse one dict across calls.
    """

    __slots__ = ("sigmas_ref", "calls", "blocks", "_step", "_step_done", "_masks")

    def __init__(self, sigmas_ref, calls_per_block: Optional[tuple] = None, locate=None):
        self.sigmas_ref = sigmas_ref
        self.calls = 0
        self.blocks = BlockCounter(calls_per_block, locate)
        self._step: Optional[StepInfo] = None
        self._step_done = False
        self._masks: dict = {}

    def step(self, transformer_options) -> Optional[StepInfo]:
        # One host sync per forward pass (reading sigmas), not one per attention call.
        if not self._step_done:
            self._step = step_from_transformer_options(transformer_options)
            self._step_done = True
        return self._step

    def key_mask(self, mask: Optional[torch.Tensor], dims: tuple) -> KeyMask:
        # Models pass the same mask object to every block; convert (and sync) once per forward.
        if mask is None:
            return KeyMask()
        key = (id(mask), dims)
        hit = self._masks.get(key)
        if hit is not None and hit[0] is mask:
            return hit[1]
        result = to_key_mask(mask, *dims)
        self._masks[key] = (mask, result)  # holding `mask` keeps its id from being reused
        return result


class SageAttentionOverride:
    """Callable installed as ComfyUI's ``optimized_attention_override``.

    Parameters
    ----------
    config : mode, step policy and block selection.
    previous : an override that was installed before ours; calls we do not take go to it.
    stats : counters; by default a fresh one feeding :data:`GLOBAL_STATS`.
    calls_per_block : attention calls per transformer block of the patched model, read from its
        structure (:func:`comfyui_node.model_layout.calls_per_block`); None: one per block.
    block_frames : the patched model's blocks (:func:`comfyui_node.model_layout.block_frames`):
        a call made from one of them belongs to it, before any counting; None: counting only.
    """

    def __init__(self, config: OverrideConfig, previous: Optional[Callable] = None,
                 stats: Optional[AttentionStats] = None, calls_per_block: Optional[tuple] = None,
                 block_frames: Optional[BlockFrames] = None):
        self.config = config
        self.previous = previous
        self.stats = stats if stats is not None else AttentionStats(parent=GLOBAL_STATS)
        self.calls_per_block = tuple(calls_per_block) if calls_per_block else None
        self.block_frames = block_frames

    def __deepcopy__(self, memo):
        # ModelPatcher.clone() deep-copies model_options; every clone must share these counters.
        return self

    def __repr__(self) -> str:
        return f"SageAttentionOverride({self.config})"

    def __call__(self, original_func: Callable, q, k, v, heads, mask=None, attn_precision=None,
                 skip_reshape=False, skip_output_reshape=False, **kwargs):
        """Compute one ComfyUI attention call; same arguments and result as ``original_func``.

        Parameters
        ----------
        original_func : ComfyUI's attention function the model called (unwrapped).
        q : (B, Sq, H*D), or (B, H, Sq, D) with ``skip_reshape``; or an AttentionTensorContainer.
        k, v : (B, Skv, Hkv*D), or (B, Hkv, Skv, D) with ``skip_reshape``; Hkv = H unless
            ``enable_gqa``.
        heads : H.
        mask : None or a ComfyUI mask, see :mod:`comfyui_node.masks`.
        attn_precision : torch.float32 asks for fp32 scores (SDPA mode upcasts; the low-bit
            paths accumulate in fp32 anyway).
        **kwargs : ``transformer_options``, ``_inside_attn_wrapper``; on 0.38+ also ``scale``
            (default 1/sqrt(D)), ``enable_gqa`` and ``low_precision_attention``.

        Returns
        -------
        (B, Sq, H*D), or (B, H, Sq, D) with ``skip_output_reshape``.
        """
        q, k, v = _take_containers(q, k, v)
        call = (q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs)
        transformer_options = kwargs.get("transformer_options")
        state = self._forward_state(transformer_options)
        block = state.blocks.block_of_next_call(transformer_options)
        state.calls += 1
        self.stats.calls_in_forward(state.calls, block)

        if self.config.mode is NodeMode.OFF:
            return self._to_comfy(original_func, call, Reason.MODE_OFF, "")
        if not self.config.blocks.selects(block):
            return self._to_comfy(original_func, call, Reason.BLOCK_NOT_SELECTED, "")
        if self.config.policy.active:
            step = state.step(transformer_options)
            if step is None:
                self.stats.note("step unknown (no sigmas/sample_sigmas): full-precision steps not applied")
            elif self.config.policy.full_precision(step):
                return self._to_comfy(original_func, call, Reason.FULL_PRECISION_STEP, "")
        mode = self.config.mode.api_mode()
        if kwargs.get(LOW_PRECISION_KEY, True) is False and mode is not Mode.SDPA:
            # ComfyUI's own sage attention gives such calls to SDPA too (comfy-kitchen's only for
            # float32 inputs); e.g. Wan i2v's image cross-attention, where SageAttention can give NaN.
            return self._to_comfy(original_func, call, Reason.LOW_PRECISION_OFF, "")
        unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
        if unknown:
            return self._to_comfy(original_func, call, Reason.UNSUPPORTED_KWARGS, ", ".join(unknown))

        inputs = to_api(q, k, v, heads, bool(skip_reshape), enable_gqa=bool(kwargs.get(GQA_KEY, False)))
        if inputs.unsupported is not None:
            return self._to_comfy(original_func, call, Reason.UNSUPPORTED_SHAPE, inputs.unsupported)
        key_mask = state.key_mask(mask, inputs.dims)
        if key_mask.unsupported is not None:
            return self._to_comfy(original_func, call, Reason.UNSUPPORTED_MASK, key_mask.unsupported)

        qa, ka, va = inputs.q, inputs.k, inputs.v
        if mode is Mode.SDPA and attn_precision == torch.float32 and qa.dtype != torch.float32:
            qa, ka, va = qa.float(), ka.float(), va.float()  # honour ComfyUI's upcast request
        try:
            with sage_diffusers.recorded_fallbacks() as delta:  # this call's, not another thread's
                out = sage_diffusers.attention(qa, ka, va, key_mask=key_mask.mask, scale=kwargs.get(SCALE_KEY),
                                               layout=inputs.layout, mode=mode,
                                               int8_precision=self.config.precision.api_precision())
        except ValueError as exc:
            return self._to_comfy(original_func, call, Reason.API_REJECTED, str(exc))
        if delta:
            self.stats.record_api_fallbacks(delta)
        self.stats.record(Route.SAGE, f"{mode.value} -> {what_ran(mode, qa.device, delta)}")
        return from_api(out.to(q.dtype), inputs.layout, bool(skip_output_reshape))

    def _forward_state(self, transformer_options) -> _ForwardState:
        locate = self.block_frames.block_of_caller if self.block_frames is not None else None
        if not isinstance(transformer_options, dict):
            return _ForwardState(None, self.calls_per_block, locate)
        sigmas = transformer_options.get("sigmas")
        state = transformer_options.get(FORWARD_STATE_KEY)
        if not isinstance(state, _ForwardState) or state.sigmas_ref is not sigmas:
            state = _ForwardState(sigmas, self.calls_per_block, locate)
            transformer_options[FORWARD_STATE_KEY] = state
            self.stats.new_forward()
        return state

    def _to_comfy(self, original_func: Callable, call: tuple, reason: Reason, detail: str):
        q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs = call
        self.stats.record(Route.COMFY, f"{reason.value}: {detail}" if detail else reason.value, reason)
        if self.previous is not None:
            return self.previous(original_func, q, k, v, heads, mask=mask, attn_precision=attn_precision,
                                 skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, **kwargs)
        return original_func(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                             skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, **kwargs)


def _take_containers(q, k, v):
    """q, k, v as tensors: ComfyUI 0.38's ``AttentionTensorContainer`` objects are emptied with
    ``take()`` (the container's single-owner hand-over), tensors pass unchanged.

    Raises ``TypeError`` like ComfyUI's wrapper when only some of the three are containers.
    """
    kinds = [_is_container(t) for t in (q, k, v)]
    if not any(kinds):
        return q, k, v
    if not all(kinds):
        raise TypeError("q, k, and v must all be attention tensor containers")
    return q.take(), k.take(), v.take()


def _is_container(obj) -> bool:
    # Duck-typed: this module must not import ComfyUI (comfy.ldm.modules.attention.AttentionTensorContainer).
    return not isinstance(obj, torch.Tensor) and callable(getattr(obj, "take", None)) and callable(getattr(obj, "peek", None))


def make_sampling_summary_wrapper(override: SageAttentionOverride) -> Callable:
    """A ComfyUI OUTER_SAMPLE wrapper that logs one summary line per sampling run.

    The line (see :meth:`StatsSnapshot.summary`) is what shows in ComfyUI's console that the
    node changed attention; it also warns when the block selection names calls that never ran.
    """

    def sage_diffusers_summary(executor, *args, **kwargs):
        before = override.stats.snapshot()
        try:
            return executor(*args, **kwargs)
        finally:
            delta = override.stats.snapshot() - before
            logger.info("%s [%s]", delta.summary(), override.config)
            if delta.total == 0:
                logger.warning("%s no attention call reached the node while sampling: this model does not pass "
                               "transformer_options to ComfyUI's attention, or this ComfyUI predates "
                               "optimized_attention_override (0.3.60)", LOG_PREFIX)
            top = override.config.blocks.max_index
            if top is not None and delta.forwards and top >= delta.max_blocks_per_forward:
                logger.warning("%s blocks selection goes up to %d but forward passes ran at most %d "
                               "transformer blocks (indices 0..%d)", LOG_PREFIX, top,
                               delta.max_blocks_per_forward, delta.max_blocks_per_forward - 1)

    return sage_diffusers_summary
