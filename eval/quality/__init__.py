"""Quality metrics of the paper's Tables 2-3 (video: CLIPSIM, CLIP-T, VQA-a / VQA-t, FScore; image: CLIP
score, ImageReward; FID / sFID live in ``eval.metrics``), each with a tiny random builder for offline tests.

Real weights are read from local paths or the Hugging Face hub cache (never downloaded here);
``weights.resolve`` raises ``FileNotFoundError`` naming the missing file and where it comes from.
"""
