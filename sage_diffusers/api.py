"""The public attention entry points: :func:`attention` and :func:`mask_scope`.

Everything a user reaches (processors, the ComfyUI node, the demo) calls :func:`attention`. It
validates its arguments (``_validate``) and runs the backend that ``_dispatch`` picks from the
registry of ``sage_diffusers.backends`` (where the one backend contract is written down).

Masks
-----
``attn_mask`` means exactly what it means to torch SDPA. The low-bit paths take one kind of mask,
a bool key-padding mask (B, Skv); :func:`attention` derives it from the arguments where it can
without reading mask values (no host sync):

- ``key_mask`` (B, Skv) is that mask already;
- a bool ``attn_mask`` whose only non-trivial dims are batch and keys ((B, 1, 1, Skv), (Skv,), ...)
  is one, viewed as (B, Skv);
- any other ``attn_mask`` (a float one, or (B, 1, Sq, Skv) from Chroma, say) may still be key
  padding in disguise, but telling needs its values on the host. That check runs only inside a
  :func:`mask_scope` (the integrations open one per model forward, when the model builds its
  masks), once per mask tensor per scope: no cache outlives the scope, so no answer can go stale
  (masks edited in place between forwards, through ``.data`` or NumPy, inference tensors). Outside
  a scope such masks run through SDPA, counted.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _dispatch
from ._masks import mask_scope
from ._shared import check_scale, to_output_dtype
from ._validate import autocast_like_sdpa, check_attn_mask, check_dropout, check_flag, check_key_mask, to_bhsd
from .options import Int8Precision, Layout, Mode

__all__ = ["attention", "mask_scope"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    key_mask: Optional[torch.Tensor] = None,
    layout: "str | Layout" = "BHSD",
    mode: "str | Mode" = "auto",
    return_lse: bool = False,
    int8_precision: "str | Int8Precision | None" = None,
):
    """Scaled dot-product attention with SageAttention's low-bit algorithms.

    The positional arguments are those of ``torch.nn.functional.scaled_dot_product_attention``
    and mean the same.

    Parameters
    ----------
    q : (B, Hq, Sq, D) for layout "BHSD", (B, Sq, Hq, D) for "BSHD"; float16, bfloat16 or float32.
    k, v : (B, Hkv, Skv, D) or (B, Skv, Hkv, D); Hq must be a multiple of Hkv (grouped-query
        attention is always accepted).
    attn_mask : None, or torch SDPA's mask: bool (True = attend) or additive float, broadcastable
        to (B, Hq, Sq, Skv); a 2-D mask is (Sq, Skv). Masks whose only non-trivial dims are B and
        Skv (bool, or float holding only 0 / -inf) run natively, and so does a larger one whose
        query rows are all equal (checked once per mask tensor, see the module docstring); any
        other mask runs through SDPA with a counted fallback reason.
    dropout_p : dropout on the attention weights, as SDPA; > 0 runs SDPA (counted, "dropout").
    is_causal : query i sees keys j <= i (top-left aligned, as torch SDPA).
    scale : softmax scale, default 1/sqrt(D); a finite float (zero and negative are computed
        exactly as SDPA would: the sign is folded into q on the low-bit paths). bool is refused.
    enable_gqa : accepted for SDPA compatibility; Hq != Hkv works either way.
    key_mask : bool (B, Skv), True = attended: the native key-padding mask. May be combined with
        ``attn_mask`` (a key is visible when both allow it).
    layout : "BHSD" or "BSHD"; the output uses the same layout.
    mode : "auto" (8-bit kernel on sm_90, FP4 on sm_120, SDPA elsewhere), "int8", "fp4" (the
        kernel where one exists for the device, else the torch reference of the same algorithm),
        or "sdpa".
    return_lse : also return the natural-log log-sum-exp of the scaled scores, float32 (B, Hq, Sq).
    int8_precision : the 8-bit algorithm's P~.V product, wherever it runs (``mode="int8"``, or
        ``"auto"`` choosing it): "fast" (FP8, SageAttention2's) or "accurate" (the 16-bit input
        dtype: about a third of the error against exact attention, 0-20 % more time per call on
        an H100; ``"auto"`` decides with this policy's timings). None:
        ``SAGE_DIFFUSERS_INT8_PRECISION`` (read at import; default "fast").
        :class:`~sage_diffusers.options.Int8Precision`. Training calls (SageBwd) ignore it.

    Returns
    -------
    out : like q (same dtype and layout); rows with no visible key are 0.
    lse : float32 (B, Hq, Sq), only with ``return_lse``; -inf on rows with no visible key.

    Notes
    -----
    - When autograd will need gradients (grad mode on and an input requires grad), mode "int8"
      runs SageBwd (:func:`sage_diffusers.sagebwd`: INT8 forward and backward, Triton on CUDA,
      the torch reference elsewhere); "fp4" and "auto" run SDPA, counted with reason "backward".
    - float32 inputs of the low-bit modes are rounded to bfloat16 first (kernels and references
      alike); the output is float32 again.
    - Inside ``torch.autocast`` the inputs (and a float mask) are cast to its dtype first, as
      torch SDPA's are: the output has that dtype.
    - Masked keys never influence the result, whatever their values (NaN and Inf included), on
      every path; a non-finite value in one query row affects that row only.
    - Empty inputs (B, Sq or Skv = 0) give empty outputs, or zeros with lse -inf when Skv = 0.

    Unsupported input (head dim other than 64/128, float64, another mask kind, no kernel for
    "auto") falls back to SDPA, logged once per reason and counted in
    :func:`sage_diffusers.fallback_stats`; malformed input raises ``ValueError``.
    """
    layout = Layout.parse(layout)
    mode = Mode.parse(mode)
    precision = _dispatch.DEFAULT_INT8_PRECISION if int8_precision is None else Int8Precision.parse(int8_precision)
    q, k, v, attn_mask = autocast_like_sdpa(q, k, v, attn_mask)
    qh, kh, vh = to_bhsd(q, k, v, layout)
    b, hq, sq, d = qh.shape
    skv = kh.shape[2]
    scale_f = check_scale(scale, d)
    dropout = check_dropout(dropout_p)
    is_causal = check_flag("is_causal", is_causal)
    check_flag("return_lse", return_lse)
    check_flag("enable_gqa", enable_gqa)
    key_mask = check_key_mask(key_mask, b, skv, q.device)
    attn_mask = check_attn_mask(attn_mask, (b, hq, sq, skv), q.device, q.dtype)

    if b == 0 or hq == 0 or sq == 0 or skv == 0:
        out, lse = _dispatch.empty_result(qh, kh, vh, return_lse)
    else:
        plan, native_mask = _dispatch.plan(mode, qh, kh, vh, attn_mask, key_mask, dropout, is_causal, precision)
        out, lse = _dispatch.run(plan, qh, kh, vh, native_mask=native_mask, key_mask=key_mask, attn_mask=attn_mask,
                                 dropout=dropout, is_causal=bool(is_causal), scale=scale_f, return_lse=return_lse,
                                 precision=precision)
    out = to_output_dtype(out, q.dtype)
    if layout is Layout.BSHD:
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


_dispatch.timed_attention = attention  # what a first-use auto calibration times
