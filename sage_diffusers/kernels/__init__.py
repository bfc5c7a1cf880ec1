"""GPU kernels of sage_diffusers, built just in time on first use.

Submodules (imported on demand; importing this package builds nothing):

- ``int8_sm90``: Hopper (sm_90a) 8-bit attention, sage8 numerics (INT8 QK^T, FP8 PV).
- ``fp4``: FP4 microscaling attention, native on sm_120a, emulated on sm_90a.

Every kernel module exposes ``is_available() -> (bool, reason)``, ``build()`` and a backend
function with one contract, ``fn(q, k, v, *, key_mask, is_causal, scale, return_lse) ->
(out, lse | None)`` on BHSD views (see ``sage_diffusers.api``). :func:`backend_for` says which
one serves a mode on an arch; the API, the self-check and the doctor all ask it.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

from ..options import Mode

__all__ = ["backend_for", "build_all", "fp4", "int8_sm90"]

KERNEL_MODULES = ("int8_sm90", "fp4")


@functools.lru_cache(maxsize=None)
def backend_for(mode: Mode, capability: tuple[int, int]) -> tuple[Optional[Callable[..., tuple]], str]:
    """The kernel that runs ``mode`` on GPUs of ``capability``, built now (once per process).

    Parameters
    ----------
    mode : Mode
        ``Mode.INT8`` or ``Mode.FP4``.
    capability : tuple of int
        The device's compute capability, e.g. (9, 0).

    Returns
    -------
    (backend, reason)
        The backend function (the kernels' contract, see ``sage_diffusers.api``) and "", or None
        and why there is none: no module for the arch, not available there, or a failed build
        (reason "build failed: ...").
    """
    try:
        if mode is Mode.INT8 and capability[0] == 8:  # sm_80/86/89: SageBwd's Triton forward
            from . import sagebwd_triton as module

            fn_name = "attention_int8_triton"
        elif mode is Mode.INT8:
            from . import int8_sm90 as module

            fn_name = "attention_int8_sm90"
        else:
            from . import fp4 as module

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


def build_all() -> int:
    """Build every kernel this GPU can run into the JIT cache (ahead-of-time install step).

    Returns 0 when every available kernel built, 1 otherwise; prints one line per kernel.
    """
    failed = 0
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        ok, why = module.is_available()
        if not ok:
            print(f"{name}: not for this device ({why})")
            continue
        try:
            module.build()
            print(f"{name}: built")
        except Exception as exc:  # report every kernel, then fail
            failed = 1
            print(f"{name}: build failed: {exc}")
    return failed
