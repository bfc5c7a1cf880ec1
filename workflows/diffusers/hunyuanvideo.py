"""HunyuanVideo text-to-video (720p) with sage_diffusers attention; the text padding mask runs natively.

    python workflows/diffusers/hunyuanvideo.py --policy sage3       # needs hunyuanvideo-community/HunyuanVideo
    python workflows/diffusers/hunyuanvideo.py --tiny               # offline wiring check on CPU
"""

from _sage_cli import Output, Workflow, main
from _sage_tiny import Family

WORKFLOW = Workflow(
    family=Family.HUNYUANVIDEO,
    hub_id="hunyuanvideo-community/HunyuanVideo",
    pipeline="HunyuanVideoPipeline",
    output=Output.VIDEO,
    call=dict(height=720, width=1280, num_frames=61, num_inference_steps=30),
    fps=15,
)

if __name__ == "__main__":
    raise SystemExit(main(WORKFLOW))
