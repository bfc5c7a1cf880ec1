"""Every diffusers name sage_diffusers imports and every private diffusers hook it uses, checked before use.

sage_diffusers supports diffusers releases newer than the one it was tested with (``TESTED_DIFFUSERS``), so
nothing here may assume that a name still exists. Where one is missing, what depends on it raises
``DiffusersCompatError``, or, for a feature the rest does not need, is turned off with one logged warning; either
message names the installed diffusers version, what is missing, what is unavailable and what still works.

Public diffusers API, used directly elsewhere: a processor's ``__call__`` and the modules' ``processor`` /
``set_processor`` / ``set_attn_processor``, ``ModelMixin.set_attention_backend``, ``attention_backend``,
``enable_parallelism``, ``ContextParallelConfig`` / ``ParallelConfig`` and their public fields.

Names looked up here because a release may drop or move them (``diffusers_class``, ``diffusers_function``):
the processor classes each family replaces, the attention module classes ``SageAttnProcessor`` recognises,
``apply_rotary_emb`` (CogVideoX). A missing one turns off its family only (a debug log): ``sage_diffusers.enable``
on such a model raises its usual ValueError, and the family's sage processor raises ``DiffusersCompatError``
when constructed.

Private hooks (diffusers 0.42.1 has no public way to add an attention backend: ``AttentionBackendName`` is a
closed enum, and ``set_attention_backend`` and ``attention_backend`` accept only its members):

- ``attention_dispatch.AttentionBackendName``, extended through the enum's lookup tables (``add_backend_name``),
  and ``attention_dispatch._AttentionBackendRegistry.register`` (``register_backend_function``). Missing: no
  ``sage_diffusers_*`` backend, hence no sage processor for the dispatcher families either (one warning).
- ``register``'s ``supports_context_parallel`` keyword: missing, the backends register without context
  parallelism (one warning).
- ``attention_dispatch._check_device`` / ``_check_shape``, the constraints diffusers runs with
  ``DIFFUSERS_ATTN_CHECKS``: missing, the backends register without them (a debug log).
- A dispatcher processor's ``__call__`` reading ``self._attention_backend`` (``dispatcher_problem``): where it
  does not, that family is off (a debug log).
- Context parallelism: ``ContextParallelInput`` / ``ContextParallelOutput`` (``diffusers.models._modeling_parallel``
  unless diffusers exports them), ``ModelMixin._cp_plan`` and ``_parallel_config``, and ``ContextParallelConfig``'s
  ``_ring_mesh`` / ``_ulysses_mesh`` / ``_flattened_mesh``. Missing, the context-parallel call that needs one
  raises.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import logging
from typing import Any, Callable

import diffusers

logger = logging.getLogger("sage_diffusers")

# The diffusers release the whole test suite ran against.
TESTED_DIFFUSERS = "0.42.1"

DISPATCHER_FAMILIES = "Flux, Chroma, Flux.2, HunyuanVideo, HunyuanVideo 1.5, Wan, LTX-Video, QwenImage"
SDPA_FAMILIES = "CogVideoX, SD3/SD3.5, Mochi"


class DiffusersCompatError(RuntimeError):
    """The installed diffusers lacks a name or private hook that this sage_diffusers feature needs."""


def diffusers_version() -> str:
    """The installed diffusers version, as the messages here name it."""
    return str(getattr(diffusers, "__version__", "of unknown version"))


def missing_message(missing: str, unavailable: str, still_works: str) -> str:
    """``diffusers <version> has no <missing>``, then what that turns off and what keeps working."""
    return changed_message(f"has no {missing}", unavailable, still_works)


def changed_message(change: str, unavailable: str, still_works: str) -> str:
    """``diffusers <version> <change>``, then what that turns off and what keeps working."""
    return (
        f"diffusers {diffusers_version()} {change}. Unavailable: {unavailable}. Still works: {still_works}. "
        f"(sage_diffusers was tested with diffusers {TESTED_DIFFUSERS}.)"
    )


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time only: a missing hook is reported once per process."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("sage_diffusers: %s", message)


# ---------------------------------------------------------------------------------------------------------------
# Names that a release may drop or move


class _Unavailable:
    """Base of the stand-in for a diffusers class this diffusers lacks: building a subclass of it raises."""

    _sage_missing: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise DiffusersCompatError(cls._sage_missing)


def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def diffusers_class(module: str, name: str, unavailable: str | None = None) -> type:
    """diffusers' class ``module.name``, or a stand-in when this diffusers has none.

    The stand-in keeps the name, so the sage processor class built on it still exists (and imports); constructing
    that processor raises ``DiffusersCompatError`` saying what is missing. ``is_missing`` tells stand-ins apart.
    ``unavailable`` says what needs the class (default: the sage processor that replaces it).
    """
    found = _lookup(module, name)
    if isinstance(found, type):
        return found
    message = missing_message(
        f"{name} in {module}",
        unavailable or f"the sage processor that replaces {name}",
        "the other families' processors, sage_diffusers.attention",
    )
    logger.debug("sage_diffusers: %s", message)
    return type(name, (_Unavailable,), {"__module__": __name__, "__qualname__": name, "_sage_missing": message})


def diffusers_function(module: str, name: str, unavailable: str) -> Callable[..., Any]:
    """diffusers' function ``module.name``, or a stand-in that raises ``DiffusersCompatError`` when called.

    ``unavailable`` says what needs the function.
    """
    found = _lookup(module, name)
    if callable(found):
        return found
    message = missing_message(
        f"{name} in {module}",
        unavailable,
        "the other families' processors, sage_diffusers.attention",
    )
    logger.debug("sage_diffusers: %s", message)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise DiffusersCompatError(message)

    unavailable.__name__ = unavailable.__qualname__ = name
    unavailable._sage_missing = message  # type: ignore[attr-defined]
    return unavailable


def is_missing(obj: Any) -> bool:
    """Whether ``obj`` is a stand-in of ``diffusers_class`` / ``diffusers_function``."""
    return (isinstance(obj, type) and issubclass(obj, _Unavailable)) or hasattr(obj, "_sage_missing")


def missing_what(obj: Any) -> str:
    """The message a stand-in raises ("" for a real diffusers object)."""
    return getattr(obj, "_sage_missing", "")


# ---------------------------------------------------------------------------------------------------------------
# The attention dispatcher: AttentionBackendName and _AttentionBackendRegistry

_ENUM_TABLES = (("_member_map_", dict), ("_value2member_map_", dict), ("_member_names_", list))


def _dispatch_module() -> Any:
    try:
        return importlib.import_module("diffusers.models.attention_dispatch")
    except ImportError:
        return None


def _backend_hooks() -> tuple[Any, Any, str | None]:
    """(``AttentionBackendName``, ``_AttentionBackendRegistry``, None), or (.., .., what is missing)."""
    dispatch = _dispatch_module()
    if dispatch is None:
        return None, None, "module diffusers.models.attention_dispatch (the attention dispatcher)"
    names = getattr(dispatch, "AttentionBackendName", None)
    if not (isinstance(names, type) and issubclass(names, str) and issubclass(names, enum.Enum)):
        return None, None, "AttentionBackendName str enum in diffusers.models.attention_dispatch to extend"
    if not all(isinstance(getattr(names, table, None), kind) for table, kind in _ENUM_TABLES):
        tables = ", ".join(table for table, _ in _ENUM_TABLES)
        return None, None, f"AttentionBackendName enum with the lookup tables {tables} to extend"
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    register = getattr(registry, "register", None)
    if not callable(register) or "constraints" not in _parameters(register):
        return None, None, (
            "_AttentionBackendRegistry.register(backend, constraints=...) in diffusers.models.attention_dispatch"
        )
    return names, registry, None


def _parameters(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def backend_message(missing: str) -> str:
    """The message of a missing dispatcher hook: no sage_diffusers_* backend, no dispatcher family."""
    return missing_message(
        missing,
        "the sage_diffusers_* attention backends (set_attention_backend('sage_diffusers_*'), "
        f"attention_backend('sage_diffusers_*')) and the sage processors of the dispatcher families "
        f"({DISPATCHER_FAMILIES})",
        f"sage_diffusers.enable(pipe) and the sage processors for {SDPA_FAMILIES}; sage_diffusers.attention",
    )


def backend_problem() -> str | None:
    """None where the ``sage_diffusers_*`` backends can be registered, else the message saying why not."""
    missing = _backend_hooks()[2]
    return None if missing is None else backend_message(missing)


def backend_registry() -> tuple[Any, Any]:
    """(``AttentionBackendName``, ``_AttentionBackendRegistry``).

    Raises
    ------
    DiffusersCompatError
        Where this diffusers lacks either (or the enum cannot be extended).
    """
    names, registry, missing = _backend_hooks()
    if missing is not None:
        raise DiffusersCompatError(backend_message(missing))
    return names, registry


def add_backend_name(name: str, value: str) -> Any:
    """Add ``name = value`` to the closed ``AttentionBackendName`` enum, the way ``Enum`` stores its own members.

    ``AttentionBackendName(value)``, ``__members__``, iteration and ``set_attention_backend(value)`` then know it;
    no diffusers function is patched. Idempotent: an existing member of that value is returned.

    Raises
    ------
    DiffusersCompatError
        Where the enum is missing or has not the lookup tables of ``enum.Enum``.
    """
    enum_cls, _ = backend_registry()
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


def backend_constraints() -> list[Callable[..., None]]:
    """diffusers' device and shape checks, run on our backends when ``DIFFUSERS_ATTN_CHECKS`` is set.

    Only debugging aids: where this diffusers has them no longer, the backends register without them.
    """
    dispatch = _dispatch_module()
    checks = [getattr(dispatch, name, None) for name in ("_check_device", "_check_shape")]
    if not all(callable(check) for check in checks):
        logger.debug(
            "sage_diffusers: diffusers %s has no _check_device/_check_shape: the sage_diffusers_* backends run "
            "without those DIFFUSERS_ATTN_CHECKS constraints", diffusers_version(),
        )
    return [check for check in checks if callable(check)]


def register_backend_function(
    member: Any, function: Callable[..., Any], constraints: list[Callable[..., None]]
) -> None:
    """Register ``function`` for backend ``member`` with the registry's own decorator, with context parallelism.

    Where ``register`` takes no ``supports_context_parallel``, the backend registers without it and one warning
    says so (diffusers then refuses these backends under ``enable_parallelism``).
    """
    _, registry = backend_registry()
    if "supports_context_parallel" in _parameters(registry.register):
        registry.register(member, constraints=constraints, supports_context_parallel=True)(function)
        return
    warn_once(missing_message(
        "supports_context_parallel keyword in _AttentionBackendRegistry.register",
        "context parallelism (enable_parallelism, sage_diffusers.enable_context_parallel) with the "
        "sage_diffusers_* backends",
        "the sage_diffusers_* backends and sage_diffusers.enable without context parallelism",
    ))
    registry.register(member, constraints=constraints)(function)


def dispatcher_problem(processor_cls: type) -> str | None:
    """None where ``processor_cls.__call__`` hands ``self._attention_backend`` to the dispatcher, else why not.

    Our dispatcher-family processors keep diffusers' ``__call__`` and answer ``_attention_backend`` with a
    sage_diffusers_* backend; a ``__call__`` that no longer reads it would silently run diffusers' default.
    """
    code = getattr(getattr(processor_cls, "__call__", None), "__code__", None)
    if code is None or "_attention_backend" not in code.co_names:
        return missing_message(
            f"_attention_backend read in {processor_cls.__name__}.__call__",
            f"the sage processor that replaces {processor_cls.__name__}",
            "the other families' processors, sage_diffusers.attention",
        )
    return None


# ---------------------------------------------------------------------------------------------------------------
# Context parallelism

_CP_STILL_WORKS = "diffusers' own attention backends under context parallelism; sage_diffusers.enable without it"


def context_parallel_io() -> tuple[type, type]:
    """(``ContextParallelInput``, ``ContextParallelOutput``): diffusers' public export, else its private module.

    Raises
    ------
    DiffusersCompatError
        Where this diffusers has neither.
    """
    for module in ("diffusers", "diffusers.models._modeling_parallel"):
        found = (_lookup(module, "ContextParallelInput"), _lookup(module, "ContextParallelOutput"))
        if all(isinstance(cls, type) for cls in found):
            return found
    raise DiffusersCompatError(missing_message(
        "ContextParallelInput / ContextParallelOutput (diffusers.models._modeling_parallel)",
        "sage_diffusers' context-parallel plan for HunyuanVideo",
        "enable_context_parallel on models with their own plan (Flux, Wan, ...) or with cp_plan=...",
    ))


def model_cp_plan(transformer: Any) -> Any:
    """The model's own context-parallel plan (``_cp_plan``; None where the model has none).

    Raises
    ------
    DiffusersCompatError
        Where this diffusers' ``ModelMixin`` has no ``_cp_plan`` (not even None), so no model's plan can be read.
    """
    if not hasattr(_lookup("diffusers", "ModelMixin"), "_cp_plan"):
        raise DiffusersCompatError(missing_message(
            "ModelMixin._cp_plan (a model's context-parallel plan)",
            "reading the model's own plan in sage_diffusers.enable_context_parallel",
            "enable_context_parallel(transformer, config, cp_plan=...), and sage_diffusers.enable",
        ))
    return getattr(transformer, "_cp_plan", None)


def model_parallel_config(transformer: Any) -> Any:
    """``transformer._parallel_config``, which ``enable_parallelism`` sets.

    Raises
    ------
    DiffusersCompatError
        Where this diffusers' models have no ``_parallel_config``.
    """
    if not hasattr(transformer, "_parallel_config"):
        raise DiffusersCompatError(missing_message(
            f"_parallel_config on {type(transformer).__name__} (set by enable_parallelism)",
            "HunyuanVideo's key-mask rewrite in sage_diffusers.enable_context_parallel",
            _CP_STILL_WORKS,
        ))
    return transformer._parallel_config


def cp_mesh(cp_config: Any, name: str) -> Any:
    """A device mesh of a ``ContextParallelConfig``: ``"_ring_mesh"``, ``"_ulysses_mesh"`` or ``"_flattened_mesh"``.

    Raises
    ------
    DiffusersCompatError
        Where this diffusers' ``ContextParallelConfig`` has no such field.
    """
    if not hasattr(cp_config, name):
        raise DiffusersCompatError(missing_message(
            f"{name} on {type(cp_config).__name__} (its device mesh)",
            "context parallelism with the sage_diffusers_* backends",
            _CP_STILL_WORKS,
        ))
    return getattr(cp_config, name)
