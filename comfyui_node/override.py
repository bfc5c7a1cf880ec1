"""The ``optimized_attention_override`` that routes ComfyUI attention calls to sage_diffusers.

ComfyUI's ``@wrap_attn`` (comfy/ldm/modules/attention.py) calls
``transformer_options["optimized_attention_override"](original_func, *args, **kwargs)`` where
``args``/``kwargs`` are those of ``attention_X(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)`` and ``kwargs`` carries
``transformer_options`` plus the wrapper's ``_inside_attn_wrapper`` flag. Calls this override
cannot or should not take go back to ``original_func`` unchanged (or to an override installed
before ours), each counted with its reason.

This module must not import ComfyUI.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import sage_diffusers
from sage_diffusers.options import Mode

from .blocks import BlockSelection, parse_blocks
from .layout import from_api, to_api
from .masks import KeyMask, to_key_mask
from .options import NodeMode, Reason, Route
from .stats import GLOBAL_STATS, LOG_PREFIX, AttentionStats
from .steps import StepInfo, StepPolicy, step_from_transformer_options

logger = logging.getLogger("sage_diffusers.comfyui")

OVERRIDE_KEY = "optimized_attention_override"  # ComfyUI's transformer_options key
FORWARD_STATE_KEY = "sage_diffusers_forward_state"  # ours, in ComfyUI's per-call transformer_options
# Keyword arguments ComfyUI's wrapper adds; any other one is a calling convention we do not know.
_KNOWN_KWARGS = frozenset({"transformer_options", "_inside_attn_wrapper"})


@dataclass(frozen=True)
class OverrideConfig:
    """What the node was asked to do; built by :func:`make_config` from the node's widget values."""

    mode: NodeMode = NodeMode.AUTO
    policy: StepPolicy = StepPolicy()
    blocks: BlockSelection = BlockSelection()

    def __str__(self) -> str:
        return (f"mode={self.mode.value}, full-precision steps first={self.policy.first} "
                f"last={self.policy.last}, blocks={self.blocks}")


def make_config(mode, full_precision_first_steps: int = 0, full_precision_last_steps: int = 0,
                blocks: str = "") -> OverrideConfig:
    """Parse the node's inputs; raises ``ValueError`` naming the bad input."""
    return OverrideConfig(
        mode=NodeMode.parse(mode),
        policy=StepPolicy(int(full_precision_first_steps), int(full_precision_last_steps)),
        blocks=parse_blocks(blocks),
    )


class _ForwardState:
    """Per model call: attention-call counter, the step, and converted masks.

    Lives in the ``transformer_options`` dict ComfyUI builds afresh for every model call
    (comfy/samplers.py), so it starts at 0 for each forward pass. It is also renewed when the
    ``sigmas`` tensor changes, should a caller reuse one dict across calls.
    """

    __slots__ = ("sigmas_ref", "calls", "_step", "_step_done", "_masks")

    def __init__(self, sigmas_ref):
        self.sigmas_ref = sigmas_ref
        self.calls = 0
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
    """

    def __init__(self, config: OverrideConfig, previous: Optional[Callable] = None,
                 stats: Optional[AttentionStats] = None):
        self.config = config
        self.previous = previous
        self.stats = stats if stats is not None else AttentionStats(parent=GLOBAL_STATS)

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
        q : (B, Sq, H*D), or (B, H, Sq, D) with ``skip_reshape``.
        k, v : (B, Skv, H*D), or (B, H, Skv, D) with ``skip_reshape``.
        heads : H.
        mask : None or a ComfyUI mask, see :mod:`comfyui_node.masks`.
        attn_precision : torch.float32 asks for fp32 scores (SDPA mode upcasts; the low-bit
            paths accumulate in fp32 anyway).

        Returns
        -------
        (B, Sq, H*D), or (B, H, Sq, D) with ``skip_output_reshape``.
        """
        call = (q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs)
        transformer_options = kwargs.get("transformer_options")
        state = self._forward_state(transformer_options)
        index = state.calls
        state.calls += 1
        self.stats.calls_in_forward(state.calls)

        if self.config.mode is NodeMode.OFF:
            return self._to_comfy(original_func, call, Reason.MODE_OFF, "")
        if not self.config.blocks.selects(index):
            return self._to_comfy(original_func, call, Reason.BLOCK_NOT_SELECTED, "")
        if self.config.policy.active:
            step = state.step(transformer_options)
            if step is None:
                self.stats.note("step unknown (no sigmas/sample_sigmas): full-precision steps not applied")
            elif self.config.policy.full_precision(step):
                return self._to_comfy(original_func, call, Reason.FULL_PRECISION_STEP, "")
        unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
        if unknown:
            return self._to_comfy(original_func, call, Reason.UNSUPPORTED_KWARGS, ", ".join(unknown))

        inputs = to_api(q, k, v, heads, bool(skip_reshape))
        if inputs.unsupported is not None:
            return self._to_comfy(original_func, call, Reason.UNSUPPORTED_SHAPE, inputs.unsupported)
        key_mask = state.key_mask(mask, inputs.dims)
        if key_mask.unsupported is not None:
            return self._to_comfy(original_func, call, Reason.UNSUPPORTED_MASK, key_mask.unsupported)

        mode = self.config.mode.api_mode()
        qa, ka, va = inputs.q, inputs.k, inputs.v
        if mode is Mode.SDPA and attn_precision == torch.float32 and qa.dtype != torch.float32:
            qa, ka, va = qa.float(), ka.float(), va.float()  # honour ComfyUI's upcast request
        before = sage_diffusers.fallback_stats()
        try:
            out = sage_diffusers.attention(qa, ka, va, attn_mask=key_mask.mask, layout=inputs.layout, mode=mode)
        except ValueError as exc:
            return self._to_comfy(original_func, call, Reason.API_REJECTED, str(exc))
        after = sage_diffusers.fallback_stats()
        delta = {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}
        if delta:
            self.stats.record_api_fallbacks(delta)
        self.stats.record(Route.SAGE, mode.value)
        return from_api(out.to(q.dtype), inputs.layout, bool(skip_output_reshape))

    def _forward_state(self, transformer_options) -> _ForwardState:
        if not isinstance(transformer_options, dict):
            return _ForwardState(None)
        sigmas = transformer_options.get("sigmas")
        state = transformer_options.get(FORWARD_STATE_KEY)
        if not isinstance(state, _ForwardState) or state.sigmas_ref is not sigmas:
            state = _ForwardState(sigmas)
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
            if top is not None and delta.forwards and top >= delta.max_calls_per_forward:
                logger.warning("%s blocks selection goes up to %d but forward passes made at most %d "
                               "attention calls (indices 0..%d)", LOG_PREFIX, top,
                               delta.max_calls_per_forward, delta.max_calls_per_forward - 1)

    return sage_diffusers_summary
