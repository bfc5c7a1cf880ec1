"""The one attention entry point: validation, dispatch, fallbacks.

Everything a user reaches (processors, the ComfyUI node, the demo) calls :func:`attention`; the
kernels behind it all follow one backend contract, see ``sage_diffusers/kernels``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _fallback
from .options import Layout, Mode
from .reference import sage3_reference, sage8_reference

SUPPORTED_HEAD_DIMS = (64, 128)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LSE_CHUNK_ELEMENTS = 1 << 26  # score elements per chunk when SDPA's LSE is computed by hand

# fn(q, k, v, *, key_mask, is_causal, scale, return_lse) -> (out, lse | None), BHSD views.
Backend = Callable[..., tuple]


class Plan(NamedTuple):
    """Which implementation runs a call, and why when it is not the one asked for."""

    path: str  # "sdpa", "reference" or "kernel"
    mode: Mode  # the algorithm actually computed (SDPA for the fallback)
    backend: Optional[Backend] = None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    layout: "str | Layout" = "BHSD",
    mode: "str | Mode" = "auto",
    return_lse: bool = False,
):
    """Scaled dot-product attention with SageAttention's low-bit algorithms.

    Parameters
    ----------
    q : (B, Hq, Sq, D) for layout "BHSD", (B, Sq, Hq, D) for "BSHD"; float16, bfloat16 or float32.
    k, v : (B, Hkv, Skv, D) or (B, Skv, Hkv, D); Hq must be a multiple of Hkv (grouped-query).
    attn_mask : None; a bool key-padding mask (B, Skv) or broadcastable (B, 1, 1, Skv), True =
        attend (runs natively); any other SDPA-style mask (bool or additive float, broadcastable to
        (B, Hq, Sq, Skv)) runs through SDPA with a counted fallback reason.
    is_causal : query i sees keys j <= i (top-left aligned, as torch SDPA).
    scale : softmax scale, default 1/sqrt(D); must be finite.
    layout : "BHSD" or "BSHD"; the output uses the same layout.
    mode : "auto" (8-bit kernel on sm_90, FP4 on sm_120, SDPA elsewhere), "int8", "fp4" (the
        kernel where one exists for the device, else the torch reference of the same algorithm),
        or "sdpa".
    return_lse : also return the natural-log log-sum-exp of the scaled scores, float32 (B, Hq, Sq).

    Returns
    -------
    out : like q (same dtype and layout); rows with no visible key are 0.
    lse : float32 (B, Hq, Sq), only with ``return_lse``; -inf on rows with no visible key.

    Unsupported input (head dim other than 64/128, float64, another mask kind, no kernel for
    "auto") falls back to SDPA, logged once per reason and counted in
    :func:`sage_diffusers.fallback_stats`; malformed input raises ``ValueError``.
    """
    layout = Layout.parse(layout)
    mode = Mode.parse(mode)
    qh, kh, vh = _to_bhsd(q, k, v, layout)
    b, hq, sq, d = qh.shape
    skv, dv = kh.shape[2], vh.shape[3]
    scale_f = _check_scale(scale, d)
    key_mask, general_mask = _split_mask(attn_mask, b, hq, sq, skv, q.device)

    plan = _plan(mode, q.device, q.dtype, d, dv, general_mask is not None)
    if plan.path == "sdpa":
        out, lse = _sdpa(qh, kh, vh, key_mask, general_mask, is_causal, scale_f, return_lse)
    else:
        out, lse = _run_sage(plan, qh, kh, vh, key_mask, is_causal, scale_f, return_lse)
    out = out.to(q.dtype)
    if layout is Layout.BSHD:
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _to_bhsd(q, k, v, layout: Layout):
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
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must agree on heads and length, got (H, S) {tuple(k.shape[1:3])} vs {tuple(v.shape[1:3])}")
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: expected {d}, got {k.shape[3]}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    return q, k, v


def _check_scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, torch.Tensor):
        raise ValueError("scale: expected a Python float, got a tensor")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale: expected a finite float, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite float, got {value}")
    return value


def _split_mask(mask, b: int, hq: int, sq: int, skv: int, device):
    """Return (key_mask bool (B, Skv) or None, other_mask or None).

    A bool mask whose only non-trivial dims are batch and keys is a key-padding mask and runs
    natively; any other valid mask is returned as ``other_mask`` for the SDPA path.
    """
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attn_mask: expected a tensor or None, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"attn_mask: expected device {device}, got {mask.device}")
    if mask.dtype == torch.bool and mask.dim() == 2:
        if mask.shape[0] not in (1, b) or mask.shape[1] != skv:
            raise ValueError(f"attn_mask: a 2-D key mask must be (B={b}, Skv={skv}), got {tuple(mask.shape)}")
        return mask.expand(b, skv).contiguous(), None
    if mask.dim() > 4:
        raise ValueError(f"attn_mask: expected at most 4 dims, got shape {tuple(mask.shape)}")
    full = (b, hq, sq, skv)
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    for got, want in zip(shape4, full):
        if got not in (1, want):
            raise ValueError(f"attn_mask: shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Skv) = {full}")
    if mask.dtype == torch.bool and shape4[1] == 1 and shape4[2] == 1:
        return mask.reshape(shape4[0], skv).expand(b, skv).contiguous(), None
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"attn_mask: expected bool or floating dtype, got {mask.dtype}")
    return None, mask


def _plan(mode: Mode, device: torch.device, dtype: torch.dtype, d: int, dv: int, general_mask: bool) -> Plan:
    if mode is Mode.SDPA:
        return Plan("sdpa", Mode.SDPA)
    if mode is Mode.AUTO and device.type != "cuda":
        return Plan("sdpa", Mode.SDPA)  # by design: the references are for checking, not speed
    reason = None
    if dtype not in ACCEPTED_DTYPES:
        reason = f"dtype {dtype} (supported: float16, bfloat16, float32)"
    elif d not in SUPPORTED_HEAD_DIMS:
        reason = f"head dim {d} (supported: {SUPPORTED_HEAD_DIMS})"
    elif dv != d:
        reason = f"value head dim {dv} differs from query head dim {d}"
    elif general_mask:
        reason = "attn_mask is not a key-padding mask (only bool (B, Skv) / (B, 1, 1, Skv) run natively)"
    if reason is not None:
        _fallback.record(f"{mode.value}: {reason}")
        return Plan("sdpa", Mode.SDPA)

    if mode is Mode.AUTO:
        algo = _auto_algorithm(device)
        if algo is None:
            _fallback.record(f"auto: no low-bit kernel for {_arch_name(device)}")
            return Plan("sdpa", Mode.SDPA)
        backend, why = _kernel(algo, device)
        if backend is None:
            _fallback.record(f"auto: {algo.value} kernel unavailable on {_arch_name(device)}: {why}")
            return Plan("sdpa", Mode.SDPA)
        return Plan("kernel", algo, backend)

    if device.type != "cuda":
        return Plan("reference", mode)
    backend, why = _kernel(mode, device)
    if backend is not None:
        return Plan("kernel", mode, backend)
    _fallback.record(f"{mode.value}: no kernel on {_arch_name(device)} ({why})", ran="the torch reference")
    return Plan("reference", mode)


def _arch_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _auto_algorithm(device: torch.device) -> Optional[Mode]:
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9:
        return Mode.INT8
    if major == 12:
        return Mode.FP4
    return None


@functools.lru_cache(maxsize=None)
def _kernel_cached(mode: Mode, capability: tuple[int, int]) -> tuple[Optional[Backend], str]:
    try:
        if mode is Mode.INT8:
            from .kernels import int8_sm90 as module

            fn_name = "attention_int8_sm90"
        else:
            from .kernels import fp4 as module

            fn_name = "attention_fp4"
    except ImportError as exc:
        return None, f"kernel module missing ({exc})"
    ok, why = module.is_available()
    if not ok:
        return None, why
    try:
        module.build()  # JIT on first use; a failed build becomes a fallback reason, not a crash
    except Exception as exc:  # compiler missing, headers missing, ...: report and fall back
        return None, f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return getattr(module, fn_name), ""


def _kernel(mode: Mode, device: torch.device) -> tuple[Optional[Backend], str]:
    return _kernel_cached(mode, torch.cuda.get_device_capability(device))


def _run_sage(plan: Plan, q, k, v, key_mask, is_causal: bool, scale: float, return_lse: bool):
    if plan.path == "kernel":
        # Kernels read fp16/bf16 with a unit-stride head dim; anything else gets a private copy.
        dtype = q.dtype if q.dtype in KERNEL_DTYPES else torch.bfloat16
        q, k, v = (t.to(dtype) if t.stride(-1) == 1 else t.to(dtype).contiguous() for t in (q, k, v))
        return plan.backend(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
    ref = sage8_reference if plan.mode is Mode.INT8 else sage3_reference
    res = ref(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
    return res if return_lse else (res, None)


def _combined_mask(key_mask, general_mask, is_causal: bool, sq: int, skv: int, device):
    """One SDPA mask (bool or additive float) equivalent to the arguments, or None."""
    mask = key_mask[:, None, None, :] if key_mask is not None else general_mask
    if is_causal:
        causal = torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask + torch.zeros(sq, skv, dtype=mask.dtype, device=device).masked_fill(~causal, -math.inf)
    return mask


def _sdpa(q, k, v, key_mask, general_mask, is_causal: bool, scale: float, return_lse: bool):
    """torch SDPA on BHSD views, with rows that see no key set to 0 (SDPA gives NaN there)."""
    hq, sq, skv = q.shape[1], q.shape[2], k.shape[2]
    gqa = hq != k.shape[1]
    mask = _combined_mask(key_mask, general_mask, is_causal, sq, skv, q.device)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        visible = mask if mask.dtype == torch.bool else mask > -math.inf
        has_key = visible.any(-1, keepdim=True)  # broadcastable to (B, H, Sq, 1)
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    lse = _lse(q, k, mask, scale) if return_lse else None
    return out, lse


def _lse(q, k, mask, scale: float) -> torch.Tensor:
    """Exact float32 log-sum-exp of the masked scores, computed in query chunks: (B, Hq, Sq)."""
    b, hq, sq, _ = q.shape
    kf = k.float().repeat_interleave(hq // k.shape[1], dim=1)  # (B, Hq, Skv, D)
    step = max(1, _LSE_CHUNK_ELEMENTS // max(1, b * hq * k.shape[2]))
    parts = []
    for i0 in range(0, sq, step):
        s = (q[:, :, i0:i0 + step].float() @ kf.transpose(-1, -2)) * scale  # (B, Hq, n, Skv)
        if mask is not None:
            m = mask[..., i0:i0 + step, :] if mask.dim() >= 2 and mask.shape[-2] == sq else mask
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        parts.append(torch.logsumexp(s, dim=-1))
    return torch.cat(parts, dim=-1)
