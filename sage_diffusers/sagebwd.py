"""SageBwd: trainable INT8 attention (forward and backward quantized), as a ``torch.autograd.Function``.

:func:`sagebwd` is the public entry point; ``sage_diffusers.attention(..., mode="int8")`` routes
here whenever autograd will need gradients. On CUDA the Triton kernels of
``sage_diffusers.kernels.sagebwd_triton`` run; elsewhere the torch reference
(``sage_diffusers.reference.sagebwd``), which computes the same quantized operands bit for bit.

Gradients: of q, k, v, and of the LSE where ``sd.attention(..., return_lse=True)`` returns one
(its gradient enters the quantized backward's dS). Not of a mask: a float ``attn_mask`` that
requires grad runs SDPA, which differentiates it. No double backward: the backward is quantized
and not itself differentiable, so ``create_graph=True`` raises (:data:`DOUBLE_BACKWARD_ERROR`).
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from . import _fallback
from .options import Layout
from .reference import sagebwd as ref
from .reference.sagebwd import DoVPrecision, PVPrecision, SageBwdState

SUPPORTED_HEAD_DIMS = ref.SUPPORTED_HEAD_DIMS
_NATIVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

DOUBLE_BACKWARD_ERROR = (
    "sage_diffusers SageBwd (sd.sagebwd, or sd.attention(mode=\"int8\") with gradients) has no double "
    "backward: its backward is quantized and not itself differentiable, so create_graph=True (gradient "
    "penalties, higher-order gradients) would give wrong gradients. Use mode=\"sdpa\" for attention that "
    "needs double backward (inside torch.nn.attention.sdpa_kernel(SDPBackend.MATH): torch's fused SDPA "
    "kernels have no double backward either)."
)


class Impl(enum.Enum):
    """Which implementation computes the quantized forward and backward."""

    REFERENCE = "reference"  # plain torch, any device
    TRITON = "triton"  # the Triton kernels (CUDA, or the CPU interpreter under TRITON_INTERPRET=1)


def _impl_module(impl: Impl):
    if impl is Impl.TRITON:
        from .kernels import sagebwd_triton

        return sagebwd_triton
    return ref


def default_impl(device: torch.device) -> Impl:
    """Triton on CUDA when it imports, the torch reference otherwise."""
    if device.type == "cuda":
        from .kernels import sagebwd_triton

        ok, why = sagebwd_triton.is_available()
        if ok:
            return Impl.TRITON
        _fallback.record(f"sagebwd: Triton kernels unavailable ({why})", ran="the torch reference")
    return Impl.REFERENCE


class SageBwdFunction(torch.autograd.Function):
    """Autograd function over BHSD tensors; see :func:`sagebwd` for the arguments.

    With ``return_lse`` the outputs are (out, lse): lse float32 (B, Hq, Sq), the exact natural-log
    LSE of the scaled scores (float32 scores, as the SDPA path computes it), whose gradient the
    quantized backward takes with the output's (``dlse`` of the backends' ``sagebwd_backward``).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, is_causal: bool, scale: float, dov: DoVPrecision, impl: Impl,
                return_lse: bool = False):
        module = _impl_module(impl)
        state = module.sagebwd_forward(q, k, v, key_mask, is_causal, scale, PVPrecision.INT8)
        ctx.is_causal, ctx.scale, ctx.dov, ctx.impl = is_causal, scale, dov, impl
        ctx.has_mask, ctx.return_lse = key_mask is not None, return_lse
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        extra = (key_mask,) if key_mask is not None else ()
        if not return_lse:
            ctx.save_for_backward(*state, *extra)
            return state.out
        from . import api

        lse = api._lse(q, k, key_mask, None, is_causal, scale)  # (B, Hq, Sq)
        # the LSE's dQ needs the K mean the forward smoothed with (float32 (B, Hkv, D), small)
        k_mean = ref.key_mean(k, key_mask)
        ctx.save_for_backward(*state, k_mean, *extra)
        return state.out, lse

    @staticmethod
    def backward(ctx, do, dlse=None):
        # Grad mode is on in a backward exactly when the caller asked for create_graph=True. The
        # quantized backward is no differentiable function of q, k, v (its saved state is integer
        # codes), so a graph built here would silently miss most of the second derivative.
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        saved = ctx.saved_tensors
        n = len(SageBwdState._fields)
        state = SageBwdState(*saved[:n])
        rest = list(saved[n:])
        k_mean = rest.pop(0) if ctx.return_lse else None
        key_mask = rest.pop(0) if ctx.has_mask else None
        module = _impl_module(ctx.impl)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = module.sagebwd_backward(
            do.contiguous(), state, key_mask, ctx.is_causal, ctx.scale, ctx.dov,
            dlse=dlse.float().contiguous() if ctx.return_lse else None, k_mean=k_mean,
        )
        tq, tk, tv = ctx.dtypes
        return (dq.to(tq) if need_q else None, dk.to(tk) if need_k else None,
                dv.to(tv) if need_v else None, None, None, None, None, None, None)


