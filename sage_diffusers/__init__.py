"""sage_diffusers: SageAttention3 (FP4 microscaling) and 8-bit attention for diffusion models.

Start with :func:`attention`, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
that takes a ``mode`` ("auto", "fp4", "int8", "sdpa"), and :func:`fallback_stats`, which says
which calls could not take the requested path and why.
"""
from ._fallback import fallback_stats, recorded_fallbacks, reset_fallback_stats
from .api import attention, mask_scope
from .options import FP4Format, Layout, Mode, PQuant
from .sagebwd import sagebwd

__version__ = "0.1.0"

__all__ = [
    "FP4Format", "Layout", "Mode", "PQuant", "__version__", "attention", "disable", "enable",
    "enable_context_parallel", "fallback_stats", "mask_scope", "recorded_fallbacks", "reset_fallback_stats",
    "sagebwd",
]

_LAZY = {"enable", "disable"}  # need diffusers: imported on first use, not with the package


def __getattr__(name):
    if name in _LAZY:
        from . import integration

        return getattr(integration, name)
    if name == "enable_context_parallel":  # diffusers' enable_parallelism with a plan for every supported model
        from .processors.context_parallel import enable_context_parallel

        return enable_context_parallel
    raise AttributeError(f"module 'sage_diffusers' has no attribute {name!r}")


def __dir__():
    # The lazy names live in __getattr__, which dir() does not see; listing them imports nothing.
    return sorted(set(globals()) | set(__all__))
