"""The node in ComfyUI's V3 schema form (``comfy_api.latest``) and its extension entry point.

Imported only when ``comfy_api.latest`` is importable (see ``__init__``).
"""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import node_spec as spec
from .blocks import validate_blocks
from .patch import patch_model


class SageDiffusersAttention(io.ComfyNode):
    """MODEL -> MODEL: clone with the sage_diffusers attention override."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        t = spec.TOOLTIPS
        return io.Schema(
            node_id=spec.NODE_ID,
            display_name=spec.DISPLAY_NAME,
            category=spec.CATEGORY,
            description=spec.DESCRIPTION,
            inputs=[
                io.Model.Input("model", tooltip=t["model"]),
                io.Combo.Input("mode", options=spec.MODE_OPTIONS, default=spec.MODE_DEFAULT, tooltip=t["mode"]),
                io.Int.Input("full_precision_first_steps", default=0, min=0, max=spec.MAX_STEPS, step=1,
                             tooltip=t["full_precision_first_steps"]),
                io.Int.Input("full_precision_last_steps", default=0, min=0, max=spec.MAX_STEPS, step=1,
                             tooltip=t["full_precision_last_steps"]),
                io.String.Input("blocks", default="", multiline=False, tooltip=t["blocks"]),
                # optional and last: prompts and workflows saved before it existed still validate and load
                io.Combo.Input("int8_precision", options=spec.PRECISION_OPTIONS, default=spec.PRECISION_DEFAULT,
                               optional=True, tooltip=t["int8_precision"]),
            ],
            outputs=[io.Model.Output(tooltip="The patched clone.")],
        )

    @classmethod
    def validate_inputs(cls, blocks) -> "bool | str":
        # Declares only `blocks`, so ComfyUI still checks min/max/combo of the other inputs.
        return validate_blocks(blocks)

    @classmethod
    def execute(cls, model, mode, full_precision_first_steps, full_precision_last_steps, blocks,
                int8_precision=spec.PRECISION_DEFAULT) -> io.NodeOutput:
        return io.NodeOutput(patch_model(model, mode, full_precision_first_steps, full_precision_last_steps, blocks,
                                         int8_precision))


class SageDiffusersExtension(ComfyExtension):
    async def get_node_list(self) -> list:
        return [SageDiffusersAttention]


async def comfy_entrypoint() -> SageDiffusersExtension:
    return SageDiffusersExtension()
