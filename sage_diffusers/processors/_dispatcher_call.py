"""One attention call in diffusers' backend convention: the dispatcher's mask split into a key-padding mask.

Shared by the dispatcher backend (``backend``), which may hand the call to context parallelism, and by
context parallelism's local step (``context_parallel.sage_forward_op``): it sits below both, so neither
imports the other to reach it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sage_diffusers._masks import classify_in_scope
from sage_diffusers.options import Int8Precision, Layout
from sage_diffusers.processors._core import Choice, attend


def _factorize_mask(
    attn_mask: torch.Tensor | None, batch: int, heads: int, q_len: int, kv_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Split a dispatcher mask into (key_mask (B, Skv), row_keep (B, Sq, H|1, 1), other_mask), unused ones None.

    Key-padding structure (see ``backend``'s module docstring) becomes ``key_mask`` plus, when some query rows see no key,
    ``row_keep`` (those rows are zeroed afterwards). Additive float masks and bool masks of any other structure are
    returned as ``other_mask``, unchanged but for a (B, Skv) float mask, which becomes (B, 1, 1, Skv) as in
    diffusers' native backend.
    """
    if attn_mask is None:
        return None, None, None
    if attn_mask.dtype != torch.bool:
        if attn_mask.ndim == 2 and attn_mask.shape == (batch, kv_len):
            # diffusers' native backend reads a (B, Skv) mask of any dtype as per-sample key padding, not
            # SDPA's (Sq, Skv); the API tells an additive one of 0 and -inf apart from a bias (mask_scope).
            return None, None, attn_mask[:, None, None, :]
        return None, None, attn_mask
    if attn_mask.ndim not in (2, 4):
        return None, None, attn_mask
    if attn_mask.ndim == 2:
        if attn_mask.shape[0] in (1, batch) and attn_mask.shape[1] == kv_len:
            return attn_mask.expand(batch, kv_len), None, None
        return None, None, attn_mask
    mb, mh, mq, mk = attn_mask.shape
    if mb not in (1, batch) or mh not in (1, heads) or mq not in (1, q_len) or mk != kv_len:
        return None, None, attn_mask  # let the API report the shape error
    if mh == 1 and mq == 1:
        return attn_mask[:, 0, 0, :].expand(batch, kv_len), None, None
    if torch.compiler.is_compiling():
        keys, rows, exact = _outer_factors(attn_mask)
        torch._assert_async(exact.all(), "sage_diffusers: attn_mask is not a key-padding mask (outer product)")
    else:
        # The check reads the mask on the host (a sync): once per mask tensor, not once per block.
        factors = classify_in_scope(attn_mask, _outer_product_of)
        if factors is None:
            return None, None, attn_mask
        keys, rows = factors
    if mq == 1:
        # No query structure ((B, H, 1, Skv), e.g. LTX-Video's per-head copies): only a head can see no key.
        # A sample none of whose heads sees one of these keys is left to the key mask, which gives it 0 if no
        # key is visible anywhere; under context parallelism these are one rank's keys, the others may hold some.
        rows = rows | ~keys.any(dim=-1)[:, None, None]
    row_keep = rows.transpose(1, 2)[..., None]  # (B, Sq, H, 1) like the BSHD output
    return keys.expand(batch, kv_len), row_keep, None


def _outer_factors(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bool (B|1, H|1, Sq, Skv) -> (keys (B|1, Skv) any row sees, rows (B|1, H|1, Sq) that see a key,
    exact: where ``mask`` equals their outer product)."""
    keys = mask.any(dim=2).any(dim=1)
    rows = mask.any(dim=-1)
    return keys, rows, mask == (rows[..., None] & keys[:, None, None, :])


def _outer_product_of(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, rows) of :func:`_outer_factors` when ``mask`` is exactly their outer product, else None."""
    keys, rows, exact = _outer_factors(mask)
    return (keys, rows) if bool(exact.all()) else None


def dispatcher_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
    *,
    mode: Choice,
    run: Callable[..., Any] | None = None,
    int8_precision: Int8Precision | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One attention call in diffusers' backend convention, on this rank's tensors or through ``run``.

    Parameters
    ----------
    query, key, value : torch.Tensor
        (B, Sq, Hq, D) and (B, Skv, Hkv, D).
    attn_mask : torch.Tensor or None
        The dispatcher's mask: key-padding structure runs natively (``backend``'s module docstring),
        any other mask goes to ``sage_diffusers.attention`` as ``attn_mask``.
    dropout_p, is_causal, scale, enable_gqa, return_lse
        As ``sage_attention_backend``.
    mode : Mode or PolicyChoice
        Precision mode of the call.
    run : callable or None
        ``run(query, key, value, *, mode, key_mask, is_causal, scale, return_lse, int8_precision[, attn_mask])``
        computes the attention over the keys (context parallelism passes its ring / Ulysses function); None:
        :func:`~sage_diffusers.processors._core.attend` on the local tensors.
    int8_precision : Int8Precision or None
        ``sage_diffusers.attention``'s ``int8_precision`` (None: the process default).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        Output (B, Sq, Hq, D), and the lse (B, Sq, Hq) when asked.
    """
    if dropout_p != 0.0:
        raise ValueError(f"sage_diffusers attention has no dropout; got dropout_p={dropout_p}")
    if query.shape[2] != key.shape[2] and not enable_gqa:
        # Same contract as torch SDPA: differing head counts are an error unless GQA was asked for.
        raise ValueError(
            f"query has {query.shape[2]} heads and key {key.shape[2]}; pass enable_gqa=True for grouped-query attention"
        )
    b, sq, hq, _ = query.shape
    key_mask, row_keep, other = _factorize_mask(attn_mask, b, hq, sq, key.shape[1])
    extra: dict[str, Any] = dict(is_causal=is_causal, scale=scale, return_lse=return_lse, int8_precision=int8_precision)
    if other is not None:
        extra["attn_mask"] = other  # not key padding: the API runs it through SDPA and counts why
    if run is not None:
        result = run(query, key, value, mode=mode, key_mask=key_mask, **extra)
    else:
        result = attend(query, key, value, mode=mode, layout=Layout.BSHD, key_mask=key_mask, **extra)
    out, lse = result if return_lse else (result, None)
    if row_keep is not None:
        out = torch.where(row_keep, out, torch.zeros((), dtype=out.dtype, device=out.device))
    if lse is None:
        return out
    # The API gives lse as (B, H, S); diffusers' backends return (B, S, H) next to a (B, S, H, D) output.
    lse = lse.transpose(1, 2)
    if row_keep is not None:
        lse = torch.where(row_keep[..., 0], lse, torch.full((), float("-inf"), device=lse.device))
    return out, lse.contiguous()
