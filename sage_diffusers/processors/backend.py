"""sage_diffusers as a backend of diffusers' attention dispatcher (``attention_dispatch.py``, 0.36+).

diffusers routes the core attention of dispatcher-based processors (Flux, HunyuanVideo, Wan, ...) through
``dispatch_attention_fn``, which looks the backend function up in ``_AttentionBackendRegistry._backends`` by an
``AttentionBackendName`` member. That enum is closed (no public way to add a name), and both
``ModelMixin.set_attention_backend(name)`` and ``attention_backend(name)`` validate names against it.

Mechanism (``register_backend``), the least invasive we found in 0.42.1:

1. Create one pseudo-member of ``AttentionBackendName`` per mode, exactly as ``Enum`` builds its own members
   (``str.__new__`` + ``_name_``/``_value_``), and insert it into the enum's lookup tables ``_member_map_``,
   ``_value2member_map_`` and ``_member_names_``. ``AttentionBackendName("sage3")``, ``__members__`` and
   iteration then know it; no diffusers function is patched or replaced.
2. Register our function for that member with the registry's own decorator, as diffusers does for its built-in
   backends, so ``dispatch_attention_fn`` filters kwargs by our signature and runs the constraint checks when
   ``DIFFUSERS_ATTN_CHECKS`` is on.

Names: ``"sage3"`` (mode auto), ``"sage3_fp4"``, ``"sage3_int8"``, ``"sage3_sdpa"``. After
``register_backend()`` (``sage_diffusers.integration.enable`` calls it too)::

    transformer.set_attention_backend("sage3")
    with attention_backend("sage3"):
        pipe(...)

diffusers' ``set_attention_backend`` also makes the backend the process-wide default (for processors without
one of their own), and ``reset_attention_backend`` does not undo that.

Limits: the ``DIFFUSERS_ATTN_BACKEND`` environment variable is read when diffusers is imported, before any
registration, so it cannot name these backends. Processors that call SDPA directly (CogVideoX, Mochi, SD3's
``JointAttnProcessor2_0``) never reach the dispatcher: use ``sage_diffusers.integration.enable`` for them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

import sage_diffusers
from sage_diffusers.options import Layout, Mode

# Backend name of each mode; the auto mode gets the short public name.
BACKEND_NAMES: dict[Mode, str] = {
    Mode.AUTO: "sage3",
    Mode.FP4: "sage3_fp4",
    Mode.INT8: "sage3_int8",
    Mode.SDPA: "sage3_sdpa",
}


def _key_mask_of(attn_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """Turn the dispatcher's bool key-padding masks into the API's native (B, Skv) form.

    (B, Skv) and (B or 1, 1, 1, Skv) bool masks become (B, Skv). Anything else (additive float masks, full
    (B, H, Sq, Skv) masks) is returned unchanged; the API then falls back to SDPA and logs why.
    """
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    if attn_mask.ndim == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
        attn_mask = attn_mask[:, 0, 0, :]
    if attn_mask.ndim == 2 and attn_mask.shape[-1] == kv_len and attn_mask.shape[0] in (1, batch):
        return attn_mask.expand(batch, kv_len)
    return attn_mask


def _sage_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
    *,
    mode: Mode,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if dropout_p != 0.0:
        raise ValueError(f"sage_diffusers attention has no dropout; got dropout_p={dropout_p}")
    if _parallel_config is not None:
        raise ValueError("sage_diffusers attention does not support context parallelism (_parallel_config set)")
    if query.shape[2] != key.shape[2] and not enable_gqa:
        # Same contract as torch SDPA: differing head counts are an error unless GQA was asked for.
        raise ValueError(
            f"query has {query.shape[2]} heads and key {key.shape[2]}; pass enable_gqa=True for grouped-query attention"
        )
    key_mask = _key_mask_of(attn_mask, query.shape[0], key.shape[1])
    result = sage_diffusers.attention(
        query, key, value, attn_mask=key_mask, is_causal=is_causal, scale=scale,
        layout=Layout.BSHD, mode=mode, return_lse=return_lse,
    )
    if not return_lse:
        return result
    out, lse = result
    # The API gives lse as (B, H, S); diffusers' backends return (B, S, H) next to a (B, S, H, D) output.
    return out, lse.transpose(1, 2).contiguous()


def sage_attention_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention backend for diffusers' dispatcher (mode auto), registered as ``"sage3"``.

    Parameters
    ----------
    query : torch.Tensor
        (B, Sq, Hq, D).
    key, value : torch.Tensor
        (B, Skv, Hkv, D); Hkv may divide Hq only when ``enable_gqa`` is True.
    attn_mask : torch.Tensor or None
        Bool key-padding mask (B, Skv) or (B, 1, 1, Skv), True = attend (run natively); other masks fall back to
        SDPA inside ``sage_diffusers.attention``.
    dropout_p : float
        Must be 0.0 (ValueError otherwise).
    is_causal : bool
        Top-left aligned causal mask, as torch SDPA.
    scale : float or None
        Softmax scale, default 1/sqrt(D).
    enable_gqa : bool
        Allow Hq != Hkv.
    return_lse : bool
        Also return the float32 log-sum-exp, shaped (B, Sq, Hq) like diffusers' other backends.
    _parallel_config : ParallelConfig or None
        Must be None: context parallelism is not supported (ValueError otherwise).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        Output (B, Sq, Hq, D) in the query dtype, and the lse when asked.
    """
    return _sage_backend(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config,
        mode=Mode.AUTO,
    )


def _make_mode_backend(mode: Mode) -> Callable[..., Any]:
    """``sage_attention_backend`` with another mode, under the same signature."""
    if mode is Mode.AUTO:
        return sage_attention_backend

    # functools.wraps sets __wrapped__, so inspect.signature (which the registry reads to filter the dispatcher's
    # kwargs) sees sage_attention_backend's exact parameters.
    @functools.wraps(sage_attention_backend)
    def backend(*args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return _sage_backend(*args, **kwargs, mode=mode)

    backend.__name__ = backend.__qualname__ = f"sage_attention_backend_{mode.value}"
    backend.__doc__ = f"``sage_attention_backend`` in mode {mode.value}, registered as {BACKEND_NAMES[mode]!r}."
    return backend


def _add_enum_member(enum_cls: type, name: str, value: str) -> Any:
    """Add ``name = value`` to a closed ``(str, Enum)`` class the way ``Enum`` stores its own members."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


# Mode -> registered AttentionBackendName member; filled once by register_backend(). A plain dict (not a cached
# function) so that torch.compile can read it inside a traced processor without a graph break.
_MEMBERS: dict[Mode, Any] = {}


def register_backend() -> dict[Mode, Any]:
    """Register the ``sage3*`` backends with diffusers' dispatcher (idempotent).

    Returns
    -------
    dict of Mode to AttentionBackendName
        The registered backend member of each mode.
    """
    if _MEMBERS:
        return dict(_MEMBERS)
    from diffusers.models import attention_dispatch as dispatch

    constraints = [c for c in (getattr(dispatch, "_check_device", None), getattr(dispatch, "_check_shape", None)) if c]
    members = {}
    for mode, value in BACKEND_NAMES.items():
        member = _add_enum_member(dispatch.AttentionBackendName, value.upper(), value)
        dispatch._AttentionBackendRegistry.register(member, constraints=constraints)(_make_mode_backend(mode))
        members[mode] = member
    _MEMBERS.update(members)
    return dict(members)


def backend_member(mode: Mode) -> Any:
    """The ``AttentionBackendName`` member that runs ``mode``; ``register_backend()`` must have run."""
    return _MEMBERS[mode]
