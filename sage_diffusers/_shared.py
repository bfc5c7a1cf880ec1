"""The API's exact (SDPA) path and the pieces of it that SageBwd uses too: the scale check, query
chunks with their masks, the exact log-sum-exp, and :func:`sdpa` itself (the SDPA backend).

They sit below the dispatcher, the backend registry and the SageBwd autograd function so that none
of them imports another for these (the dispatcher routes gradient calls to SageBwd; SageBwd needs
the same scale rule and the same LSE; ``sage_diffusers.sagebwd`` falls back to the same SDPA path).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .reference._common import to_output_dtype  # noqa: F401 - re-exported: the API's casts

# Score elements per query chunk wherever the SDPA path works chunk by chunk (LSE, causal with a
# mask): 2**24 float32 scores = 64 MiB, whatever the sequence length.
CHUNK_ELEMENTS = 1 << 24


def check_scale(scale, d: int) -> float:
    """The softmax scale of a call: ``scale`` as a finite float, or 1/sqrt(d) when None.

    Raises
    ------
    ValueError
        A tensor, a bool, or a value that is not a finite float.
    """
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, torch.Tensor):
        raise ValueError("scale: expected a Python float, got a tensor")
    if isinstance(scale, bool):  # float(True) == 1.0 would pass silently
        raise ValueError(f"scale: expected a finite float, got the bool {scale}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale: expected a finite float, got {scale!r}") from None
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) the default 1/sqrt(D) that the
    # dispatcher hands on to SageBwd is a SymFloat, which math.isfinite cannot trace (graph break)
    if not -math.inf < value < math.inf:
        raise ValueError(f"scale: expected a finite float, got {value}")
    return value


def query_chunks(sq: int, skv: int, per_row: int, is_causal: bool):
    """Yield (i0, i1, kend): query rows i0..i1-1 and the keys 0..kend-1 they can see.

    ``per_row`` is the number of score elements one query row costs per key; chunks hold about
    ``CHUNK_ELEMENTS`` scores. Causal rows i < i1 see no key beyond i1 - 1 (top-left aligned).
    """
    step = max(1, CHUNK_ELEMENTS // max(1, per_row * skv))
    for i0 in range(0, sq, step):
        i1 = min(i0 + step, sq)
        yield i0, i1, (min(i1, skv) if is_causal else skv)


def chunk_mask(key_mask, attn_mask, is_causal: bool, i0: int, i1: int, kend: int, device):
    """The SDPA mask of query rows i0..i1-1 and keys 0..kend-1, or None: bool (True = attend), or
    additive float when ``attn_mask`` is float. Shape broadcastable to (B, Hq, i1 - i0, kend)."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask[..., :kend] if attn_mask.shape[2] == 1 else attn_mask[:, :, i0:i1, :kend]
    bool_parts = []
    if key_mask is not None:
        bool_parts.append(key_mask[:, None, None, :kend])  # (B, 1, 1, kend)
    if is_causal:
        rows = torch.arange(i0, i1, device=device)[:, None]
        cols = torch.arange(kend, device=device)[None, :]
        bool_parts.append(cols <= rows)  # (n, kend)
    for part in bool_parts:
        if mask is None:
            mask = part
        elif mask.dtype == torch.bool:
            mask = mask & part
        else:
            mask = mask.masked_fill(~part, -math.inf)
    return mask


