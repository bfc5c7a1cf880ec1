"""Element formats: E2M1 (FP4), E4M3 (FP8) and E8M0 (power-of-two scales), in plain torch.

Rounding everywhere is round-to-nearest-even with saturation, the behaviour of the hardware
conversions (`cvt.rn.satfinite.*`) that the kernels use, so kernels and references agree bit
for bit on the stored codes.
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
INT8_MAX = 127.0

# Magnitudes of the 8 non-negative E2M1 codes 0b000..0b111; code bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes (uint8 in 0..15), nearest-even, saturating at +-6.

    x : float32 [...]  ->  uint8 [...]; code = sign << 3 | magnitude index.
    A tie goes to the code whose last bit is 0 (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
    2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0); the sign is taken from signbit, so -0.1 encodes as -0.
    """
    a = x.abs()  # [...]
    # Each comparison passes one boundary between neighbouring codes; '>' at ties that round
    # down (to an even code below), '>=' at ties that round up (to an even code above).
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )  # uint8 [...], 0..7
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [...] (low 4 bits used) -> float32 [...]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]  # float32 [...]
    return torch.where((codes & 8) != 0, -mag, mag)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> float8_e4m3fn [...], nearest-even, saturating at +-448 (never NaN for finite x)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n/2]; element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n]; inverse of :func:`pack_nibbles`."""
    low = packed & 0x0F  # [..., n/2]
    high = packed >> 4  # [..., n/2]
    return torch.stack((low, high), dim=-1).flatten(-2)
