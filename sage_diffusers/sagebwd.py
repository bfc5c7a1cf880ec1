"""SageBwd: trainable INT8 attention (forward and backward quantized), as a ``torch.autograd.Function``.

:func:`sagebwd` is the public entry point; ``sage_diffusers.attention(..., mode="int8")`` routes
here whenever autograd will need gradients. On CUDA the Triton kernels of
``sage_diffusers.kernels.sagebwd_triton`` run; elsewhere the torch reference
(``sage_diffusers.reference.sagebwd``), which computes the same quantized operands bit for bit.

Gradients: of q, k, v, and of the LSE where ``sd.attention(..., return_lse=True)`` returns one
(its gradient enters the quantized backward's dS). Not of a mask: a float ``attn_mask`` that
requires grad runs SDPA, which differentiates it. No double backward: the backward is quantized
and not itself differentiable, so ``create_graph=True`` raises (:data:`DOUBLE_BACKWARD_ERROR`).

The autograd function itself is in ``sage_diffusers._sagebwd_autograd``, the registry's trainable
backend, which the dispatcher runs; this module checks its arguments with the API's checks
(``_validate``) and falls back to the same SDPA path (``_shared.sdpa``).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _fallback, backends
from ._dispatch import empty_result, needs_grad
from ._masks import _native_key_mask
from ._sagebwd_autograd import (DOUBLE_BACKWARD_ERROR, Impl, SageBwdFunction, apply_sagebwd, default_impl,
                                default_scores)
from ._shared import check_scale, sdpa
from ._validate import autocast_like_sdpa, check_attn_mask, check_key_mask, operand_mismatch, to_bhsd
from .options import Layout
from .reference.sagebwd import DoVPrecision, ScorePrecision

SUPPORTED_HEAD_DIMS = backends.SAGEBWD.head_dims
_NATIVE_DTYPES = backends.SAGEBWD.dtypes

__all__ = ["DOUBLE_BACKWARD_ERROR", "Impl", "SUPPORTED_HEAD_DIMS", "SageBwdFunction", "ScorePrecision", "default_impl",
           "sagebwd"]


def _fallback_reason(q: torch.Tensor, d: int, dv: int, general_mask: bool) -> Optional[str]:
    mismatch = operand_mismatch(q.dtype, d, dv, _NATIVE_DTYPES, SUPPORTED_HEAD_DIMS)
    if mismatch is not None:
        return mismatch
    if general_mask:
        return ("attn_mask is not a key-padding mask (bool (B|1, 1, 1, Skv) runs natively; a float 0 / -inf or "
                "larger key-padding mask only inside sd.mask_scope())")
    return None


def sagebwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    key_mask: Optional[torch.Tensor] = None,
    layout: "str | Layout" = "BHSD",
    dov: "str | DoVPrecision" = "fp16",
    scores: "str | ScorePrecision | None" = None,
    impl: "Impl | None" = None,
) -> torch.Tensor:
    """Trainable INT8 attention (SageBwd): quantized forward and backward.

    Parameters
    ----------
    q : (B, Hq, Sq, D) for layout "BHSD", (B, Sq, Hq, D) for "BSHD"; float16, bfloat16 or float32
        (float32 is quantized directly; its 16-bit products run in bfloat16).
    k, v : (B, Hkv, Skv, D) or (B, Skv, Hkv, D); Hq a multiple of Hkv (grouped-query attention).
    attn_mask : as torch SDPA (a 2-D mask is (Sq, Skv)). A bool key-padding mask (B, 1, 1, Skv)
        (True = attend) runs natively; so does a float one holding only 0 / -inf, or a larger mask
        whose query rows are all equal, inside ``sd.mask_scope()`` (its values are read there, as
        in ``sd.attention``). Any other mask runs SDPA (forward and backward) with a counted reason,
        and so does a float mask that requires grad (while grad mode is on): SDPA differentiates
        it, SageBwd has no mask gradient. Key padding as (B, Skv) goes in ``key_mask``.
    is_causal : query i sees keys j <= i (top-left aligned, as torch SDPA).
    scale : softmax scale, default 1/sqrt(D).
    key_mask : bool (B, Skv), True = attended; combined with a key-padding ``attn_mask`` by AND.
    layout : "BHSD" or "BSHD"; the output uses the same layout.
    dov : precision of the backward's dP = dO.V^T: "fp16" (16-bit operands, the default) or
        "int8" (the paper's ablation, less accurate).
    scores : precision of the scores S = Q.K^T, in the forward and in the backward's recomputation:
        "fp16" (Q and K in the 16-bit compute dtype, and the forward's P~.V in 16 bits too; the
        backward's dV, dQ and dK products stay INT8): accurate gradients on sharp heads (large
        scores), measured as fast as "int8" with these kernels; or "int8" (the paper's SageBwd: Q
        and the smoothed K per 64-token block, P~.V in INT8), whose gradients degrade on sharp heads.
        None: the environment variable ``SAGE_DIFFUSERS_SAGEBWD_SCORES``, "fp16" when unset. See
        docs/sagebwd.md, "Accuracy".
    impl : force an implementation; default Triton on CUDA, the torch reference elsewhere.

    Returns
    -------
    out : like q (dtype and layout); rows with no visible key are 0 and get zero gradients.

    Head dims other than 32/64/128 (and float64, or value head dims that differ) run SDPA's
    forward and backward, counted in :func:`sage_diffusers.fallback_stats` with the reason.

    No double backward: differentiating SageBwd's gradients (``create_graph=True``) raises
    RuntimeError; use ``sage_diffusers.attention(..., mode="sdpa")`` there.
    """
    layout = Layout.parse(layout)
    dov = DoVPrecision.parse(dov)
    scores = default_scores() if scores is None else ScorePrecision.parse(scores)
    q, k, v, attn_mask = autocast_like_sdpa(q, k, v, attn_mask)
    qh, kh, vh = to_bhsd(q, k, v, layout)
    b, hq, sq, d = qh.shape
    skv, dv = kh.shape[2], vh.shape[3]
    scale_f = check_scale(scale, d)
    key_mask = check_key_mask(key_mask, b, skv, q.device)
    attn_mask = check_attn_mask(attn_mask, (b, hq, sq, skv), q.device, q.dtype)
    if needs_grad(attn_mask):  # before the key-padding check, which reads the mask on the host
        mask_keys, reason = None, "attn_mask requires grad (SageBwd computes no mask gradient)"
    else:
        mask_keys, native = _native_key_mask(attn_mask, key_mask, b, skv)
        reason = _fallback_reason(q, d, dv, not native)
    if b == 0 or hq == 0 or sq == 0 or skv == 0:  # as sd.attention: no heads would divide by zero below
        out, _ = empty_result(qh, kh, vh, False)
    elif reason is not None:
        _fallback.record(f"sagebwd: {reason}")
        out, _ = sdpa(qh, kh, vh, key_mask=key_mask, attn_mask=attn_mask, is_causal=bool(is_causal), scale=scale_f,
                      return_lse=False)
    else:
        impl = default_impl(q.device) if impl is None else impl
        out = apply_sagebwd(qh, kh, vh, mask_keys, bool(is_causal), scale_f, dov, impl, False, scores)
    out = out.to(q.dtype)
    return out.transpose(1, 2) if layout is Layout.BSHD else out
