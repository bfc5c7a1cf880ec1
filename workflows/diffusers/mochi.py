"""Mochi-1 text-to-video (480x848) with sage_diffusers attention: one batched, key-masked call per layer.

    python workflows/diffusers/mochi.py --policy sage3              # needs genmo/mochi-1-preview
    python workflows/diffusers/mochi.py --tiny                      # offline wiring check on CPU
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

WORKFLOW = Workflow(
    family=Family.MOCHI,
    hub_id="genmo/mochi-1-preview",
    pipeline="MochiPipeline",
    output=Output.VIDEO,
    call=dict(height=480, width=848, num_frames=85, num_inference_steps=64, guidance_scale=4.5),
    fps=30,
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
