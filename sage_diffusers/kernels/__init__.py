"""GPU kernels of sage_diffusers, built just in time on first use.

Submodules (imported on demand; importing this package builds nothing):

- ``int8_sm90``: Hopper (sm_90a) 8-bit attention, sage8 numerics (INT8 QK^T, FP8 PV).
- ``fp4``: FP4 microscaling attention, native on sm_120a, emulated on sm_90a.

Every kernel module exposes ``is_available() -> (bool, reason)``, ``build()`` and a backend
function with one contract, ``fn(q, k, v, *, key_mask, is_causal, scale, return_lse) ->
(out, lse | None)`` on BHSD views (see ``sage_diffusers.api``).
"""
from __future__ import annotations

import importlib

__all__ = ["build_all", "fp4", "int8_sm90"]

KERNEL_MODULES = ("int8_sm90", "fp4")


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