def _fallback_reason(q: torch.Tensor, d: int, dv: int, general_mask: bool) -> Optional[str]:
    if q.dtype not in _NATIVE_DTYPES:
        return f"dtype {q.dtype} (supported: float16, bfloat16, float32)"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head dim {d} (supported: {SUPPORTED_HEAD_DIMS})"
    if dv != d:
        return f"value head dim {dv} differs from query head dim {d}"
    if general_mask:
        return "attn_mask is not a key-padding mask (only bool (B, Skv) / (B, 1, 1, Skv) run natively)"
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
    impl: "Impl | None" = None,
) -> torch.Tensor:
    """Trainable INT8 attention (SageBwd): quantized forward and backward.

    Parameters
    ----------
    q : (B, Hq, Sq, D) for layout "BHSD", (B, Sq, Hq, D) for "BSHD"; float16, bfloat16 or float32
        (float32 is quantized directly; its 16-bit products run in bfloat16).
    k, v : (B, Hkv, Skv, D) or (B, Skv, Hkv, D); Hq a multiple of Hkv (grouped-query attention).
    attn_mask : as torch SDPA; a key-padding mask ((B, Skv) or (B, 1, 1, Skv): bool, True = attend,
        or float holding only 0 / -inf) runs natively, any other mask runs SDPA (forward and
        backward) with a counted reason, and so does a float mask that requires grad (while grad
        mode is on): SDPA differentiates it, SageBwd has no mask gradient.
    is_causal : query i sees keys j <= i (top-left aligned, as torch SDPA).
    scale : softmax scale, default 1/sqrt(D).
    key_mask : bool (B, Skv), True = attended; combined with a key-padding ``attn_mask`` by AND.
    layout : "BHSD" or "BSHD"; the output uses the same layout.
    dov : precision of the backward's dP = dO.V^T: "fp16" (16-bit operands, the default) or
        "int8" (the paper's ablation, less accurate).
    impl : force an implementation; default Triton on CUDA, the torch reference elsewhere.

    Returns
    -------
    out : like q (dtype and layout); rows with no visible key are 0 and get zero gradients.

    Head dims other than 32/64/128 (and float64, or value head dims that differ) run SDPA's
    forward and backward, counted in :func:`sage_diffusers.fallback_stats` with the reason.

    No double backward: differentiating SageBwd's gradients (``create_graph=True``) raises
    RuntimeError; use ``sage_diffusers.attention(..., mode="sdpa")`` there.
    """
    from . import api  # the shared argument checks; imported here because api routes to this module

    layout = Layout.parse(layout)
    dov = DoVPrecision.parse(dov)
    qh, kh, vh = api._to_bhsd(q, k, v, layout)
    b, hq, sq, d = qh.shape
    skv, dv = kh.shape[2], vh.shape[3]
    scale_f = api._check_scale(scale, d)
    key_mask = api._check_key_mask(key_mask, b, skv, q.device)
    attn_mask = api._check_attn_mask(attn_mask, (b, hq, sq, skv), q.device)
    if api._needs_grad(attn_mask):  # before the key-padding check, which reads the mask on the host
        mask_keys, reason = None, "attn_mask requires grad (SageBwd computes no mask gradient)"
    else:
        mask_keys, native = api._native_key_mask(attn_mask, key_mask, b, skv)
        reason = _fallback_reason(q, d, dv, not native)
    if reason is not None:
        _fallback.record(f"sagebwd: {reason}")
        out, _ = api._sdpa(qh, kh, vh, key_mask, attn_mask, 0.0, bool(is_causal), scale_f, False)
    else:
        impl = default_impl(q.device) if impl is None else impl
        out = SageBwdFunction.apply(qh, kh, vh, mask_keys, bool(is_causal), scale_f, dov, impl)
    out = out.to(q.dtype)
    return out.transpose(1, 2) if layout is Layout.BSHD else out


def attention_sagebwd(q, k, v, *, key_mask=None, is_causal=False, scale=None, return_lse=False):
    """The API's gradient path for ``mode="int8"`` (the kernels' backend contract, BHSD views).

    Returns (out like q, lse float32 (B, Hq, Sq) or None); the lse is exact (float32 scores,
    computed as the SDPA path computes it) and differentiable: its gradient flows to q and k
    through SageBwd's quantized backward, with the output's.
    """
    from . import api

    impl = default_impl(q.device)
    d = q.shape[-1]
    sm_scale = api._check_scale(scale, d)
    args = (q, k, v, key_mask, bool(is_causal), sm_scale, DoVPrecision.FP16, impl)
    if return_lse:
        return SageBwdFunction.apply(*args, True)
    return SageBwdFunction.apply(*args), None
