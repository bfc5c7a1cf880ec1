"""sage_diffusers as a backend of diffusers' attention dispatcher (``attention_dispatch.py``, 0.36+).

diffusers routes the core attention of dispatcher-based processors (Flux, Chroma, HunyuanVideo and 1.5, Wan,
LTX-Video, QwenImage, Flux.2, ...) through ``dispatch_attention_fn``, which looks the backend function up in
``_AttentionBackendRegistry._backends`` by an ``AttentionBackendName`` member. That enum is closed (no public way
to add a name), and both ``ModelMixin.set_attention_backend(name)`` and ``attention_backend(name)`` validate names
against it.

Mechanism (``register_backend``), the least invasive we found in 0.42.1, which has no public way to add a
backend; both steps use private hooks, reached only through ``_diffusers_compat``:

1. Create one pseudo-member of ``AttentionBackendName`` per mode, exactly as ``Enum`` builds its own members
   (``str.__new__`` + ``_name_``/``_value_``), and insert it into the enum's lookup tables ``_member_map_``,
   ``_value2member_map_`` and ``_member_names_``. ``AttentionBackendName("sage_diffusers_int8")``,
   ``__members__`` and iteration then know it; no diffusers function is patched or replaced, and no default
   changes (``_AttentionBackendRegistry._active_backend`` is left alone).
2. Register our function for that member with the registry's own decorator, as diffusers does for its built-in
   backends, so ``dispatch_attention_fn`` filters kwargs by our signature and runs the constraint checks when
   ``DIFFUSERS_ATTN_CHECKS`` is on.

Where a newer diffusers lacks either hook, ``register_backend`` logs one warning naming the diffusers version and
registers nothing, and ``backend_member`` (hence every dispatcher-family sage processor) raises
``DiffusersCompatError``; the SDPA families' processors need no backend and keep working.

Names (all prefixed ``sage_diffusers_`` so they cannot be mistaken for diffusers' own ``sage*`` backends, which
call the ``sageattention`` package): ``"sage_diffusers_auto"``, ``"sage_diffusers_fp4"``,
``"sage_diffusers_int8"``, ``"sage_diffusers_sdpa"``; ``"sage_diffusers_policy"`` is the one policy-driven sage
processors select (it reads the mode of the call they are making). After ``register_backend()``::

    transformer.set_attention_backend("sage_diffusers_int8")
    with attention_backend("sage_diffusers_auto"):
        pipe(...)

Note that diffusers' ``set_attention_backend`` itself also makes the backend the process-wide default for
processors without one of their own, and ``reset_attention_backend`` does not undo that (diffusers' behaviour);
``attention_backend(...)`` as a context manager does not leak.

Masks: bool masks whose only structure is key padding run natively as a ``key_mask``: (B, Skv), (B, 1, 1, Skv),
per-head copies (B, H, 1, Skv), and the outer products (B, 1, S, S) = keep[:, None, :, None] & keep[:, None, None,
:] that Chroma and HunyuanVideo 1.5 build (rows of padded queries see no key and come out 0, as in SDPA). The
factorization is checked: eagerly a mask that is not of this form goes to ``sage_diffusers.attention`` as a full
``attn_mask`` (SDPA, counted in ``fallback_stats``); under ``torch.compile`` the check is an asynchronous assert.

Context parallelism: every backend is registered with ``supports_context_parallel=True``; calls carrying a
``_parallel_config`` run ``processors.context_parallel.context_parallel_attention`` (ring, Ulysses or both).

Limits: the ``DIFFUSERS_ATTN_BACKEND`` environment variable is read when diffusers is imported, before any
registration, so it cannot name these backends. Processors that call SDPA directly (CogVideoX, Mochi, SD3's
``JointAttnProcessor2_0``) never reach the dispatcher: use ``sage_diffusers.enable`` or the sage processors.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from sage_diffusers.api import classify_in_scope
from sage_diffusers.options import Layout, Mode
from sage_diffusers.processors import _diffusers_compat as compat
from sage_diffusers.processors._core import Choice, attend

# Backend name of each mode.
BACKEND_NAMES: dict[Mode, str] = {mode: f"sage_diffusers_{mode.value}" for mode in Mode}
# The backend policy-driven processors select; the mode comes from the call they are making (``ACTIVE``).
POLICY_BACKEND_NAME = "sage_diffusers_policy"


class _ActiveCall:
    """The mode of the dispatcher call a policy-driven processor is making (set around diffusers' ``__call__``).

    A plain module-level object: dynamo traces its attribute writes as side effects, so the slot works inside a
    compiled graph as well.
    """

    choice: Choice | None = None


ACTIVE = _ActiveCall()


def _factorize_mask(
    attn_mask: torch.Tensor | None, batch: int, heads: int, q_len: int, kv_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Split a dispatcher mask into (key_mask (B, Skv), row_keep (B, Sq, H|1, 1), other_mask), unused ones None.

    Key-padding structure (see the module docstring) becomes ``key_mask`` plus, when some query rows see no key,
    ``row_keep`` (those rows are zeroed afterwards). Additive float masks and bool masks of any other structure are
    returned as ``other_mask``, unchanged.
    """
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.ndim not in (2, 4):
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


def _sage_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
    _parallel_config: Any,
    *,
    mode: Choice,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if dropout_p != 0.0:
        raise ValueError(f"sage_diffusers attention has no dropout; got dropout_p={dropout_p}")
    if query.shape[2] != key.shape[2] and not enable_gqa:
        # Same contract as torch SDPA: differing head counts are an error unless GQA was asked for.
        raise ValueError(
            f"query has {query.shape[2]} heads and key {key.shape[2]}; pass enable_gqa=True for grouped-query attention"
        )
    b, sq, hq, _ = query.shape
    key_mask, row_keep, other = _factorize_mask(attn_mask, b, hq, sq, key.shape[1])
    extra: dict[str, Any] = dict(is_causal=is_causal, scale=scale, return_lse=return_lse)
    if other is not None:
        extra["attn_mask"] = other  # not key padding: the API runs it through SDPA and counts why
    if getattr(_parallel_config, "context_parallel_config", None) is not None:
        from sage_diffusers.processors.context_parallel import context_parallel_attention

        # Ring / Ulysses over the ranks; the key mask travels with the keys (other masks are refused there).
        result = context_parallel_attention(
            query, key, value, mode=mode, parallel_config=_parallel_config, key_mask=key_mask, **extra
        )
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
    """Attention backend for diffusers' dispatcher (mode auto), registered as ``"sage_diffusers_auto"``.

    Parameters
    ----------
    query : torch.Tensor
        (B, Sq, Hq, D).
    key, value : torch.Tensor
        (B, Skv, Hkv, D); Hkv may divide Hq only when ``enable_gqa`` is True.
    attn_mask : torch.Tensor or None
        Bool key-padding masks run natively (see the module docstring); other masks run SDPA inside
        ``sage_diffusers.attention`` (counted in ``fallback_stats``).
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
        Set by diffusers' ``enable_parallelism``: ring / Ulysses attention over the ranks
        (``sage_diffusers.processors.context_parallel``; key-padding masks only, no causal, inference only).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        Output (B, Sq, Hq, D) in the query dtype, and the lse when asked.
    """
    return _sage_backend(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config,
        mode=Mode.AUTO,
    )


def _active_choice() -> Choice:
    choice = ACTIVE.choice
    if choice is None:
        fixed = ", ".join(repr(BACKEND_NAMES[m]) for m in Mode)
        raise ValueError(
            f"the {POLICY_BACKEND_NAME!r} backend is selected by policy-driven sage processors during their own "
            f"call; to choose a backend by name use one of {fixed}"
        )
    return choice


class _ModeBackend:
    """``sage_attention_backend`` with another mode (or the active policy choice), under the same signature.

    A class, not a closure: registered functions stay picklable and ``inspect.signature`` (which the registry reads
    to filter the dispatcher's kwargs) sees ``sage_attention_backend``'s exact parameters via ``__wrapped__``.
    """

    def __init__(self, mode: Mode | None) -> None:
        self.mode = mode
        functools.update_wrapper(self, sage_attention_backend)
        name = POLICY_BACKEND_NAME if mode is None else BACKEND_NAMES[mode]
        self.__name__ = self.__qualname__ = f"sage_attention_backend_{name}"
        self.__doc__ = f"``sage_attention_backend`` registered as {name!r}."

    def __call__(
        self,
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
        mode = _active_choice() if self.mode is None else self.mode
        return _sage_backend(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config,
            mode=mode,
        )


# Mode (None: the policy backend) -> registered AttentionBackendName member; filled once by register_backend().
# A plain dict (not a cached function) so that torch.compile can read it inside a traced processor.
_MEMBERS: dict[Mode | None, Any] = {}


def register_backend() -> dict[Mode, Any]:
    """Register the ``sage_diffusers_*`` backends with diffusers' dispatcher (idempotent; changes no default).

    Returns
    -------
    dict of Mode to AttentionBackendName
        The registered backend member of each mode; empty, with one logged warning, where the installed diffusers
        lacks the private hooks this needs (the warning names its version and what still works).
    """
    try:
        _register()
    except compat.DiffusersCompatError as exc:
        compat.warn_once(str(exc))
    return {mode: member for mode, member in _MEMBERS.items() if mode is not None}


def _register() -> None:
    """Register every backend once; raises ``DiffusersCompatError`` where diffusers lacks the hooks."""
    if _MEMBERS:
        return
    constraints = compat.backend_constraints()
    names: dict[Mode | None, str] = {**BACKEND_NAMES, None: POLICY_BACKEND_NAME}
    members = {mode: compat.add_backend_name(value.upper(), value) for mode, value in names.items()}
    for mode, member in members.items():
        function = sage_attention_backend if mode is Mode.AUTO else _ModeBackend(mode)
        compat.register_backend_function(member, function, constraints)
    _MEMBERS.update(members)


def backend_member(mode: Mode | None) -> Any:
    """The ``AttentionBackendName`` member that runs ``mode`` (None: the policy backend); registers on first use.

    Raises
    ------
    DiffusersCompatError
        Where the installed diffusers lacks the hooks the backends need (the message names its version).
    """
    if not _MEMBERS:
        _register()
    return _MEMBERS[mode]


__all__ = [
    "ACTIVE", "BACKEND_NAMES", "POLICY_BACKEND_NAME", "backend_member", "register_backend",
    "sage_attention_backend",
]
