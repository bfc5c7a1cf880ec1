"""Argument checks of the public entry points (``attention``, ``sagebwd``): what they accept, and
the ``ValueError`` that names what was wrong with anything else. They never copy a tensor."""
from __future__ import annotations

import sys
from typing import Optional

import torch

from .options import Layout


_AUTOCAST_DEVICES = ("cpu", "cuda")  # the devices this package runs on that torch.autocast knows


def autocast_like_sdpa(q, k, v, attn_mask):
    """q, k, v and a float ``attn_mask`` as torch SDPA takes them inside ``torch.autocast``: floating
    tensors other than float64 cast to the autocast dtype of their device (SDPA is one of autocast's
    lower-precision ops), so autocast code that may call SDPA with q, k, v of mixed dtypes (a rotary
    embedding left in float32, say) may call this too. Unchanged outside autocast."""
    if not isinstance(q, torch.Tensor) or q.device.type not in _AUTOCAST_DEVICES:  # meta, fake: no autocast
        return q, k, v, attn_mask
    if not torch.is_autocast_enabled(q.device.type):
        return q, k, v, attn_mask
    dtype = torch.get_autocast_dtype(q.device.type)

    def cast(t):
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return cast(q), cast(k), cast(v), cast(attn_mask)


def to_bhsd(q, k, v, layout: Layout):
    """q, k, v checked against each other and seen as BHSD views (a transpose for "BSHD")."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor ({layout.value.upper()}), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if layout is Layout.BSHD:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must agree on heads and length, got (H, S) {tuple(k.shape[1:3])} vs {tuple(v.shape[1:3])}")
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: expected {d}, got {k.shape[3]}")
    if d == 0:
        raise ValueError("q and k: head dim must be at least 1")
    if (hkv == 0 and hq != 0) or (hkv != 0 and hq % hkv):
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return q, k, v


def check_flag(name: str, value) -> bool:
    """A bool argument, checked as SDPA checks ``is_causal``: a str such as "False" would be truthy."""
    if isinstance(value, bool):
        return value
    numpy = sys.modules.get("numpy")  # numpy.bool_ is a bool too (numpy is not a dependency)
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    raise ValueError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, (bool, torch.Tensor)):
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}")
    try:
        value = float(dropout_p)
    except (TypeError, ValueError):
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {value}")
    return value


def check_key_mask(key_mask, b: int, skv: int, device) -> Optional[torch.Tensor]:
    """None, or the bool (B, Skv) key mask itself (validated, never copied)."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise ValueError(f"key_mask: expected a tensor or None, got {type(key_mask).__name__}")
    if key_mask.dtype != torch.bool:
        raise ValueError(f"key_mask: expected a bool tensor (True = attended), got {key_mask.dtype}")
    if key_mask.device != device:
        raise ValueError(f"key_mask: expected device {device}, got {key_mask.device}")
    if key_mask.dim() != 2 or key_mask.shape[0] not in (1, b) or key_mask.shape[1] != skv:
        raise ValueError(f"key_mask: expected shape (B={b}, Skv={skv}), got {tuple(key_mask.shape)}")
    return key_mask.expand(b, skv)


def check_attn_mask(mask, full: tuple[int, int, int, int], device,
                    dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """Validate an SDPA mask; return it as a 4-D view broadcastable to ``full`` = (B, Hq, Sq, Skv).

    ``dtype``: the query's; a float mask must have it or be float32 (torch SDPA's rule).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attn_mask: expected a tensor or None, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"attn_mask: expected device {device}, got {mask.device}")
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"attn_mask: expected bool or floating dtype, got {mask.dtype}")
    if mask.is_floating_point() and dtype is not None and mask.dtype not in (dtype, torch.float32):
        # torch SDPA's rule; checked here so that the answer does not depend on the path the call takes
        raise ValueError(f"attn_mask: a float mask must be float32 or the query's dtype {dtype}, got {mask.dtype}")
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"attn_mask: expected 1 to 4 dims, got shape {tuple(mask.shape)}")
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)  # SDPA broadcasting: right-aligned
    for got, want in zip(shape4, full):
        if got not in (1, want):
            raise ValueError(
                f"attn_mask: shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Skv) = {full}"
                " (a 2-D mask is (Sq, Skv), as in torch SDPA; pass key padding as key_mask=(B, Skv))"
            )
    return mask.reshape(shape4)


def operand_mismatch(dtype: torch.dtype, d: int, dv: int, dtypes, head_dims) -> Optional[str]:
    """Why a backend serving ``dtypes`` and ``head_dims`` cannot take operands of ``dtype`` with query /
    value head dims ``d`` / ``dv`` (the counted fallback reason), or None."""
    if dtype not in dtypes:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        return f"dtype {dtype} (supported: {names})"
    if d not in head_dims:
        return f"head dim {d} (supported: {head_dims})"
    if dv != d:
        return f"value head dim {dv} differs from query head dim {d}"
    return None
