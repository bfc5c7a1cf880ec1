"""SageBwd's autograd function and the API's gradient path for ``mode="int8"``.

:func:`attention_sagebwd` is the registry's trainable backend (``sage_diffusers.backends``), which
the dispatcher runs for calls that need gradients. Below the registry, the dispatcher and
:mod:`sage_diffusers.sagebwd` (the public entry point): this module imports none of them.
"""
from __future__ import annotations

import enum
import math

import torch

from . import _fallback, _sagebwd_ops, config
from ._shared import check_scale, exact_lse
from .reference import sagebwd as ref
from .reference._common import nonfinite_rows
from .reference.online_softmax import nonfinite_v
from .reference.sagebwd import DoVPrecision, SageBwdState, ScorePrecision

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
    """The implementation's passes, as torch ops (opaque to torch.compile)."""
    if impl is Impl.TRITON:
        from .kernels import sagebwd_triton

        return sagebwd_triton
    return _sagebwd_ops.REFERENCE


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
    """Autograd function over BHSD tensors; see :func:`sagebwd` for the arguments. ``scores``
    (:class:`ScorePrecision`) picks the scores' precision and with it the forward's P~.V
    (:attr:`ScorePrecision.pv`).

    With ``return_lse`` the outputs are (out, lse): lse float32 (B, Hq, Sq), the exact natural-log
    LSE of the scaled scores (float32 scores, as the SDPA path computes it), whose gradient the
    quantized backward takes with the output's (``dlse`` of the backends' ``sagebwd_backward``).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, is_causal: bool, scale: float, dov: DoVPrecision, impl: Impl,
                return_lse: bool = False, scores: ScorePrecision = ScorePrecision.INT8):
        module = _impl_module(impl)
        state = module.sagebwd_forward(q, k, v, key_mask, is_causal, scale, scores.pv, scores)
        ctx.is_causal, ctx.scale, ctx.dov, ctx.impl, ctx.scores = is_causal, scale, dov, impl, scores
        ctx.has_mask, ctx.return_lse = key_mask is not None, return_lse
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        extra = (key_mask,) if key_mask is not None else ()
        if not return_lse:
            ctx.save_for_backward(*state, *extra)
            return state.out
        lse = exact_lse(q, k, key_mask, None, is_causal, scale)  # (B, Hq, Sq)
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
            dlse=dlse.float().contiguous() if ctx.return_lse else None, k_mean=k_mean, scores=ctx.scores,
        )
        tq, tk, tv = ctx.dtypes
        return (dq.to(tq) if need_q else None, dk.to(tk) if need_k else None,
                dv.to(tv) if need_v else None, None, None, None, None, None, None, None)


def apply_sagebwd(q, k, v, key_mask, is_causal: bool, scale: float, dov: DoVPrecision, impl: Impl,
                  return_lse: bool, scores: ScorePrecision):
    """:class:`SageBwdFunction` on V with its NaN / Inf entries as 0, put back afterwards into the
    output rows that see their keys with exact attention's values (``nonfinite_v``: +-Inf, or NaN
    where both signs or a NaN meet), as the inference paths do. Inside the function a key hidden from
    a row, by causality or the mask, cannot reach that row as 0 * NaN, in the forward or in the
    backward's dO.V^T; the put-back values are constants to autograd.

    Query rows holding NaN / Inf run as rows of zeros, and their output (and LSE) is NaN where they
    see a key, as in exact attention and the inference paths: inside the function their NaN would
    reach the other rows of their dS tiles through the tile's INT8 scale (their dQ), and INT8 scores
    would quantize it to 0 (a finite output row).

    Returns out, or (out, lse) with ``return_lse``.
    """
    bad_q = nonfinite_rows(q)  # (B, Hq, Sq, 1)
    q0 = torch.where(bad_q, 0.0, q)  # Python scalars: no device tensor to create per call
    v0 = torch.where(torch.isfinite(v), v, 0.0)

    def run(q, k, v, key_mask):  # -> (out, lse or None)
        result = SageBwdFunction.apply(q, k, v, key_mask, is_causal, scale, dov, impl, return_lse, scores)
        return result if return_lse else (result, None)

    if impl is Impl.TRITON:  # the Triton kernels' launch limits (grid, int32 offsets): a larger call runs in pieces
        triton_module = _impl_module(impl)
        out, lse = triton_module.run_in_chunks(run, triton_module.launch_chunks(q, k), q0, k, v0, key_mask, return_lse)
    else:
        out, lse = run(q0, k, v0, key_mask)
    hit, value = nonfinite_v(v, key_mask, is_causal, q.shape[2])  # (B, Hkv, Sq or 1, D); skips masked keys
    g = q.shape[1] // v.shape[1]
    if g > 1:  # query head h reads KV head h // g
        hit, value = hit.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    out = torch.where(hit, value.to(out.dtype), out)
    if key_mask is not None or k.shape[2] == 0:  # else every row sees a key (causal: key 0 at least)
        bad_q = bad_q & rows_with_a_key(key_mask, is_causal, q.shape[2], k.shape[2], q.device)  # rows without one stay 0
    out = torch.where(bad_q, math.nan, out)
    if lse is not None:
        lse = torch.where(bad_q.squeeze(-1), math.nan, lse)
    return (out, lse) if return_lse else out


def rows_with_a_key(key_mask, is_causal: bool, sq: int, skv: int, device) -> torch.Tensor:
    """bool (B or 1, 1, Sq, 1): the query rows that see at least one key (key_mask bool (B, Skv) or
    None; causal top-left aligned: row i sees the keys j <= i), without an Sq x Skv mask."""
    keys = torch.ones((1, skv), dtype=torch.bool, device=device) if key_mask is None else key_mask  # (B|1, Skv)
    if not is_causal:
        return keys.any(-1)[:, None, None, None]
    first = torch.where(keys.any(-1), keys.to(torch.uint8).argmax(-1), sq)  # (B|1,): the first visible key
    return (torch.arange(sq, device=device) >= first[:, None])[:, None, :, None]


def default_scores() -> ScorePrecision:
    """The scores' precision when the caller names none: ``SAGE_DIFFUSERS_SAGEBWD_SCORES`` (read at
    each call), FP16 when unset: 16-bit scores keep sharp heads' gradients accurate and measured as
    fast as INT8 ones with these kernels (docs/sagebwd.md)."""
    return ScorePrecision.parse(config.sagebwd_scores())


def attention_sagebwd(q, k, v, *, key_mask=None, is_causal=False, scale=None, return_lse=False):
    """The API's gradient path for ``mode="int8"`` (the kernels' backend contract, BHSD views);
    the scores' precision is :func:`default_scores` (16-bit unless ``SAGE_DIFFUSERS_SAGEBWD_SCORES``
    says otherwise).

    Returns (out like q, lse float32 (B, Hq, Sq) or None); the lse is exact (float32 scores,
    computed as the SDPA path computes it) and differentiable: its gradient flows to q and k
    through SageBwd's quantized backward, with the output's.
    """
    impl = default_impl(q.device)
    d = q.shape[-1]
    sm_scale = check_scale(scale, d)
    args = (q, k, v, key_mask, bool(is_causal), sm_scale, DoVPrecision.FP16, impl)
    scores = default_scores()
    if return_lse:
        return apply_sagebwd(*args, True, scores)
    return apply_sagebwd(*args, False, scores), None
