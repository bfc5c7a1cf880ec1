"""DOVER (Wu et al., ICCV 2023) video quality: VQA-t (technical) and VQA-a (aesthetic), inference only.

DOVER is not on PyPI, so this is a port written from the public description, configuration
(``dover.yml``) and model code of the reference repository (VQAssessment/DOVER); weights come from its
released ``DOVER.pth`` (local path; ``Dover.from_checkpoint``).

- views: technical = spatial fragments, a 7 x 7 grid of 32 x 32 patches (224 x 224), the same patch
  positions for every aligned group of 32 frames, the video upsampled bilinearly first when its short
  side is below 224; 3 clips of 32 frames at interval 2 (evenly spaced starts), looping over short
  videos. Aesthetic = 32 frames spread uniformly over the video (segment centres), resized to 224 x 224.
  Deviations: DOVER draws fragment offsets inside their grid cells and clip starts at random; here they
  are deterministic (cell centres, evenly spaced starts), so scores are repeatable.
- normalisation: pixels in [0, 255], mean (123.675, 116.28, 103.53), std (58.395, 57.12, 57.375).
- backbones: technical ``swin_tiny_grpb`` = Video Swin-T (patch 2x4x4, windows 8x7x7, depths 2/2/6/2)
  with DOVER's gated fragment position bias in the first three stages (``SwinTransformer3D``);
  aesthetic ``conv_tiny`` = ConvNeXt-T inflated to 3D (``ConvNeXt3D``). Module names follow DOVER's,
  so its state dict loads unchanged.
- heads (``VQAHead``): 1x1x1 Conv3d in -> 64, GELU, 1x1x1 Conv3d 64 -> 1 on the backbone's feature
  map (dropout is off at inference); a branch's raw score is the mean of its map over clips.
- scores reported here: VQA-t = 100 * sigmoid((t - 0.1107) / 0.07355), VQA-a = 100 * sigmoid((a -
  0.08285) / 0.03774), i.e. each raw score standardised with the constants of DOVER's own score fusion
  (its overall score is sigmoid(0.6104 * t' + 0.3896 * a') with t', a' those standardised scores, also
  returned). EvalCrafter rescales differently; compare numbers only within one convention.

Not verified against the released weights here (none can be downloaded): the port is checked for
shapes, normalisation and its building blocks on tiny random instances (``tiny_dover``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _cli
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
    technical_clips: int = 3  # clips of the technical view, averaged (dover.yml num_clips)


def sample_frames(t: int, cfg: ViewConfig, clip: int = 0, clips: int = 1) -> torch.Tensor:
    """Frame indices of clip ``clip`` of ``clips``: ``clip_len`` frames at ``frame_interval`` from an
    evenly spaced start, looping past the end of short videos."""
    start = (clip * t) // clips
    return (start + torch.arange(cfg.clip_len) * cfg.frame_interval) % t


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
    """A video (T, 3, H, W) in [0, 1] -> {"technical": (clips, 3, clip_len, g*f, g*f), "aesthetic":
    (1, 3, clip_len, 224, 224)}, normalised."""
    tech = []
    for c in range(cfg.technical_clips):
        clip = normalise(video[sample_frames(video.shape[0], cfg, c, cfg.technical_clips)].permute(1, 0, 2, 3))
        tech.append(fragments(clip, cfg))
    t = video.shape[0]
    spread = ((torch.arange(cfg.clip_len) + 0.5) * t / cfg.clip_len).long().clamp_max(t - 1)
    clip = normalise(video[spread].permute(1, 0, 2, 3))  # (3, T, H, W), frames spread over the video
    aes = F.interpolate(clip, size=(cfg.aesthetic_size, cfg.aesthetic_size), mode="bilinear", align_corners=False)
    return {"technical": torch.stack(tech), "aesthetic": aes[None]}


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


def _window_partition(x: torch.Tensor, ws: tuple[int, int, int]) -> torch.Tensor:
    """(B, D, H, W, C) -> (B * nW, wd * wh * ww, C), windows in (d, h, w) order."""
    b, d, h, w, c = x.shape
    x = x.view(b, d // ws[0], ws[0], h // ws[1], ws[1], w // ws[2], ws[2], c)
    return x.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, ws[0] * ws[1] * ws[2], c)


def _window_reverse(windows: torch.Tensor, ws: tuple[int, int, int], b: int, d: int, h: int, w: int) -> torch.Tensor:
    x = windows.view(b, d // ws[0], h // ws[1], w // ws[2], ws[0], ws[1], ws[2], -1)
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, d, h, w, -1)


def _clamp_window(size, window, shift):
    """Windows no larger than the feature map; no shift along a dim the window covers whole."""
    ws, ss = list(window), list(shift)
    for i, n in enumerate(size):
        if n <= window[i]:
            ws[i], ss[i] = n, 0
    return tuple(ws), tuple(ss)


def _shift_mask(d: int, h: int, w: int, ws, ss, device) -> torch.Tensor:
    """(nW, N, N) additive mask (0 / -100) keeping shifted windows from mixing wrapped regions."""
    img = torch.zeros(1, d, h, w, 1, device=device)
    cnt = 0
    for sd in (slice(-ws[0]), slice(-ws[0], -ss[0]), slice(-ss[0], None)):
        for sh in (slice(-ws[1]), slice(-ws[1], -ss[1]), slice(-ss[1], None)):
            for sw in (slice(-ws[2]), slice(-ws[2], -ss[2]), slice(-ss[2], None)):
                img[:, sd, sh, sw, :] = cnt
                cnt += 1
    win = _window_partition(img, ws).squeeze(-1)  # (nW, N)
    diff = win[:, None, :] - win[:, :, None]
    return torch.where(diff != 0, torch.full_like(diff, -100.0), torch.zeros_like(diff))


def _fragment_gate(d: int, h: int, w: int, ws, ss, device) -> torch.Tensor:
    """(nW, N, N) L1 distance between the fragment indices of two tokens of a window.

    Fragments: a (1, wh, ww) grid stretched (nearest) over the feature map, i.e. the 7 x 7 grid
    of DOVER's fragment sampler; 0 = same fragment (the gated bias uses the fragment table there).
    """
    grid = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(ws[1]), torch.arange(ws[2]), indexing="ij"))
    coords = F.interpolate(grid[None].float().to(device), size=(d, h, w)).long().permute(0, 2, 3, 4, 1)
    coords = torch.roll(coords, shifts=(-ss[0], -ss[1], -ss[2]), dims=(1, 2, 3))
    win = _window_partition(coords, ws)  # (nW, N, 3)
    return (win[:, None, :] - win[:, :, None]).abs().sum(-1).float()


class WindowAttention3D(nn.Module):
    """Window attention with a relative position bias table and, with ``frag_bias``, DOVER's gated
    fragment table: bias = rel * g + frag * (1 - g), g the fragment distance of the two tokens."""

    def __init__(self, dim: int, window: tuple[int, int, int], heads: int, frag_bias: bool):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        size = (2 * window[0] - 1) * (2 * window[1] - 1) * (2 * window[2] - 1)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(size, heads))
        if frag_bias:
            self.fragment_position_bias_table = nn.Parameter(torch.zeros(size, heads))
        c = torch.stack(torch.meshgrid(*[torch.arange(n) for n in window], indexing="ij")).flatten(1)  # (3, N)
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0)  # (N, N, 3)
        rel = rel + torch.tensor([window[0] - 1, window[1] - 1, window[2] - 1])
        index = rel[..., 0] * (2 * window[1] - 1) * (2 * window[2] - 1) + rel[..., 1] * (2 * window[2] - 1) + rel[..., 2]
        self.register_buffer("relative_position_index", index)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask, gate):  # x (B*nW, N, C); mask, gate (nW, N, N) or mask None
        bw, n, c = x.shape
        q, k, v = self.qkv(x).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B*nW, nH, N, N)
        idx = self.relative_position_index[:n, :n].reshape(-1)  # clamped windows use the top-left block
        rel = self.relative_position_bias_table[idx].reshape(n, n, -1).permute(2, 0, 1)[None]  # (1, nH, N, N)
        nw = gate.shape[0]
        if hasattr(self, "fragment_position_bias_table"):
            frag = self.fragment_position_bias_table[idx].reshape(n, n, -1).permute(2, 0, 1)[None]
            g = gate[:, None]  # (nW, 1, N, N)
            rel = rel * g + frag * (1 - g)
        attn = attn.view(bw // nw, nw, self.heads, n, n) + rel[None]
        if mask is not None:
            attn = attn + mask[None, :, None]
        attn = attn.view(bw, self.heads, n, n).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(bw, n, c))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SwinBlock3D(nn.Module):
    def __init__(self, dim: int, heads: int, window, shift, frag_bias: bool):
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention3D(dim, window, heads, frag_bias)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _Mlp(dim, 4 * dim)

    def forward(self, x):  # (B, D, H, W, C)
        b, d, h, w, c = x.shape
        ws, ss = _clamp_window((d, h, w), self.window, self.shift)
        y = self.norm1(x)
        pads = [(ws[i] - n % ws[i]) % ws[i] for i, n in enumerate((d, h, w))]
        y = F.pad(y, (0, 0, 0, pads[2], 0, pads[1], 0, pads[0]))
        dp, hp, wp = y.shape[1:4]
        shifted = any(s > 0 for s in ss)
        if shifted:
            y = torch.roll(y, shifts=(-ss[0], -ss[1], -ss[2]), dims=(1, 2, 3))
        mask = _shift_mask(dp, hp, wp, ws, ss, x.device) if shifted else None
        gate = _fragment_gate(dp, hp, wp, ws, ss, x.device)
        y = _window_reverse(self.attn(_window_partition(y, ws), mask, gate), ws, b, dp, hp, wp)
        if shifted:
            y = torch.roll(y, shifts=ss, dims=(1, 2, 3))
        x = x + y[:, :d, :h, :w]
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x):  # (B, D, H, W, C) -> (B, D, H/2, W/2, 2C)
        h, w = x.shape[2:4]
        if h % 2 or w % 2:
            x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        x = torch.cat([x[:, :, 0::2, 0::2], x[:, :, 1::2, 0::2], x[:, :, 0::2, 1::2], x[:, :, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x))


class _SwinStage(nn.Module):
    def __init__(self, dim, depth, heads, window, frag_bias, downsample: bool):
        super().__init__()
        shift = tuple(i // 2 for i in window)
        self.blocks = nn.ModuleList([SwinBlock3D(dim, heads, window, (0, 0, 0) if i % 2 == 0 else shift, frag_bias)
                                     for i in range(depth)])
        self.downsample = PatchMerging(dim) if downsample else None

    def forward(self, x):  # (B, C, D, H, W)
        x = x.permute(0, 2, 3, 4, 1)
        for blk in self.blocks:
            x = blk(x)
        if self.downsample is not None:
            x = self.downsample(x)
        return x.permute(0, 4, 1, 2, 3)


class _PatchEmbed3D(nn.Module):
    def __init__(self, patch, dim):
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv3d(3, dim, kernel_size=patch, stride=patch)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        d, h, w = x.shape[2:]
        x = F.pad(x, (0, (-w) % self.patch[2], 0, (-h) % self.patch[1], 0, (-d) % self.patch[0]))
        x = self.proj(x)
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


class SwinTransformer3D(nn.Module):
    """Video Swin-T with gated relative position bias (DOVER's ``swin_tiny_grpb``, FAST-VQA's backbone):
    (B, 3, T, H, W) -> (B, 768, T/2, H/32, W/32), LayerNorm'd. Patch 2 x 4 x 4, windows 8 x 7 x 7
    (shifted by half in odd blocks), fragment-gated bias in the first three stages. Module names
    follow DOVER's, so its state dict loads."""

    def __init__(self, embed_dim: int = 96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24), window=(8, 7, 7),
                 frag_biases=(True, True, True, False), patch=(2, 4, 4)):
        super().__init__()
        self.patch_embed = _PatchEmbed3D(patch, embed_dim)
        self.layers = nn.ModuleList([
            _SwinStage(embed_dim * 2 ** i, depths[i], heads[i], tuple(window), bool(frag_biases[i]), i < len(depths) - 1)
            for i in range(len(depths))])
        self.out_channels = embed_dim * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(self.out_channels)

    def forward(self, x):
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
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
        """DOVER with the released weights (``DOVER.pth``: a state dict with technical_/aesthetic_ keys).

        Raises
        ------
        FileNotFoundError when the file is not there; eval._cli.InputError naming the file when it is
        not a state dict that loads with ``weights_only=True`` or leaves weights of the model unset.
        """
        file = checkpoint_path(path)
        state = _cli.load_state_dict(file, "weights 'dover'")
        model = cls(SwinTransformer3D(), ConvNeXt3D()).eval()
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a key of the right name with the wrong shape
            raise _cli.InputError(f"weights 'dover' {file}: does not fit DOVER's modules "
                                  f"({str(e).splitlines()[-1].strip()})") from None
        # relative_position_index is a buffer rebuilt by the model, not a trained weight
        _cli.check_state_dict_keys(file, "weights 'dover'", missing, unexpected,
                                   ignore=lambda k: k.endswith("relative_position_index"))
        return model

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


