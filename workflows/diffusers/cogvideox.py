"""CogVideoX-5B text-to-video (49 frames, 480x720) with sage_diffusers attention.

    python workflows/diffusers/cogvideox.py --policy sage3          # needs the THUDM/CogVideoX-5b weights
    python workflows/diffusers/cogvideox.py --tiny                  # offline wiring check on CPU

For CogVideoX-2B pass the same settings with hub id THUDM/CogVideoX-2b (edit HUB_ID).
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

HUB_ID = "THUDM/CogVideoX-5b"

WORKFLOW = Workflow(
    family=Family.COGVIDEOX,
    hub_id=HUB_ID,
    pipeline="CogVideoXPipeline",
    output=Output.VIDEO,
    call=dict(height=480, width=720, num_frames=49, num_inference_steps=50, guidance_scale=6.0),
    fps=8,
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
