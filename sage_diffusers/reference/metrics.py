"""Accuracy metrics as defined in the SageAttention papers (flattened, float64)."""
from __future__ import annotations

import torch


def _flat(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    return a.detach().double().flatten(), b.detach().double().flatten()


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sum(O O') / (|O| |O'|); 1.0 for two all-zero tensors."""
    a, b = _flat(out, ref)
    denom = a.norm() * b.norm()
    if denom == 0:
        return 1.0 if a.abs().sum() == b.abs().sum() == 0 else 0.0
    return float((a @ b) / denom)


def relative_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sum |O - O'| / sum |O'| (O' the reference)."""
    a, b = _flat(out, ref)
    return float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-300))


def rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sqrt(mean((O - O')^2))."""
    a, b = _flat(out, ref)
    return float((a - b).pow(2).mean().sqrt())