def exact_lse(q, k, key_mask, attn_mask, is_causal: bool, scale: float) -> torch.Tensor:
    """Exact float32 log-sum-exp of the masked scores: (B, Hq, Sq).

    Query chunks of about ``CHUNK_ELEMENTS`` scores; grouped-query heads are handled by viewing
    q as (B, Hkv, g * n, D) per chunk, so K is never repeated per query head.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    kf = k.float()  # (B, Hkv, Skv, D)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for i0, i1, kend in query_chunks(sq, skv, b * hq, is_causal):
        n = i1 - i0
        qc = q[:, :, i0:i1].float().reshape(b, hkv, g * n, d)  # (B, Hkv, g*n, D): head h = kv head h // g
        s = (qc @ kf[:, :, :kend].transpose(-1, -2)).reshape(b, hq, n, kend) * scale  # (B, Hq, n, kend)
        mask = chunk_mask(key_mask, attn_mask, is_causal, i0, i1, kend, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.float()
        lse[:, :, i0:i1] = torch.logsumexp(s, dim=-1)
    return lse


def new_output(q: torch.Tensor, dv: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialized (B, Hq, Sq, dv) output (``dtype``, default q's) in the memory layout that
    torch SDPA gives its output for ``q``.

    torch SDPA's fused CPU and GPU kernels return ``torch.empty_like(q)``'s layout: a query in BSHD
    memory (``x.transpose(1, 2)`` of a (B, S, H, D) tensor, a packed-QKV view) gives an output in BSHD
    memory, which a BSHD caller can ``.view(B, S, H * D)``. With a value head dim that differs from the
    query's, torch runs its math path, whose output is contiguous (B, Hq, Sq, dv).
    """
    dtype = q.dtype if dtype is None else dtype
    if dv == q.shape[3]:
        return torch.empty_like(q, dtype=dtype)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], dv), dtype=dtype)


