"""CLIP metrics with ``transformers.CLIPModel``: CLIPSIM and CLIP-T (videos), CLIP score (images).

Conventions:

- CLIPSIM (EvalCrafter): CLIP ViT-B/32 cosine similarity between each frame and the prompt, averaged
  over frames (raw cosine, about 0.2 for good text-video pairs; the paper reports .1865 / .1881).
- CLIP-T (EvalCrafter's CLIP-Temp): cosine between the image embeddings of consecutive frames,
  averaged (1.0 for a still video).
- CLIP score (Hessel et al., torchmetrics' convention): 100 * max(cos(image, prompt), 0), ViT-L/14.

Images are preprocessed in torch as CLIP's processor does (bicubic resize of the short side to the
model's image size, centre crop, the OpenAI mean / std below), so tensors never round-trip through
PIL. The real tokenizer is ``CLIPTokenizer`` from the same folder; tiny random models use
``ByteTokenizer`` (UTF-8 bytes), since no vocabulary ships offline.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .weights import CLIP_B32, CLIP_L14, WeightSource, resolve

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258, BOS 1, EOS 259 (the largest id, where CLIP pools), pad 0."""

    BOS, EOS, PAD, OFFSET = 1, 259, 0, 3
    vocab_size = 260

    def __init__(self, max_length: int = 77):
        self.max_length = max_length

    def __call__(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        ids = torch.full((len(texts), self.max_length), self.PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(texts):
            body = [b + self.OFFSET for b in t.encode("utf-8")][: self.max_length - 2]
            row = [self.BOS, *body, self.EOS]
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask}


class ClipEncoder:
    """Normalised CLIP image and text embeddings.

    Parameters
    ----------
    model : transformers.CLIPModel (eval mode).
    tokenizer : callable(list[str]) -> dict with input_ids, attention_mask (tensors).
    """

    def __init__(self, model, tokenizer, device: str = "cpu"):
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer
        self.device = device
        self.size = model.config.vision_config.image_size

    @classmethod
    def from_pretrained(cls, source: WeightSource = CLIP_B32, path: Optional[str] = None, device: str = "cpu"):
        from transformers import CLIPModel, CLIPTokenizer

        folder = resolve(source, path)
        model = CLIPModel.from_pretrained(str(folder), local_files_only=True)
        tok = CLIPTokenizer.from_pretrained(str(folder), local_files_only=True)

        def tokenize(texts):
            return tok(list(texts), padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        return cls(model, tokenize, device)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> (N, 3, S, S) normalised, S the model's image size."""
        n, _, h, w = images.shape
        r = self.size / min(h, w)
        x = F.interpolate(images.float(), size=(max(self.size, round(h * r)), max(self.size, round(w * r))),
                          mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
        top, left = (x.shape[-2] - self.size) // 2, (x.shape[-1] - self.size) // 2
        x = x[..., top:top + self.size, left:left + self.size]
        mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        return (x - mean) / std

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor, batch: int = 32) -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> (N, E) unit vectors."""
        out = []
        for i in range(0, images.shape[0], batch):
            px = self.preprocess(images[i:i + batch]).to(self.device)
            e = self.model.get_image_features(pixel_values=px)
            e = getattr(e, "pooler_output", e)  # transformers 5 returns an output object
            out.append(F.normalize(e.float(), dim=-1).cpu())
        return torch.cat(out)

    @torch.no_grad()
    def text_embeds(self, texts: Sequence[str]) -> torch.Tensor:
        """list of N prompts -> (N, E) unit vectors."""
        tok = {k: v.to(self.device) for k, v in self.tokenizer(list(texts)).items()}
        e = self.model.get_text_features(**tok)
        e = getattr(e, "pooler_output", e)
        return F.normalize(e.float(), dim=-1).cpu()


def clipsim(encoder: ClipEncoder, video: torch.Tensor, prompt: str) -> float:
    """Mean frame-prompt cosine of a video (T, 3, H, W) in [0, 1]."""
    return float((encoder.image_embeds(video) @ encoder.text_embeds([prompt])[0]).mean())


def clip_temp(encoder: ClipEncoder, video: torch.Tensor) -> float:
    """Mean cosine between consecutive frames' embeddings of a video (T >= 2, 3, H, W)."""
    if video.shape[0] < 2:
        raise ValueError("CLIP-T needs at least two frames")
    e = encoder.image_embeds(video)
    return float((e[1:] * e[:-1]).sum(-1).mean())


def clip_score(encoder: ClipEncoder, images: torch.Tensor, prompts: Sequence[str]) -> float:
    """Mean of 100 * max(cos(image_i, prompt_i), 0) over N images (N, 3, H, W) and N prompts."""
    if images.shape[0] != len(prompts):
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    cos = (encoder.image_embeds(images) * encoder.text_embeds(prompts)).sum(-1)
    return float((100 * cos.clamp_min(0)).mean())


def tiny_clip_encoder(seed: int = 0, image_size: int = 32) -> ClipEncoder:
    """A tiny random CLIP (2 layers, width 32) with ``ByteTokenizer``, for offline tests."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                         bos_token_id=ByteTokenizer.BOS, eos_token_id=2, pad_token_id=ByteTokenizer.PAD),
        vision_config=dict(image_size=image_size, patch_size=8, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4),
        projection_dim=16,
    )
    # eos_token_id = 2 selects CLIP's legacy pooling at the largest id, ByteTokenizer's EOS.
    return ClipEncoder(CLIPModel(cfg), ByteTokenizer())


__all__ = ["ByteTokenizer", "ClipEncoder", "CLIP_B32", "CLIP_L14", "clip_score", "clip_temp", "clipsim",
           "tiny_clip_encoder"]
