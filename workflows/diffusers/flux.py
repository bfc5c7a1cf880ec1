"""FLUX.1-dev text-to-image (1024x1024) with sage_diffusers attention.

    python workflows/diffusers/flux.py --mode int8                  # needs black-forest-labs/FLUX.1-dev
    python workflows/diffusers/flux.py --tiny                       # offline wiring check on CPU

Flux uses diffusers' attention dispatcher, so ``transformer.set_attention_backend("sage_diffusers_auto")`` works as well once
``sage_diffusers.integration.register_backend()`` has run.
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

WORKFLOW = Workflow(
    family=Family.FLUX,
    hub_id="black-forest-labs/FLUX.1-dev",
    pipeline="FluxPipeline",
    output=Output.IMAGE,
    call=dict(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5),
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
