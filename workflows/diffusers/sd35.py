"""Stable Diffusion 3.5 Large text-to-image (1024x1024) with sage_diffusers attention.

    python workflows/diffusers/sd35.py --policy sage3               # needs stabilityai/stable-diffusion-3.5-large
    python workflows/diffusers/sd35.py --tiny                       # offline wiring check on CPU
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

WORKFLOW = Workflow(
    family=Family.SD35,
    hub_id="stabilityai/stable-diffusion-3.5-large",
    pipeline="StableDiffusion3Pipeline",
    output=Output.IMAGE,
    call=dict(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5),
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
