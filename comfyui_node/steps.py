"""Which sampling step a model call belongs to, and whether it runs at full precision.

ComfyUI puts two tensors into ``transformer_options`` for every model call made by a sampler
(comfy/samplers.py): ``"sample_sigmas"``, the whole schedule (steps + 1 values, descending, last
usually 0), and ``"sigmas"``, the noise level of this call, shape (B,). The step is the position of
``sigmas`` in ``sample_sigmas``; samplers that evaluate between two schedule points (Heun's second
order, DPM++ 2S midpoints) belong to the step whose interval contains them.

This module must not import ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# Relative tolerance when matching a sigma to the schedule: sigmas are recomputed in different
# dtypes along the way (float32 schedule, model-dtype timestep), so exact equality is fragile.
_REL_TOL = 1e-4


@dataclass(frozen=True)
class StepInfo:
    """Step ``index`` (0-based) of ``total`` steps."""

    index: int
    total: int


def locate_step(sigma: float, sample_sigmas: Sequence[float]) -> Optional[StepInfo]:
    """Find the step of noise level ``sigma`` in a descending schedule.

    Parameters
    ----------
    sigma : noise level of the current model call.
    sample_sigmas : the schedule, (steps + 1,) descending.

    Returns
    -------
    StepInfo, or None when the schedule is too short or ``sigma`` lies above its first value.
    """
    schedule = [float(s) for s in sample_sigmas]
    total = len(schedule) - 1
    if total < 1:
        return None
    tol = _REL_TOL * max(abs(sigma), 1e-12)
    at_or_above = sum(1 for s in schedule if s >= sigma - tol)
    if at_or_above == 0:
        return None
    return StepInfo(index=min(at_or_above - 1, total - 1), total=total)


def step_from_transformer_options(transformer_options: Optional[dict]) -> Optional[StepInfo]:
    """Read ``sigmas`` (B,) and ``sample_sigmas`` (steps + 1,) from ComfyUI's options; None if absent."""
    if not transformer_options:
        return None
    sigmas = transformer_options.get("sigmas")
    schedule = transformer_options.get("sample_sigmas")
    if not isinstance(sigmas, torch.Tensor) or not isinstance(schedule, torch.Tensor):
        return None
    if sigmas.numel() == 0 or schedule.dim() != 1:
        return None
    # Every sample of one call shares the step (cond and uncond are batched at one sigma); max is
    # robust should a caller ever mix them.
    sigma = float(sigmas.detach().float().max())
    return locate_step(sigma, schedule.detach().float().cpu().tolist())


@dataclass(frozen=True)
class StepPolicy:
    """Keep the first ``first`` and the last ``last`` sampling steps at full precision.

    Full precision means ComfyUI's own attention, exactly as without the node. The SageAttention3
    authors advise this for models whose quality drops with FP4 attention.
    """

    first: int = 0
    last: int = 0

    def __post_init__(self):
        for name in ("first", "last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"full-precision {name} steps: expected an integer >= 0, got {value!r}")

    @property
    def active(self) -> bool:
        return self.first > 0 or self.last > 0

    def full_precision(self, step: StepInfo) -> bool:
        return step.index < self.first or step.index >= step.total - self.last
