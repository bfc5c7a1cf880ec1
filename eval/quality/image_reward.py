"""ImageReward (Xu et al., 2023) through the ``image-reward`` package, and a tiny stand-in for tests.

The real scorer is ``ImageReward.load(path)`` of the maintained package (BLIP ViT-L + BERT with
cross-attention + an MLP head, v1.0 weights ``ImageReward.pt``). Install it where torchvision works
(it pins timm 0.6.13, which needs torchvision): ``pip install image-reward``.

``TinyImageReward`` keeps the package's output convention, reward = (head(feature) - 0.16717362830052426)
/ 1.0333394966054072 (ImageReward's normalising constants), on features of a tiny random CLIP; it exists
only to test the reproduce pipeline offline.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .clip import ClipEncoder, tiny_clip_encoder
from .weights import IMAGE_REWARD, resolve

REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072


def _to_pil(images: torch.Tensor):
    from PIL import Image

    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arr]


class ImageRewardScorer:
    """Mean ImageReward of images (N, 3, H, W) in [0, 1] against their prompts (the real model)."""

    def __init__(self, path: Optional[str] = None, device: str = "cpu"):
        folder = resolve(IMAGE_REWARD, path)
        try:
            import ImageReward as RM
        except Exception as e:  # noqa: BLE001 - its timm pin fails to import without torchvision
            raise ImportError(f"ImageReward needs the image-reward package (pip install image-reward): {e}") from e
        self.model = RM.load(str(folder / "ImageReward.pt"), device=device,
                             med_config=str(folder / "med_config.json"))

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> float:
        scores = [self.model.score(p, [im]) for p, im in zip(prompts, _to_pil(images))]
        return float(sum(scores) / len(scores))


class TinyImageReward(torch.nn.Module):
    """Tiny random stand-in: ImageReward's MLP head shape (E -> 1024 -> 128 -> 64 -> 16 -> 1) on the
    product of tiny CLIP image and text embeddings, normalised with ImageReward's constants."""

    def __init__(self, encoder: Optional[ClipEncoder] = None, seed: int = 0):
        super().__init__()
        self.encoder = encoder or tiny_clip_encoder(seed)
        e = self.encoder.model.config.projection_dim
        torch.manual_seed(seed)
        dims = (e, 1024, 128, 64, 16, 1)
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [torch.nn.Linear(a, b)]
        self.mlp = torch.nn.Sequential(*layers)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> float:
        f = self.encoder.image_embeds(images) * self.encoder.text_embeds(prompts)
        r = (self.mlp(f).squeeze(-1) - REWARD_MEAN) / REWARD_STD
        return float(r.mean())
