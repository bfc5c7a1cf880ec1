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
import threading
from typing import Any

import torch

from sage_diffusers.options import Int8Precision, Mode
from sage_diffusers.processors import _diffusers_compat as compat
from sage_diffusers.processors._core import Choice
from sage_diffusers.processors._dispatcher_call import dispatcher_call
from sage_diffusers.processors.context_parallel import context_parallel_attention

# Backend name of each mode.
BACKEND_NAMES: dict[Mode, str] = {mode: f"sage_diffusers_{mode.value}" for mode in Mode}
# The backend policy-driven processors select; the mode comes from the call they are making (``ACTIVE``).
POLICY_BACKEND_NAME = "sage_diffusers_policy"
# Backends that can run the 8-bit algorithm (None: the policy backend) also come with the precision pinned,
# "sage_diffusers_int8_accurate" and so on: the plain name follows SAGE_DIFFUSERS_INT8_PRECISION, as
# ``sd.attention`` without ``int8_precision`` does.
_PRECISION_MODES: tuple[Mode | None, ...] = (Mode.AUTO, Mode.INT8, None)


def backend_name(mode: Mode | None, int8_precision: Int8Precision | str | None = None) -> str:
    """The registered name of the backend that runs ``mode`` (None: the policy backend) with ``int8_precision``.

    ``int8_precision`` None (or a mode that never runs the 8-bit algorithm): the plain name, whose 8-bit
    precision is the process default; else ``"<plain name>_fast"`` or ``"<plain name>_accurate"``.
    """
    plain = POLICY_BACKEND_NAME if mode is None else BACKEND_NAMES[mode]
    if int8_precision is None or mode not in _PRECISION_MODES:
        return plain
    return f"{plain}_{Int8Precision.parse(int8_precision).value}"


class _ActiveCalls:
    """The modes of the dispatcher calls policy-driven processors are making (pushed around diffusers'
    ``__call__``, read by the policy backend), innermost last.

    Eagerly a stack per thread, so that pipelines run from several threads never read each other's mode. While
    dynamo traces, a module-level list: one attribute slot that every layer overwrote read back the first
    layer's mode in a compiled graph (every layer then ran layer 0's mode), whereas list pushes and pops are
    traced in order. Where a graph break separates a traced push from an eager read, the read falls back to
    that list.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._traced: list[Choice] = []

    def _eager(self) -> list[Choice]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _stack(self) -> list[Choice]:
        if torch.compiler.is_compiling():
            return self._traced
        eager = self._eager()
        return eager if eager or not self._traced else self._traced

    def push(self, choice: Choice) -> None:
        (self._traced if torch.compiler.is_compiling() else self._eager()).append(choice)

    def pop(self) -> None:
        self._stack().pop()

    def top(self) -> Choice | None:
        stack = self._stack()
        return stack[-1] if stack else None

    def clear(self) -> None:
        """Forget every pushed mode (this thread's and the traced list)."""
        self._eager().clear()
        self._traced.clear()


ACTIVE = _ActiveCalls()


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
    int8_precision: Int8Precision | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    run = None
    if getattr(_parallel_config, "context_parallel_config", None) is not None:
        # Ring / Ulysses over the ranks; the key mask travels with the keys (other masks are refused there).
        run = functools.partial(context_parallel_attention, parallel_config=_parallel_config)
    return dispatcher_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                           mode=mode, run=run, int8_precision=int8_precision)


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
    choice = ACTIVE.top()
    if choice is None:
        fixed = ", ".join(repr(BACKEND_NAMES[m]) for m in Mode)
        raise ValueError(
            f"the {POLICY_BACKEND_NAME!r} backend is selected by policy-driven sage processors during their own "
            f"call; to choose a backend by name use one of {fixed}"
        )
    return choice


class _ModeBackend:
    """``sage_attention_backend`` with another mode (or the active policy choice) and an 8-bit precision
    (None: the process default), under the same signature.

    A class, not a closure: registered functions stay picklable and ``inspect.signature`` (which the registry reads
    to filter the dispatcher's kwargs) sees ``sage_attention_backend``'s exact parameters via ``__wrapped__``.
    """

    def __init__(self, mode: Mode | None, int8_precision: Int8Precision | None = None) -> None:
        self.mode = mode
        self.int8_precision = int8_precision
        functools.update_wrapper(self, sage_attention_backend)
        name = backend_name(mode, int8_precision)
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
            mode=mode, int8_precision=self.int8_precision,
        )


# (Mode (None: the policy backend), Int8Precision or None) -> registered AttentionBackendName member; filled once
# by register_backend(). A plain dict (not a cached function) so that torch.compile can read it inside a traced
# processor.
_MEMBERS: dict[tuple[Mode | None, Int8Precision | None], Any] = {}
_REGISTER_LOCK = threading.Lock()  # first registrations from several threads: one set of enum members


def register_backend() -> dict[Mode, Any]:
    """Register the ``sage_diffusers_*`` backends with diffusers' dispatcher (idempotent; changes no default).

    Returns
    -------
    dict of Mode to AttentionBackendName
        The registered backend member of each mode (its plain name: the process's default 8-bit precision;
        ``backend_name`` gives the names with the precision pinned); empty, with one logged warning, where the
        installed diffusers lacks the private hooks this needs (the warning names its version and what still
        works).
    """
    try:
        _register()
    except compat.DiffusersCompatError as exc:
        compat.warn_once(str(exc))
    return {mode: member for (mode, precision), member in _MEMBERS.items() if mode is not None and precision is None}


def _register() -> None:
    """Register every backend once; raises ``DiffusersCompatError`` where diffusers lacks the hooks."""
    if _MEMBERS:
        return
    with _REGISTER_LOCK:
        if _MEMBERS:  # another thread registered meanwhile
            return
        constraints = compat.backend_constraints()
        keys = [(mode, None) for mode in (*Mode, None)]
        keys += [(mode, precision) for mode in _PRECISION_MODES for precision in Int8Precision]
        members = {}
        for mode, precision in keys:
            name = backend_name(mode, precision)
            members[mode, precision] = member = compat.add_backend_name(name.upper(), name)
            plain_auto = mode is Mode.AUTO and precision is None
            function = sage_attention_backend if plain_auto else _ModeBackend(mode, precision)
            compat.register_backend_function(member, function, constraints)
        _MEMBERS.update(members)


def backend_member(mode: Mode | None, int8_precision: Int8Precision | None = None) -> Any:
    """The ``AttentionBackendName`` member that runs ``mode`` (None: the policy backend) with ``int8_precision``
    (None: the process default); registers on first use.

    Raises
    ------
    DiffusersCompatError
        Where the installed diffusers lacks the hooks the backends need (the message names its version).
    """
    if not _MEMBERS:
        _register()
    return _MEMBERS[mode, int8_precision if mode in _PRECISION_MODES else None]


__all__ = [
    "ACTIVE", "BACKEND_NAMES", "POLICY_BACKEND_NAME", "backend_member", "backend_name", "register_backend",
    "sage_attention_backend",
]
