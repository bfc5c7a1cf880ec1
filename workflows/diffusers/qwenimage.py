"""Qwen-Image text-to-image (1328x1328) with sage_diffusers attention: its text-padding mask runs natively.

    python workflows/diffusers/qwenimage.py --mode int8             # needs Qwen/Qwen-Image
    python workflows/diffusers/qwenimage.py --tiny                  # offline wiring check on CPU

Qwen-Image uses diffusers' attention dispatcher, so ``transformer.set_attention_backend("sage_diffusers_auto")``
works as well once ``sage_diffusers.integration.register_backend()`` has run.
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

WORKFLOW = Workflow(
    family=Family.QWENIMAGE,
    hub_id="Qwen/Qwen-Image",
    pipeline="QwenImagePipeline",
    output=Output.IMAGE,
    # true_cfg_scale > 1 with a negative prompt: one transformer call for each, per step.
    call=dict(height=1328, width=1328, num_inference_steps=50, true_cfg_scale=4.0, negative_prompt=" "),
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
