"""The tiled online-softmax loop that both SageAttention references share.

A kernel quantizes P~ per key tile, relative to the *running* row max, so a faithful reference
has to walk the keys in the same tiles and keep the same running state; only the score and the
P.V products differ between the algorithms, and they come in as callbacks.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_KV = 128

# score_fn(j0, j1) -> float32 (B, H, Sq, j1 - j0): scores of keys j0..j1-1, already in the log2
# domain (multiplied by scale * log2(e)), before masking.
ScoreFn = Callable[[int, int], torch.Tensor]
# pv_fn(j0, j1, p) -> float32 (B, H, Sq, Dv): contribution of those keys given p = exp2(s - m).
PVFn = Callable[[int, int, torch.Tensor], torch.Tensor]


def visible_keys(
    j0: int, j1: int, sq: int, key_mask: Optional[torch.Tensor], is_causal: bool, device
) -> Optional[torch.Tensor]:
    """bool (B or 1, 1, Sq, j1 - j0) of visible keys, or None when every key is visible.

    Causal is top-left aligned as in torch SDPA: query i sees key j iff j <= i.
    """
    vis = None
    if key_mask is not None:
        vis = key_mask[:, None, None, j0:j1]  # (B, 1, 1, n)
    if is_causal:
        i = torch.arange(sq, device=device)[:, None]  # (Sq, 1)
        j = torch.arange(j0, j1, device=device)[None, :]  # (1, n)
        causal = (j <= i)[None, None]  # (1, 1, Sq, n)
        vis = causal if vis is None else vis & causal
    return vis


def online_softmax_attention(
    score_fn: ScoreFn,
    pv_fn: PVFn,
    *,
    shape: tuple[int, int, int, int],
    skv: int,
    key_mask: Optional[torch.Tensor],
    is_causal: bool,
    device: torch.device,
    block_kv: int = BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk the keys in tiles of ``block_kv`` with a running max, as the kernels do.

    Parameters
    ----------
    shape : (B, H, Sq, Dv) of the output.
    key_mask : bool (B, Skv), True = attend, or None.

    Returns
    -------
    acc : float32 (B, H, Sq, Dv), un-normalised sum of P.V.
    l : float32 (B, H, Sq, 1), row sums of the unquantized P~.
    m : float32 (B, H, Sq, 1), final row max in the log2 domain (-inf for rows with no key).
    """
    b, h, sq, dv = shape
    acc = torch.zeros(b, h, sq, dv, dtype=torch.float32, device=device)
    l = torch.zeros(b, h, sq, 1, dtype=torch.float32, device=device)
    m = torch.full((b, h, sq, 1), -math.inf, dtype=torch.float32, device=device)
    for j0 in range(0, skv, block_kv):
        j1 = min(j0 + block_kv, skv)
        s = score_fn(j0, j1)  # (B, H, Sq, n)
        vis = visible_keys(j0, j1, sq, key_mask, is_causal, device)
        if vis is not None:
            s = s.masked_fill(~vis, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (B, H, Sq, 1)
        # Rows that have seen no visible key keep m = -inf; subtract 0 there so exp2 gives 0, not NaN.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - m_safe)  # (B, H, Sq, n), in [0, 1]
        alpha = torch.exp2(m - m_safe)  # (B, H, Sq, 1)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + pv_fn(j0, j1, p)
        m = m_new
    return acc, l, m


def nonfinite_v(
    v: torch.Tensor, key_mask: Optional[torch.Tensor], is_causal: bool, sq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where +-Inf and NaN of V reach the output, and with what value, as in exact attention.

    The quantized P.V cannot carry them (FP8/FP4 have no Inf; the references quantize non-finite
    V entries as 0), so they are added back exactly: output channel c of query row i is +Inf when
    a key that row sees (key mask and causality) has V = +Inf in channel c and none has -Inf or
    NaN there, -Inf likewise, and NaN when both signs or a NaN meet.

    v : (B, H, Skv, D) with masked rows already 0.
    Returns hit bool and value float32, both (B, H, Sq or 1, D).
    """
    seen = []
    for kind in (v == math.inf, v == -math.inf, torch.isnan(v)):  # each (B, H, Skv, D)
        if key_mask is not None:
            kind = kind & key_mask[:, None, :, None]
        if is_causal:  # row i sees keys <= i: the first key of each kind and channel decides
            none = max(sq, v.shape[2])  # beyond every row
            first = torch.where(kind.any(2), kind.to(torch.uint8).argmax(2), none)  # (B, H, D)
            seen.append(torch.arange(sq, device=v.device)[:, None] >= first[:, :, None, :])  # (B, H, Sq, D)
        else:
            seen.append(kind.any(2, keepdim=True))  # (B, H, 1, D)
    pos, neg, nan = seen
    value = torch.where(nan | (pos & neg), math.nan, torch.where(pos, math.inf, -math.inf))
    return pos | neg | nan, value.float()


def finish(
    acc: torch.Tensor,
    l: torch.Tensor,
    m: torch.Tensor,
    lse_shift: Optional[torch.Tensor],
    *,
    bad_q_rows: Optional[torch.Tensor] = None,
    v_nonfinite: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise and build the natural-log LSE.

    acc (B, H, Sq, Dv), l and m (B, H, Sq, 1); lse_shift (B, H, Sq) added to the LSE (the
    scale * q.k_mean term that K smoothing removed), or None.
    bad_q_rows : bool (B, H, Sq, 1), query rows holding NaN/Inf: their output and LSE are NaN
        (as in exact attention) where the row sees a key; the quantizers kept them from touching
        any other row.
    v_nonfinite : (hit, value) from :func:`nonfinite_v`, written over the output where hit.
    Returns out float32 (B, H, Sq, Dv) (0 on rows with no visible key) and lse float32 (B, H, Sq).
    """
    empty = l == 0  # (B, H, Sq, 1)
    out = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, torch.ones_like(l), l))
    lse = (m * LN2 + torch.log(l)).squeeze(-1)  # (B, H, Sq); -inf on empty rows
    if lse_shift is not None:
        lse = lse + lse_shift
    if v_nonfinite is not None:
        hit, value = v_nonfinite
        out = torch.where(hit, value, out)
    if bad_q_rows is not None:
        bad = bad_q_rows & ~empty
        out = torch.where(bad, math.nan, out)
        lse = torch.where(bad.squeeze(-1), math.nan, lse)
    lse = torch.where(empty.squeeze(-1), torch.full_like(lse, -math.inf), lse)
    return out, lse
