"""SageBwd's two passes as torch ops, one pair per implementation.

Each pair (:func:`define`) is opaque to torch.compile, with shape-only fake implementations, so the
autograd function and compiled graphs never trace into Triton launches or into the torch
reference's Python loops over key tiles (torch 2.11's dynamo specialises their symbolic lengths
inside the autograd function and then fails an internal assertion, fullgraph or not).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from .kernels._contract import call_op
from .reference import sagebwd as ref
from .reference.sagebwd import BLOCK_KV, BLOCK_Q, DoVPrecision, PVPrecision, SageBwdState, ScorePrecision

_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _no_alias(outputs, *inputs: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``outputs``, each copied where it starts at the memory of one of ``inputs`` (a custom op's
    outputs never alias its inputs); the inputs' addresses are gathered once per call."""
    taken = {t.data_ptr() for t in inputs if t is not None and t.numel()}
    return tuple(x.clone() if x.numel() and x.data_ptr() in taken else x for x in outputs)


class Passes(NamedTuple):
    """An implementation's forward and backward, with the reference's contract
    (:func:`sage_diffusers.reference.sagebwd.sagebwd_forward` / ``sagebwd_backward``)."""

    sagebwd_forward: Callable[..., SageBwdState]
    sagebwd_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def define(name: str, forward: Callable[..., SageBwdState], backward: Callable) -> Passes:
    """Register ``sage_diffusers::{name}_fwd`` and ``_bwd`` over ``forward(q, k, v, key_mask,
    is_causal, scale, pv, scores)`` and ``backward(do, state, key_mask, is_causal, scale, dov, dlse,
    k_mean, scores)`` (enums, float scale; their outputs may alias the inputs: the ops copy those);
    returns callables with the reference's contract."""

    # Plain eager calls skip the ops (``call_op``; grad mode is off inside SageBwdFunction): on an
    # H100 host cProfile put about 1 ms per call in the dispatcher's Python custom-op wrapper, while
    # a 4K-token forward + backward took 3.6 ms of host time (eval/results/sagebwd_host_cost_h100.md).
    def fwd_eager(q, k, v, key_mask, is_causal, scale, pv, scores):  # the op's body, aliases allowed
        return forward(q, k, v, key_mask, is_causal, scale, PVPrecision(pv), ScorePrecision(scores))

    def bwd_eager(do, q8, sq, k8, sk, v8, sv, vc, out, m2, lse2, qc, kc, key_mask, is_causal, scale, dov, dlse,
                  k_mean, scores):
        state = SageBwdState(q8, sq, k8, sk, v8, sv, vc, out, m2, lse2, qc, kc)
        return backward(do, state, key_mask, is_causal, scale, DoVPrecision(dov), dlse, k_mean, ScorePrecision(scores))

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
            is_causal: bool, scale: float, pv: str, scores: str = "int8") -> _State:
        return _no_alias(fwd_eager(q, k, v, key_mask, is_causal, scale, pv, scores), q, k, v, key_mask)

    def fwd_fake(q, k, v, key_mask, is_causal, scale, pv, scores="int8"):
        b, hq, sq_len, _ = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        i8 = dict(dtype=torch.int8)
        nq, nk = -(-sq_len // BLOCK_Q), -(-skv // BLOCK_KV)
        cdt = ref.compute_dtype(q.dtype)
        qk16 = ScorePrecision(scores) is ScorePrecision.FP16
        return (q.new_empty(q.shape, **i8), q.new_empty((b, hq, nq), dtype=torch.float32),
                k.new_empty(k.shape, **i8), k.new_empty((b, hkv, nk), dtype=torch.float32),
                v.new_empty(v.shape, **i8), v.new_empty((b, hkv, nk), dtype=torch.float32),
                v.new_empty(v.shape, dtype=ref.compute_dtype(v.dtype)), q.new_empty(q.shape),
                q.new_empty((b, hq, sq_len), dtype=torch.float32), q.new_empty((b, hq, sq_len), dtype=torch.float32),
                q.new_empty(q.shape if qk16 else (0,), dtype=cdt), k.new_empty(k.shape if qk16 else (0,), dtype=cdt))

    def bwd(do: torch.Tensor, q8: torch.Tensor, sq: torch.Tensor, k8: torch.Tensor, sk: torch.Tensor,
            v8: torch.Tensor, sv: torch.Tensor, vc: torch.Tensor, out: torch.Tensor, m2: torch.Tensor,
            lse2: torch.Tensor, qc: torch.Tensor, kc: torch.Tensor, key_mask: Optional[torch.Tensor],
            is_causal: bool, scale: float, dov: str, dlse: Optional[torch.Tensor] = None,
            k_mean: Optional[torch.Tensor] = None,
            scores: str = "int8") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = (q8, sq, k8, sk, v8, sv, vc, out, m2, lse2, qc, kc)
        grads = bwd_eager(do, *state, key_mask, is_causal, scale, dov, dlse, k_mean, scores)
        return _no_alias(grads, do, *state, key_mask, dlse, k_mean)

    def bwd_fake(do, q8, sq, k8, sk, v8, sv, vc, out, m2, lse2, qc, kc, key_mask, is_causal, scale, dov,
                 dlse=None, k_mean=None, scores="int8"):
        return (do.new_empty(q8.shape, dtype=torch.float32), do.new_empty(k8.shape, dtype=torch.float32),
                do.new_empty(k8.shape, dtype=torch.float32))

    fwd_op = torch.library.custom_op(f"sage_diffusers::{name}_fwd", fwd, mutates_args=())
    fwd_op.register_fake(fwd_fake)
    bwd_op = torch.library.custom_op(f"sage_diffusers::{name}_bwd", bwd, mutates_args=())
    bwd_op.register_fake(bwd_fake)

    def sagebwd_forward(q, k, v, key_mask=None, is_causal=False, scale=None,
                        pv: "str | PVPrecision" = PVPrecision.INT8,
                        scores: "str | ScorePrecision" = ScorePrecision.INT8) -> SageBwdState:
        sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return SageBwdState(*call_op(fwd_op, fwd_eager, q, k, v, key_mask, bool(is_causal), sm_scale,
                                     PVPrecision.parse(pv).value, ScorePrecision.parse(scores).value))

    def sagebwd_backward(do, state: SageBwdState, key_mask=None, is_causal=False, scale=None,
                         dov: "str | DoVPrecision" = DoVPrecision.FP16, dlse=None, k_mean=None,
                         scores: "str | ScorePrecision" = ScorePrecision.INT8):
        sm_scale = 1.0 / math.sqrt(state.q8.shape[-1]) if scale is None else float(scale)
        return call_op(bwd_op, bwd_eager, do, *state, key_mask, bool(is_causal), sm_scale,
                       DoVPrecision.parse(dov).value, dlse, k_mean, ScorePrecision.parse(scores).value)

    return Passes(sagebwd_forward, sagebwd_backward)


REFERENCE = define("sagebwd_reference", ref.sagebwd_forward, ref.sagebwd_backward)
