"""DOVER (Wu et al., ICCV 2023) video quality: VQA-t (technical) and VQA-a (aesthetic), inference only.

DOVER is not on PyPI, so this is a port written from the public description and configuration
(``dover.yml``) of the reference repository (VQAssessment/DOVER):

- views: technical = spatial fragments, a 7 x 7 grid of 32 x 32 patches (224 x 224), the same patch
  positions for every aligned group of 32 frames, the video upsampled bilinearly first when its short
  side is below 224; aesthetic = the frames resized to 224 x 224. Clips are 32 frames, frame interval 2,
  looping over short videos as DOVER's sampler does. Deviation: DOVER draws each fragment's offset
  inside its grid cell at random; here it is the cell's centre (deterministic scores).
- normalisation: pixels in [0, 255], mean (123.675, 116.28, 103.53), std (58.395, 57.12, 57.375).
- heads (``VQAHead``): 1x1x1 Conv3d in -> 64, GELU, 1x1x1 Conv3d 64 -> 1 on the backbone's feature
  map (dropout is off at inference); a branch's raw score is the mean of its map.
- scores reported here: VQA-t = 100 * sigmoid((t - 0.1107) / 0.07355), VQA-a = 100 * sigmoid((a -
  0.08285) / 0.03774), i.e. each raw score standardised with the constants of DOVER's own score fusion
  (its overall score is sigmoid(0.6104 * t' + 0.3896 * a') with t', a' those standardised scores, also
  returned). EvalCrafter rescales differently; compare numbers only within one convention.
- backbones: aesthetic ``conv_tiny`` = ConvNeXt-T inflated to 3D (here ``ConvNeXt3D``: stem 2x4x4 patchify,
  blocks with (1|3)x7x7 depthwise convs, final LayerNorm on the feature map); technical ``swin_tiny_grpb`` = Video Swin-T with gated relative
  position bias, which is NOT ported yet: ``Dover.from_checkpoint`` raises until it is. Tiny random
  instances (``tiny_dover``) use ConvNeXt3D for both branches to test views, heads and normalisation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .weights import DOVER, resolve

PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)
TECH_MEAN, TECH_STD = 0.1107, 0.07355  # DOVER's fusion constants, technical branch
AES_MEAN, AES_STD = 0.08285, 0.03774  # aesthetic branch
FUSE_TECH, FUSE_AES = 0.6104, 0.3896


@dataclass(frozen=True)
class ViewConfig:
    """DOVER's test-time sampling (dover.yml)."""

    fragments: int = 7
    fragment_size: int = 32
    aesthetic_size: int = 224
    clip_len: int = 32
    frame_interval: int = 2
    aligned: int = 32


def sample_frames(t: int, cfg: ViewConfig) -> torch.Tensor:
    """Indices of one clip of ``clip_len`` frames at ``frame_interval``, looping past the end."""
    return (torch.arange(cfg.clip_len) * cfg.frame_interval) % t


def normalise(video01: torch.Tensor) -> torch.Tensor:
    """(C=3, T, H, W) in [0, 1] -> DOVER's input normalisation."""
    mean = torch.tensor(PIXEL_MEAN).view(3, 1, 1, 1)
    std = torch.tensor(PIXEL_STD).view(3, 1, 1, 1)
    return (video01.float() * 255.0 - mean) / std


