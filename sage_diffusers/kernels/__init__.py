"""GPU kernels of sage_diffusers, built just in time on first use.

Submodules (imported on demand; importing this package builds nothing):

- ``int8_sm90``: Hopper (sm_90a) 8-bit attention, sage8 numerics (INT8 QK^T, FP8 PV).
- ``fp4`` (optional, another helper's kernel): FP4 attention for sm_120.

Every kernel module exposes ``is_available() -> (bool, reason)`` and a backend function with the
contract ``fn(q, k, v, *, key_mask, is_causal, scale, return_lse) -> (out, lse | None)``
(see SPEC_FOR_HELPERS.md, "Backend contract").
"""
from __future__ import annotations

__all__ = ["int8_sm90"]
