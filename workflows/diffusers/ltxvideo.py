"""LTX-Video text-to-video (704x480, 161 frames) with sage_diffusers attention.

    python workflows/diffusers/ltxvideo.py --mode int8              # needs Lightricks/LTX-Video
    python workflows/diffusers/ltxvideo.py --tiny                   # offline wiring check on CPU

LTX-Video's cross-attention gets the text padding as an additive bias; its sage processor runs it as the bool key
mask it encodes (no SDPA fallback).
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

WORKFLOW = Workflow(
    family=Family.LTXVIDEO,
    hub_id="Lightricks/LTX-Video",
    pipeline="LTXPipeline",
    output=Output.VIDEO,
    call=dict(height=480, width=704, num_frames=161, num_inference_steps=50, guidance_scale=3.0),
    fps=24,
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
