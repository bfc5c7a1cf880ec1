"""Wan 2.2 T2V A14B text-to-video (480x832, 81 frames) with sage_diffusers attention.

    python workflows/diffusers/wan22.py --policy sage3              # needs Wan-AI/Wan2.2-T2V-A14B-Diffusers
    python workflows/diffusers/wan22.py --tiny                      # offline wiring check on CPU

Wan 2.2 A14B has two transformers (``transformer`` for the high-noise steps, ``transformer_2`` for the low-noise
ones); ``sage_diffusers.enable`` patches both and one policy counts the steps across them. Wan 2.1 checkpoints
(one transformer) run the same way: set ``HUB_ID`` and drop ``guidance_scale_2``.
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

HUB_ID = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"

WORKFLOW = Workflow(
    family=Family.WAN22,
    hub_id=HUB_ID,
    pipeline="WanPipeline",
    output=Output.VIDEO,
    call=dict(height=480, width=832, num_frames=81, num_inference_steps=40, guidance_scale=4.0, guidance_scale_2=3.0),
    fps=16,
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