def in_output_layout(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` (B, Hq, Sq, dv), computed for ``q``, in :func:`new_output`'s memory layout: itself where
    it has it already (SDPA's own output, the kernels' ``empty_like(q)`` outputs), else a copy (the torch
    references and SageBwd compute contiguous (B, Hq, Sq, D), which a BSHD caller got as a view that
    ``.view(B, S, H * D)`` refused)."""
    if out.shape[3] != q.shape[3] or _same_layout(out, q):  # dense q: no allocation to tell
        return out
    like = new_output(q, out.shape[3], out.dtype)
    return out if _same_layout(out, like) else like.copy_(out)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (one shape) lie in memory alike: equal strides wherever a dim holds more than one element."""
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _where_in_layout(cond: torch.Tensor, out: torch.Tensor, value: float) -> torch.Tensor:
    """``torch.where(cond, out, value)`` in out's memory layout, BHSD or BSHD (SDPA's output for q).

    cond: bool (B|1, Hq|1, Sq, 1). where() lays its result out after its operands, the condition's
    (the mask's) layout first, and made a BSHD output BHSD.
    """
    if out.shape[1] > 1 and out.shape[2] > 1 and out.stride(1) < out.stride(2):  # BSHD memory
        return torch.where(cond.transpose(1, 2).contiguous(), out.transpose(1, 2), value).transpose(1, 2)
    return torch.where(cond, out, value)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > -math.inf


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: Optional[torch.Tensor], is_causal: bool,
         scale: float, return_lse: bool, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0):
    """torch SDPA on BHSD views (the backend contract of ``sage_diffusers.backends``, plus SDPA's
    ``attn_mask`` and ``dropout_p``), and what SDPA itself does not promise.

    Parameters
    ----------
    q : (B, Hq, Sq, D); k, v : (B, Hkv, Skv, D), any floating dtype, Hq % Hkv == 0.
    key_mask : None or bool (B, Skv), True = attended.
    is_causal : query i sees keys j <= i (top-left aligned).
    scale : any finite float.
    return_lse : also return the exact float32 (B, Hq, Sq) log-sum-exp.
    attn_mask : None, or SDPA's bool / additive float mask as a 4-D view broadcastable to
        (B, Hq, Sq, Skv).
    dropout_p : SDPA's dropout on the attention weights.

    Returns
    -------
    (out like q, lse or None).

    - Keys that no query may see (masked for every row) get zero K and V rows first, so that
      NaN/Inf there cannot leak (SDPA's math path computes 0 * NaN).
    - Where an ``attn_mask`` varies over the query rows, every NaN/Inf of K and V is zeroed too, so it
      cannot reach the rows whose mask hides its key, and each row that sees a key holding one is
      NaN (:func:`_nonfinite_seen`). The mask is already Sq x Skv there, so these passes over K and V
      cost little. Keys hidden by causality alone keep torch SDPA's behaviour: the same passes would
      slow every causal SDPA call (``auto`` makes many) for the sake of inputs that hold NaN.
    - Rows that see no key are 0 (some SDPA backends give NaN there).
    - A causal call never builds an Sq x Skv mask: without other masks SDPA gets ``is_causal``;
      with them, queries go in chunks, each with its own small mask and only the keys it sees.
    """
    b, hq, sq, _ = q.shape
    skv = k.shape[2]
    # A branch, not `hq != k.shape[1]`: under torch.compile(dynamic=True) that is a SymBool, which SDPA refuses
    gqa = True if hq != k.shape[1] else False  # noqa: SIM210
    if key_mask is not None or attn_mask is not None:
        seen = key_mask if key_mask is not None else torch.ones((), dtype=torch.bool, device=q.device)
        if attn_mask is not None:
            seen = seen & _visible(attn_mask).any(dim=(1, 2))  # (B|1, Skv): keys some row may see
        keep = seen[:, None, :, None]  # (B|1, 1, Skv, 1)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k, v = torch.where(keep, k, zero), torch.where(keep, v, zero)
    per_row = attn_mask is not None and attn_mask.shape[2] != 1
    if per_row:
        finite_k, finite_v = torch.isfinite(k), torch.isfinite(v)
        bad_k, bad_v = ~finite_k.all(-1), ~finite_v.all(-1)  # (B, Hkv, Skv)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k, v = torch.where(finite_k, k, zero), torch.where(finite_v, v, zero)

    if key_mask is None and attn_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                             enable_gqa=gqa)
    elif not is_causal:
        mask = chunk_mask(key_mask, attn_mask, False, 0, sq, skv, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=gqa)
        out = _where_in_layout(_visible(mask).any(-1, keepdim=True), out, 0.0)
    else:
        out = new_output(q, v.shape[3])
        for i0, i1, kend in query_chunks(sq, skv, b * hq, True):
            mask = chunk_mask(key_mask, attn_mask, True, i0, i1, kend, q.device)
            part = F.scaled_dot_product_attention(q[:, :, i0:i1], k[:, :, :kend], v[:, :, :kend], attn_mask=mask,
                                                  dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
            out[:, :, i0:i1] = torch.where(_visible(mask).any(-1, keepdim=True), part,
                                           torch.zeros((), dtype=part.dtype, device=part.device))
    lse = exact_lse(q, k, key_mask, attn_mask, is_causal, scale) if return_lse else None
    if per_row:
        out, lse = _nonfinite_seen(out, lse, bad_k, bad_v, key_mask, attn_mask, is_causal)
    return out, lse


def _nonfinite_seen(out, lse, bad_k, bad_v, key_mask, attn_mask, is_causal: bool):
    """NaN in the rows that see a key whose K or V :func:`sdpa` zeroed for holding a NaN/Inf.

    out (B, Hq, Sq, D) and lse (B, Hq, Sq) or None, computed with those values zeroed; bad_k, bad_v
    bool (B, Hkv, Skv). A non-finite K makes SDPA's row NaN (unless its score is -Inf); a non-finite V
    would give +-Inf in its channels: both become a NaN row. lse: NaN where a K is. Query head h reads
    KV head h // g. No host sync; the masks go by query chunks as in :func:`sdpa`.
    """
    b, hq, sq, d = out.shape
    hkv, skv = bad_k.shape[1], bad_k.shape[2]
    g = hq // hkv
    sees_k = torch.zeros(b, hkv, g, sq, dtype=torch.bool, device=out.device)
    sees_any = torch.zeros_like(sees_k)
    bad_any = bad_k | bad_v
    for i0, i1, kend in query_chunks(sq, skv, b * hq, is_causal):
        vis = _visible(chunk_mask(key_mask, attn_mask, is_causal, i0, i1, kend, out.device))
        vis = vis.expand(b, hq, i1 - i0, kend).reshape(b, hkv, g, i1 - i0, kend)
        sees_k[..., i0:i1] = (vis & bad_k[:, :, None, None, :kend]).any(-1)
        sees_any[..., i0:i1] = (vis & bad_any[:, :, None, None, :kend]).any(-1)
    out = _where_in_layout(~sees_any.reshape(b, hq, sq, 1), out, math.nan)
    if lse is not None:
        lse = torch.where(sees_k.reshape(b, hq, sq), math.nan, lse)
    return out, lse
