"""FScore: mean optical-flow magnitude between consecutive frames (EvalCrafter's flow score).

FScore(video) = mean over t of mean over pixels of |flow(frame_t -> frame_t+1)| (pixels per frame).

The flow estimator is pluggable (``FlowEstimator``: two frame batches in, flow out):

- ``RaftFlow``: torchvision's RAFT-large (the paper's estimator), weights from a local file; raises a
  clear ``ImportError`` where torchvision does not import (e.g. PyPI's CUDA torchvision beside a CPU
  torch);
- ``PhaseCorrelationFlow``: one global translation per frame pair by phase correlation (exact for
  circular integer shifts), for tests and sanity checks without network weights.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from .. import _cli
from .weights import RAFT, resolve


class FlowEstimator(Protocol):
    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Frames a, b (N, 3, H, W) in [0, 1] -> flow (N, 2, H, W) in pixels (x, y), a -> b."""
        ...


def fscore(video: torch.Tensor, flow: FlowEstimator, batch: int = 8) -> float:
    """Mean flow magnitude of a video (T >= 2, 3, H, W) in [0, 1]."""
    if video.ndim != 4 or video.shape[0] < 2:
        raise ValueError(f"video must be (T >= 2, 3, H, W), got {tuple(video.shape)}")
    total, count = 0.0, 0
    for i in range(0, video.shape[0] - 1, batch):
        a = video[i:min(i + batch, video.shape[0] - 1)]
        b = video[i + 1:i + 1 + a.shape[0]]
        f = flow(a, b)  # (n, 2, H, W)
        total += float(f.double().norm(dim=1).mean(dim=(1, 2)).sum())
        count += a.shape[0]
    return total / count


class PhaseCorrelationFlow:
    """Global translation flow by phase correlation (constant flow field per frame pair)."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ga, gb = a.double().mean(1), b.double().mean(1)  # (N, H, W) grey
        fa, fb = torch.fft.fft2(ga - ga.mean((-2, -1), keepdim=True)), torch.fft.fft2(gb - gb.mean((-2, -1), keepdim=True))
        cross = fb * fa.conj()
        corr = torch.fft.ifft2(cross / cross.abs().clamp_min(1e-12)).real  # peak at the shift a -> b
        n, h, w = corr.shape
        idx = corr.flatten(1).argmax(1)
        dy, dx = idx // w, idx % w
        dy = torch.where(dy > h // 2, dy - h, dy).to(a.dtype)
        dx = torch.where(dx > w // 2, dx - w, dx).to(a.dtype)
        return torch.stack([dx, dy], 1)[:, :, None, None].expand(n, 2, h, w)


class RaftFlow:
    """torchvision RAFT-large with weights from a local ``.pth`` (Raft_Large_Weights.C_T_SKHT_V2)."""

    def __init__(self, weights: Optional[str] = None, device: str = "cpu", iters: int = 20):
        path = resolve(RAFT, weights)
        state = _cli.load_state_dict(path, "weights 'raft'")
        try:
            from torchvision.models.optical_flow import raft_large
        except Exception as e:  # noqa: BLE001 - torchvision fails in several ways against a mismatched torch
            raise ImportError(f"FScore needs torchvision's RAFT (pip install torchvision matching your torch): {e}") from e
        self.model = raft_large(weights=None, progress=False)
        try:
            self.model.load_state_dict(state)
        except RuntimeError as e:  # missing, unexpected or misshapen keys: not RAFT-large's weights
            raise _cli.InputError(f"weights 'raft' {path}: not the state dict of torchvision's raft_large "
                                  f"({str(e).splitlines()[0]})") from None
        self.model.eval().to(device)
        self.device, self.iters = device, iters

    @torch.no_grad()
    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h, w = a.shape[-2:]
        ph, pw = (-h) % 8, (-w) % 8  # RAFT needs sizes divisible by 8
        pad = torch.nn.functional.pad
        x = pad(a.float() * 2 - 1, (0, pw, 0, ph), mode="replicate").to(self.device)
        y = pad(b.float() * 2 - 1, (0, pw, 0, ph), mode="replicate").to(self.device)
        flow = self.model(x, y, num_flow_updates=self.iters)[-1]
        return flow[..., :h, :w].cpu()


def translating_video(frames: int, h: int, w: int, dx: int, dy: int, seed: int = 0) -> torch.Tensor:
    """A smooth random texture moved by (dx, dy) pixels per frame (circular): (T, 3, H, W) in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 3, h // 4, w // 4, generator=g)
    base = torch.nn.functional.interpolate(base, size=(h, w), mode="bicubic", align_corners=False).clamp(0, 1)[0]
    return torch.stack([torch.roll(base, shifts=(t * dy, t * dx), dims=(1, 2)) for t in range(frames)])
