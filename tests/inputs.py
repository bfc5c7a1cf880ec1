"""Shared test inputs that look like DiT activations and like misuse (imported as a top-level module).

Every generator takes an explicit ``seed`` and its own ``torch.Generator``, so a test's inputs do not
depend on which tests ran before it. Tensors are BHSD float32 on the CPU unless ``device`` / ``dtype``
say otherwise.

What the generators model, and why a test wants it:

- per-channel bias in Q and K: DiT activations carry a large common component per channel (the shift
  SageAttention's smoothing removes). A zero-mean Q hides a missing ``qbar . K^T`` correction, so Q's
  bias is on by default.
- outlier channels: a few channels 10-50x larger than the rest (what per-block scales must absorb).
- magnitudes x1e-4 ... x1e4 (``MAGNITUDES``): what a per-tensor FP4 scale must make harmless.
- garbage / NaN / Inf at masked key positions (``poison_masked``): must never reach the output.
- SDPA-style masks (``sdpa_masks``): every mask form torch SDPA accepts, with its meaning.
- ``requires_grad`` copies and empty sequences (``EMPTY_SHAPES``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

MAGNITUDES = (1e-4, 1e-2, 1.0, 1e2, 1e4)
# (B, Hq, Hkv, Sq, Skv): every way a dimension can be zero.
EMPTY_SHAPES = ((2, 2, 2, 0, 16), (2, 2, 2, 16, 0), (0, 2, 2, 16, 16), (2, 2, 1, 0, 0))


class QKV(NamedTuple):
    """Query, key and value, BHSD: q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def generator(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def dit_qkv(
    b: int,
    hq: int,
    hkv: int,
    sq: int,
    skv: int,
    d: int,
    *,
    seed: int,
    q_bias: float = 1.0,
    k_bias: float = 4.0,
    v_bias: float = 0.5,
    outlier_channels: int = 0,
    outlier_scale: float = 20.0,
    magnitude: float = 1.0,
    grid: Optional[float] = None,
    dtype: torch.dtype = torch.float32,
    device="cpu",
) -> QKV:
    """DiT-like Q, K, V: N(0, 1) plus a per-(head, channel) bias shared by all tokens and batches.

    Parameters
    ----------
    q_bias, k_bias, v_bias : standard deviation of the per-channel bias of Q, K and V. Q's default is
        non-zero on purpose (see the module docstring).
    outlier_channels : how many channels of Q and K (the same ones) are multiplied by ``outlier_scale``.
    magnitude : every tensor is multiplied by it (Q and K by its square root, so the scores scale by
        ``magnitude`` and V by ``magnitude``), to sweep the range a low-bit format must cover.
    grid : round every value to a multiple of ``grid`` (e.g. 2**-8). Sums of such values are exact in
        float32 in any order, so token means agree bit for bit between implementations that sum in
        different orders (what a bit-level comparison of two references needs).

    Returns
    -------
    QKV of BHSD tensors with ``dtype`` on ``device``: q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D).
    """
    g = generator(seed)
    q = torch.randn(b, hq, sq, d, generator=g) + q_bias * torch.randn(1, hq, 1, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g) + k_bias * torch.randn(1, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g) + v_bias * torch.randn(1, hkv, 1, d, generator=g)
    if outlier_channels:
        idx = torch.randperm(d, generator=g)[:outlier_channels]
        gain = torch.ones(d)
        gain[idx] = outlier_scale
        q, k = q * gain / math.sqrt(outlier_scale), k * gain / math.sqrt(outlier_scale)
    root = math.sqrt(magnitude)
    q, k, v = q * root, k * root, v * magnitude
    if grid is not None:
        q, k, v = (torch.round(t / grid) * grid for t in (q, k, v))
    return QKV(*(t.to(device=device, dtype=dtype) for t in (q, k, v)))


def key_padding_mask(b: int, skv: int, *, seed: int, holes: bool = True, empty_row: bool = False,
                     device="cpu") -> torch.Tensor:
    """bool (B, Skv), True = attended: a different padded tail per batch row, plus scattered holes.

    Row 0 always keeps key 0 (so causal row 0 has a key); ``empty_row`` masks every key of the last
    batch row (its output must be 0 and its LSE -inf).
    """
    g = generator(seed)
    m = torch.ones(b, skv, dtype=torch.bool)
    for i in range(b):
        keep = skv - int(torch.randint(0, max(1, skv // 3) + 1, (1,), generator=g))
        m[i, max(1, keep):] = False
        if holes and skv > 8:
            m[i, torch.randint(0, skv, (max(1, skv // 16),), generator=g)] = False
    m[0, 0] = True
    if empty_row:
        m[-1] = False
    return m.to(device)


def poison_masked(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """New K, V (B, Hkv, Skv, D) equal to the inputs on attended keys and ``value`` on masked ones.

    ``value`` may be large finite garbage (1e4), NaN or +-Inf; a correct implementation gives the same
    result as with the clean tensors (within its normal error). The inputs are not modified.
    """
    hidden = ~key_mask[:, None, :, None]  # (B, 1, Skv, 1)
    fill = torch.full((), value, dtype=k.dtype, device=k.device)
    return torch.where(hidden, fill, k), torch.where(hidden, fill.to(v.dtype), v)


def with_requires_grad(t: QKV) -> QKV:
    """Leaf copies of q, k, v with requires_grad=True (the caller's tensors stay as they are)."""
    return QKV(*(x.detach().clone().requires_grad_(True) for x in t))


class SdpaMask(NamedTuple):
    """One attn_mask as torch SDPA reads it, and whether sage_diffusers may run it natively."""

    name: str
    mask: torch.Tensor
    native: bool  # only B and Skv are non-trivial: a key-padding mask, the native path


def sdpa_masks(b: int, hq: int, sq: int, skv: int, *, seed: int, device="cpu") -> list[SdpaMask]:
    """Every mask form torch SDPA accepts, built from one key-padding pattern and one (Sq, Skv) pattern.

    Each keeps at least one key per query row (so SDPA itself is finite and the comparison is fair).
    The 2-D bool mask is (Sq, Skv), SDPA's meaning; with ``b == sq`` reading it as (B, Skv) is wrong.
    """
    g = generator(seed)
    kp = key_padding_mask(b, skv, seed=seed, holes=True).to(device)  # (B, Skv)
    qk = torch.rand(sq, skv, generator=g).to(device) > 0.3  # (Sq, Skv)
    qk[:, 0] = True
    kp_rows = kp.clone()
    kp_rows[:, 0] = True  # key 0 visible everywhere, so the combined masks keep a key per row
    additive = torch.zeros(b, 1, 1, skv, device=device).masked_fill(~kp_rows[:, None, None, :], -math.inf)
    bias = (0.5 * torch.randn(1, hq, sq, skv, generator=g)).to(device)  # a real float bias, no -inf
    return [
        SdpaMask("bool-B11K", kp[:, None, None, :], True),
        SdpaMask("bool-BK-as-4d-with-Sq", kp[:, None, None, :].expand(b, 1, sq, skv), False),
        SdpaMask("bool-QK-2d", qk, False),
        SdpaMask("bool-1HQK", (qk[None, None] & kp_rows[:, None, None, :]).expand(b, hq, sq, skv), False),
        SdpaMask("additive-B11K", additive, False),
        SdpaMask("additive-bias-1HQK", bias, False),
    ]


def causal_mask(sq: int, skv: int, device="cpu") -> torch.Tensor:
    """bool (Sq, Skv), top-left aligned as torch SDPA's is_causal: query i sees keys j <= i."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).tril()


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: Optional[torch.Tensor] = None,
                    attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                    scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention on BHSD inputs, the ground truth: (out (B, Hq, Sq, D), lse (B, Hq, Sq)).

    Masked keys are dropped before any arithmetic (so NaN there cannot leak); rows without a
    visible key give 0 and lse -inf. ``attn_mask`` has torch SDPA's meaning (bool or additive).
    """
    hq, sq, skv, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    g = hq // k.shape[1]
    kd = k.double().repeat_interleave(g, 1)
    vd = v.double().repeat_interleave(g, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    visible = torch.ones(q.shape[0], 1, sq, skv, dtype=torch.bool, device=q.device)
    bias = torch.zeros((), dtype=torch.float64, device=q.device)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
        kd = torch.where(key_mask[:, None, :, None], kd, 0.0)
        vd = torch.where(key_mask[:, None, :, None], vd, 0.0)
    if is_causal:
        visible = visible & causal_mask(sq, skv, q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            bias = attn_mask.double()
            visible = visible & (bias > -math.inf)
    s = (q.double() @ kd.transpose(-1, -2)) * scale + bias  # (B, Hq, Sq, Skv)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)  # (B, Hq, Sq), -inf on empty rows
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ vd, lse
