"""ComfyUI custom node for sage_diffusers: a MODEL patch that routes attention to SageAttention.

Load it either way:
- as a folder in ``ComfyUI/custom_nodes/`` (a copy or a link of this folder): ComfyUI reads
  ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` (and ``comfy_entrypoint`` on V3-aware
  versions that find no mappings);
- as the installed module ``comfyui_node`` (``import comfyui_node``), e.g. from tests, without
  ComfyUI: the legacy node class and the pure logic work without ``comfy`` importable.

With ``comfy_api.latest`` available the mapping holds the V3 node (it also serves the V1 loader,
which is the path ComfyUI takes when ``NODE_CLASS_MAPPINGS`` exists); otherwise the legacy node.
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("sage_diffusers.comfyui")


def _ensure_sage_diffusers() -> None:
    """Import sage_diffusers; from a source checkout (this folder linked into custom_nodes) add the
    checkout to sys.path when the package is not installed."""
    try:
        import sage_diffusers  # noqa: F401
        return
    except ImportError as exc:
        checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        if not os.path.isfile(os.path.join(checkout, "sage_diffusers", "__init__.py")):
            raise ImportError(
                "the sage_diffusers ComfyUI node needs the sage_diffusers package: "
                "pip install it into ComfyUI's Python environment"
            ) from exc
    sys.path.append(checkout)
    import sage_diffusers  # noqa: F401,E402

    logger.info("sage_diffusers[comfyui] using sage_diffusers from the checkout %s", checkout)


_ensure_sage_diffusers()

from . import node_spec  # noqa: E402
from .nodes_legacy import SageDiffusersAttentionLegacy  # noqa: E402
from .patch import patch_model  # noqa: E402
from .stats import GLOBAL_STATS  # noqa: E402

try:
    import comfy_api.latest  # noqa: F401  (only to learn whether this ComfyUI has the V3 API)
except ImportError:
    HAS_V3 = False
else:
    HAS_V3 = True

if HAS_V3:
    from .nodes_v3 import SageDiffusersAttention, SageDiffusersExtension, comfy_entrypoint  # noqa: E402

    NODE_CLASS_MAPPINGS = {node_spec.NODE_ID: SageDiffusersAttention}
else:
    NODE_CLASS_MAPPINGS = {node_spec.NODE_ID: SageDiffusersAttentionLegacy}
NODE_DISPLAY_NAME_MAPPINGS = {node_spec.NODE_ID: node_spec.DISPLAY_NAME}


def attention_stats():
    """Process-wide counters of every patched model (a :class:`~comfyui_node.stats.StatsSnapshot`)."""
    return GLOBAL_STATS.snapshot()


__all__ = [
    "HAS_V3", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "SageDiffusersAttentionLegacy",
    "attention_stats", "patch_model",
] + (["SageDiffusersAttention", "SageDiffusersExtension", "comfy_entrypoint"] if HAS_V3 else [])
