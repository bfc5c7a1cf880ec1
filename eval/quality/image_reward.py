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

from .. import _cli
from .clip import ClipEncoder, tiny_clip_encoder
from .weights import IMAGE_REWARD, resolve

REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072


def _to_pil(images: torch.Tensor):
    from PIL import Image

    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arr]


class ImageRewardScorer:
    """Mean ImageReward of images (N, 3, H, W) in [0, 1] against their prompts (the real model).

    The package's own ``ImageReward.load`` fetches ``med_config.json`` from the hub and unpickles the
    checkpoint without ``weights_only``; here the model is built from the package's class with the
    local ``med_config.json`` and the state dict loads with ``weights_only=True``, both files checked
    (and named in the error) before the package is imported.
    """

    def __init__(self, path: Optional[str] = None, device: str = "cpu"):
        folder = resolve(IMAGE_REWARD, path)
        checkpoint, med_config = folder / "ImageReward.pt", folder / "med_config.json"
        _cli.read_json(med_config, "weights 'image_reward' config")
        state = _cli.load_state_dict(checkpoint, "weights 'image_reward'")
        if not any(k.startswith("mlp.") for k in state) or not any(k.startswith("blip.") for k in state):
            raise _cli.InputError(f"weights 'image_reward' {checkpoint}: expected ImageReward's state dict "
                                  "(blip.* and mlp.* parameters)")
        try:
            import importlib

            model_class = importlib.import_module("ImageReward.ImageReward").ImageReward
        except Exception as e:  # noqa: BLE001 - its timm pin fails to import without torchvision
            raise ImportError(f"ImageReward needs the image-reward package (pip install image-reward): {e}") from e
        model = model_class(med_config=str(med_config), device=device)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # The package loads non-strictly (BLIP parts that scoring never runs may be absent); what scoring
        # runs must be loaded. position_ids are buffers some transformers versions add.
        used = ("mlp.", "blip.visual_encoder.", "blip.text_encoder.")
        _cli.check_state_dict_keys(checkpoint, "weights 'image_reward'", missing, unexpected,
                                   ignore=lambda k: not k.startswith(used) or k.endswith("position_ids"))
        self.model = model.to(device).eval()

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