def fragments(video: torch.Tensor, cfg: ViewConfig) -> torch.Tensor:
    """(3, T, H, W) -> (3, T, g*f, g*f): a g x g grid of f x f patches at the cells' centres."""
    g, f = cfg.fragments, cfg.fragment_size
    c, t, h, w = video.shape
    ratio = min(h / (g * f), w / (g * f))
    if ratio < 1:  # too small for the grid: upsample, as DOVER does
        video = F.interpolate(video, scale_factor=1 / ratio, mode="bilinear", align_corners=False)
        c, t, h, w = video.shape
    out = torch.empty(c, t, g * f, g * f, dtype=video.dtype)
    ch, cw = h // g, w // g
    for i in range(g):
        for j in range(g):
            y = min(i * ch + max(ch - f, 0) // 2, h - f)
            x = min(j * cw + max(cw - f, 0) // 2, w - f)
            out[:, :, i * f:(i + 1) * f, j * f:(j + 1) * f] = video[:, :, y:y + f, x:x + f]
    return out


def views(video: torch.Tensor, cfg: ViewConfig = ViewConfig()) -> dict[str, torch.Tensor]:
    """A video (T, 3, H, W) in [0, 1] -> {"technical", "aesthetic"}: (1, 3, clip_len, 224, 224) each."""
    idx = sample_frames(video.shape[0], cfg)
    clip = normalise(video[idx].permute(1, 0, 2, 3))  # (3, T, H, W)
    tech = fragments(clip, cfg)
    aes = F.interpolate(clip, size=(cfg.aesthetic_size, cfg.aesthetic_size), mode="bilinear", align_corners=False)
    return {"technical": tech[None], "aesthetic": aes[None]}


class LayerNormChannelsFirst(nn.Module):
    """LayerNorm over dim 1 of (B, C, T, H, W)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        return F.layer_norm(x.movedim(1, -1), (x.shape[1],), self.weight, self.bias, self.eps).movedim(-1, 1)


class ConvNeXtBlock3D(nn.Module):
    """Depthwise (t, 7, 7) conv, LayerNorm, 4x MLP with GELU, layer scale, residual."""

    def __init__(self, dim: int, inflate_len: int = 3):
        super().__init__()
        self.dwconv = nn.Conv3d(dim, dim, kernel_size=(inflate_len, 7, 7), padding=(inflate_len // 2, 3, 3),
                                groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):  # (B, C, T, H, W)
        y = self.dwconv(x).movedim(1, -1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y)))) * self.gamma
        return x + y.movedim(-1, 1)


class ConvNeXt3D(nn.Module):
    """ConvNeXt inflated to video: (B, 3, T, H, W) -> (B, dims[-1], T/2, H/32, W/32), LayerNorm'd.

    Block j of a stage has a temporal kernel of ``inflate[j % 3]`` (DOVER's strategy "131"); module
    names follow DOVER's ``conv_backbone.ConvNeXt3D`` so its state dict loads.
    """

    def __init__(self, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), inflate: str = "131"):
        super().__init__()
        self.downsample_layers = nn.ModuleList([nn.Sequential(
            nn.Conv3d(3, dims[0], kernel_size=(2, 4, 4), stride=(2, 4, 4)), LayerNormChannelsFirst(dims[0]))])
        for i in range(3):
            self.downsample_layers.append(nn.Sequential(
                LayerNormChannelsFirst(dims[i]),
                nn.Conv3d(dims[i], dims[i + 1], kernel_size=(1, 2, 2), stride=(1, 2, 2))))
        self.stages = nn.ModuleList([nn.Sequential(*[ConvNeXtBlock3D(d, int(inflate[j % len(inflate)]))
                                                     for j in range(n)]) for n, d in zip(depths, dims)])
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.out_channels = dims[-1]

    def forward(self, x):
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


class VQAHead(nn.Module):
    """1x1x1 Conv3d -> GELU -> 1x1x1 Conv3d (in -> hidden -> 1) on a feature map."""

    def __init__(self, in_channels: int = 768, hidden_channels: int = 64):
        super().__init__()
        self.fc_hid = nn.Conv3d(in_channels, hidden_channels, 1)
        self.fc_last = nn.Conv3d(hidden_channels, 1, 1)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.fc_last(self.gelu(self.fc_hid(x)))


@dataclass
class DoverScores:
    technical_raw: float
    aesthetic_raw: float

    @property
    def vqa_t(self) -> float:
        return 100.0 / (1.0 + math.exp(-(self.technical_raw - TECH_MEAN) / TECH_STD))

    @property
    def vqa_a(self) -> float:
        return 100.0 / (1.0 + math.exp(-(self.aesthetic_raw - AES_MEAN) / AES_STD))

    @property
    def overall(self) -> float:
        x = FUSE_TECH * (self.technical_raw - TECH_MEAN) / TECH_STD + FUSE_AES * (self.aesthetic_raw - AES_MEAN) / AES_STD
        return 1.0 / (1.0 + math.exp(-x))


class Dover(nn.Module):
    """Two branches (technical on fragments, aesthetic on the resized view), one VQAHead each."""

    def __init__(self, technical: nn.Module, aesthetic: nn.Module, hidden: int = 64,
                 cfg: ViewConfig = ViewConfig()):
        super().__init__()
        self.technical_backbone, self.aesthetic_backbone = technical, aesthetic
        self.technical_head = VQAHead(technical.out_channels, hidden)
        self.aesthetic_head = VQAHead(aesthetic.out_channels, hidden)
        self.cfg = cfg

    @classmethod
    def from_checkpoint(cls, path: Optional[str] = None) -> "Dover":
        resolve(DOVER, path)  # names the missing file first
        raise NotImplementedError(
            "DOVER's technical backbone (Video Swin-T with gated relative position bias) is not ported yet; "
            "VQA-a / VQA-t need it to load DOVER.pth")

    @torch.no_grad()
    def forward(self, v: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """views -> (technical score map, aesthetic score map), each (B, 1, T', H', W')."""
        t = self.technical_head(self.technical_backbone(v["technical"]))
        a = self.aesthetic_head(self.aesthetic_backbone(v["aesthetic"]))
        return t, a

    def score(self, video: torch.Tensor) -> DoverScores:
        """A video (T, 3, H, W) in [0, 1] -> raw and normalised scores."""
        dev = next(self.parameters()).device
        t, a = self({k: x.to(dev) for k, x in views(video, self.cfg).items()})
        return DoverScores(float(t.mean()), float(a.mean()))


TINY_VIEWS = ViewConfig(fragments=4, fragment_size=16, aesthetic_size=64, clip_len=8, aligned=8)


def tiny_dover(seed: int = 0, cfg: ViewConfig = TINY_VIEWS) -> Dover:
    """Random DOVER with tiny ConvNeXt3D branches (one block per stage, widths 8-64) and small views
    (4 x 4 fragments of 16 pixels, 64-pixel aesthetic view, 8-frame clips), for offline tests."""
    torch.manual_seed(seed)
    small = dict(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64))
    return Dover(ConvNeXt3D(**small), ConvNeXt3D(**small), hidden=8, cfg=cfg).eval()