def checkpoint_path(path: Optional[str] = None) -> Path:
    """The DOVER.pth file of ``path`` (the file, or a folder holding it), env or hub cache.

    Raises
    ------
    FileNotFoundError naming the missing file and where it comes from.
    """
    file = resolve(DOVER, path)
    if file.is_dir():
        file = file / "DOVER.pth"
    if not file.is_file():
        raise FileNotFoundError(f"weights 'dover': {file} is missing (from {DOVER.origin})")
    return file


TINY_VIEWS = ViewConfig(fragments=4, fragment_size=16, aesthetic_size=64, clip_len=8, aligned=8, technical_clips=2)


def tiny_dover(seed: int = 0, cfg: ViewConfig = TINY_VIEWS) -> Dover:
    """Random DOVER with a tiny Swin3D technical branch (width 8, windows 2 x 7 x 7) and a tiny ConvNeXt3D
    aesthetic branch, and small views (2 clips of 4 x 4 fragments of 16 pixels, 64-pixel aesthetic
    view, 8-frame clips), for offline tests."""
    torch.manual_seed(seed)
    swin = SwinTransformer3D(embed_dim=8, depths=(2, 2, 1, 1), heads=(1, 2, 2, 4), window=(2, 7, 7))
    conv = ConvNeXt3D(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64))
    for p in swin.parameters():  # bias tables start at zero: make them matter in tests
        if p.ndim == 2 and p.shape[0] > 100:
            torch.nn.init.normal_(p, std=0.5)
    return Dover(swin, conv, hidden=8, cfg=cfg).eval()
