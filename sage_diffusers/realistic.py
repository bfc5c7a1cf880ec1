"""Attention inputs that look like what diffusion pipelines send, for the self-checks and the tests.

Plain N(0, 1) inputs hid real defects (NaN rows on sharp heads, crashes on inference tensors), so
every accuracy check of a kernel against its reference also runs on these. What they model:

- sharp heads: the scores of some DiT heads are tens of times larger than N(0, 1) inputs give
  (``logit_scale``, :data:`LOGIT_SCALES`); a tile's largest probability can then be 2^-100 of the
  row's running max, which is where an FP4 two-level factor underflows;
- per-channel offsets in Q, K and V (the common component SageAttention's smoothing removes);
- heavy tails: Student-t entries (3 degrees of freedom), a few tokens far outside the bulk;
- text padding: latent tokens then text tokens, the text's tail masked per sample (key mask);
- magnitudes x1e-4 ... x1e4 of the operands (V by the factor, Q and K by its square root each, so
  the scores scale by it: flat at x1e-4, extremely sharp at x1e4): what per-tensor scales absorb;
- NaN written at masked key positions (must never reach the output);
- tensors and masks created under ``torch.inference_mode()`` (ComfyUI runs every graph in it).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

# Multipliers of the scores of unit-variance q, k: 1/8 (a flat head) up to x400 (q and k each x20,
# the sharpest heads seen to break the FP4 two-level factor).
LOGIT_SCALES = (0.125, 1.0, 4.0, 20.0, 64.0, 400.0)
MAGNITUDES = (1e-4, 1.0, 1e4)
_T_DOF = 3  # Student-t degrees of freedom of the heavy tails (finite variance: sqrt(3))


class Inputs(NamedTuple):
    """BHSD q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D); key_mask bool (B, Skv) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_mask: Optional[torch.Tensor]


class Case(NamedTuple):
    """One named kind of realistic input (see :func:`realistic_qkv` for the fields)."""

    name: str
    logit_scale: float = 1.0
    heavy_tail: bool = False
    text_pad: float = 0.0
    magnitude: float = 1.0
    nan_masked: bool = False


# The cases every self-check and kernel-vs-reference test runs: each kind above at least once.
CASES = (
    Case("flat head x1/8", logit_scale=0.125),
    Case("sharp head x20, text padding", logit_scale=20.0, text_pad=0.3),
    Case("sharp head x64, heavy tails", logit_scale=64.0, heavy_tail=True),
    Case("sharp head x400", logit_scale=400.0),
    Case("x1e-4 operands, NaN in padding", magnitude=1e-4, text_pad=0.1, nan_masked=True),
    Case("x1e4 operands, heavy tails", magnitude=1e4, heavy_tail=True),
)


def _draw(shape, g: torch.Generator, heavy_tail: bool) -> torch.Tensor:
    if not heavy_tail:
        return torch.randn(shape, generator=g)
    # Student-t = normal / sqrt(chi2 / dof), scaled to unit variance.
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((_T_DOF, *shape), generator=g).pow(2).sum(0)
    return z / torch.sqrt(chi2 / _T_DOF) / math.sqrt(_T_DOF / (_T_DOF - 2))


def text_padding_mask(b: int, skv: int, text_pad: float, *, seed: int) -> Optional[torch.Tensor]:
    """bool (B, Skv), True = attended: the last ``text_pad`` fraction of keys are text tokens, and
    each sample masks a different tail of them (sample 0 keeps all its text, the last keeps none);
    None when ``text_pad`` is 0."""
    if text_pad <= 0:
        return None
    n_text = max(1, int(round(skv * text_pad)))
    keep = torch.ones(b, skv, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(b):
        frac = 1.0 if i == 0 else (0.0 if i == b - 1 else float(torch.rand((), generator=g)))
        keep[i, skv - n_text + int(round(frac * n_text)):] = False
    keep[:, 0] = True  # every sample keeps a latent token
    return keep


def realistic_qkv(b: int, hq: int, hkv: int, sq: int, skv: int, d: int, *, seed: int,
                  logit_scale: float = 1.0, heavy_tail: bool = False, text_pad: float = 0.0,
                  magnitude: float = 1.0, nan_masked: bool = False, dtype: torch.dtype = torch.bfloat16,
                  device="cpu", inference: bool = False) -> Inputs:
    """DiT-like attention inputs, BHSD.

    Parameters
    ----------
    logit_scale : the scores q.k / sqrt(D) are this many times those of the unit-variance draws
        (q and k each carry its square root).
    heavy_tail : Student-t entries instead of normal ones.
    text_pad : fraction of keys that are text tokens, masked per sample (:func:`text_padding_mask`).
    magnitude : v is multiplied by it, q and k by its square root (so the scores are too).
    nan_masked : NaN at every masked key position of k and v.
    inference : create every tensor (the mask too) under ``torch.inference_mode()``.

    Per-channel offsets are always present: per (head, channel) N(0, 1) for q, N(0, 4^2) for k
    (what K smoothing removes), N(0, 0.5^2) for v. Drawn on the CPU from ``seed``, then moved.
    """
    g = torch.Generator().manual_seed(seed)
    gain = math.sqrt(logit_scale)
    q = _draw((b, hq, sq, d), g, heavy_tail) + torch.randn(1, hq, 1, d, generator=g)
    k = _draw((b, hkv, skv, d), g, heavy_tail) + 4.0 * torch.randn(1, hkv, 1, d, generator=g)
    v = _draw((b, hkv, skv, d), g, heavy_tail) + 0.5 * torch.randn(1, hkv, 1, d, generator=g)
    # The offsets of q multiply k's zero-mean part: keep the scores' spread at logit_scale by
    # normalising q by its per-channel spread (about sqrt(2)). q and k carry sqrt(magnitude) each
    # (k / magnitude would overflow fp16 at x1e-4), so the scores scale by it too.
    root = math.sqrt(magnitude)
    q, k, v = q * (gain * root / math.sqrt(2.0)), k * (gain * root), v * magnitude
    mask = text_padding_mask(b, skv, text_pad, seed=seed)
    if nan_masked and mask is not None:
        hidden = ~mask[:, None, :, None]
        k, v = k.masked_fill(hidden, math.nan), v.masked_fill(hidden, math.nan)

    def make():
        # Saturate at the dtype's largest finite value: a heavy-tailed V x1e4 exceeds fp16's 65504,
        # and the cast would make it +-Inf (real fp16 activations are finite). copy=True: a new
        # tensor even where .to() would return its input, so under inference_mode every tensor
        # (the mask too) is an inference tensor.
        top = torch.finfo(dtype).max
        out = [t.clamp(-top, top).to(device=device, dtype=dtype, copy=True) for t in (q, k, v)]
        return Inputs(*out, None if mask is None else mask.to(device, copy=True))

    if inference:
        with torch.inference_mode():
            return make()
    return make()


def case_inputs(case: Case, b: int, hq: int, hkv: int, sq: int, skv: int, d: int, *, seed: int,
                dtype: torch.dtype = torch.bfloat16, device="cpu", inference: bool = False) -> Inputs:
    """:func:`realistic_qkv` with the fields of ``case``."""
    return realistic_qkv(b, hq, hkv, sq, skv, d, seed=seed, logit_scale=case.logit_scale,
                         heavy_tail=case.heavy_tail, text_pad=case.text_pad, magnitude=case.magnitude,
                         nan_masked=case.nan_masked, dtype=dtype, device=device, inference=inference)
