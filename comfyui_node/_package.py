"""The node's exports, imported by ``comfyui_node/__init__.py`` when it runs as ``comfyui_node``."""
from __future__ import annotations

from . import node_spec
from .nodes_legacy import SageDiffusersAttentionLegacy
from .patch import patch_model
from .stats import GLOBAL_STATS

try:
    import comfy_api.latest  # noqa: F401  (only to learn whether this ComfyUI has the V3 API)
except ImportError:
    HAS_V3 = False
else:
    HAS_V3 = True

if HAS_V3:
    from .nodes_v3 import SageDiffusersAttention, SageDiffusersExtension, comfy_entrypoint

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
