"""Independent encoders of the storage formats, written from the format definitions with numpy and ml_dtypes.

They share no code with ``sage_diffusers.reference``: element rounding comes from ml_dtypes' casts
(round to nearest even), saturation is an explicit clip, scales are IEEE float32 divisions in numpy,
nibble packing is written out byte by byte. Tests compare the project's quantizers with these byte
for byte, so a change in any storage byte (packed code, block scale, exponent) is caught.

All functions take float32 numpy arrays with the quantized axis last and return numpy arrays.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FP4_MAX = F32(6.0)  # largest E2M1 magnitude
FP8_MAX = F32(448.0)  # largest finite E4M3 magnitude
I8_MAX = F32(127.0)
NV_BLOCK, MX_BLOCK = 16, 32
TENSOR_RANGE = F32(448.0 * 6.0)  # a per-tensor FP4 scale maps the amax to E4M3_max * E2M1_max


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 E2M1 codes [...] (sign bit 3), nearest-even, saturating at +-6."""
    clipped = np.clip(x, -FP4_MAX, FP4_MAX).astype(F32)
    return clipped.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F


def e4m3_bytes(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 E4M3 bit patterns [...], nearest-even, saturating at +-448."""
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_value(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.float8_e4m3fn).astype(F32)


def pack(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., n] -> bytes [..., n/2]: byte j = code[2j] | code[2j+1] << 4."""
    out = np.zeros(codes.shape[:-1] + (codes.shape[-1] // 2,), dtype=np.uint8)
    for j in range(out.shape[-1]):
        out[..., j] = (codes[..., 2 * j] & 0xF) | ((codes[..., 2 * j + 1] & 0xF) << 4)
    return out


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    return x.astype(F32).reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _codes_with_scale(blocks: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """blocks [..., nb, blk] / scale [..., nb] (IEEE) -> packed bytes [..., n/2]; scale 0 -> code 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = blocks / scale[..., None]
    codes = np.where(scale[..., None] > 0, e2m1_codes(np.nan_to_num(ratio)), np.uint8(0))
    return pack(codes.reshape(codes.shape[:-2] + (-1,)).astype(np.uint8))


def nvfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 along the last axis: (packed uint8 [..., n/2], E4M3 scale bytes [..., n/16]).

    Block scale = E4M3(absmax / 6) (IEEE division, then nearest-even with saturation).
    """
    blocks = _blocks(x, NV_BLOCK)
    scale_bits = e4m3_bytes(np.abs(blocks).max(-1) / FP4_MAX)
    return _codes_with_scale(blocks, e4m3_value(scale_bits)), scale_bits


def mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 (OCP MX v1.0) along the last axis: (packed uint8 [..., n/2], E8M0 bytes [..., n/32]).

    Shared exponent = floor(log2(absmax)) - 2 (E2M1's largest exponent), clamped to E8M0's range;
    an all-zero block stores exponent byte 0 and zero codes.
    """
    blocks = _blocks(x, MX_BLOCK)
    amax = np.abs(blocks).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        shared = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127, 127)
    scale = np.where(amax > 0, np.exp2(shared), 0.0)  # exact powers of two
    e8m0 = np.where(amax > 0, scale.astype(F32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8), np.uint8(0))
    return _codes_with_scale(blocks, scale.astype(F32)), e8m0.astype(np.uint8)


def int8_with_scale(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """round-half-even(x / scale) clipped to +-127 as int8; scale broadcastable, 0 -> code 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x.astype(F32) / scale.astype(F32))
    return np.where(scale > 0, np.clip(np.nan_to_num(q), -I8_MAX, I8_MAX), 0).astype(np.int8)


def int8_per_token(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., S, D] -> (int8 [..., S, D], float32 scale [..., S] = absmax over D / 127, IEEE)."""
    scale = (np.abs(x.astype(F32)).max(-1) / I8_MAX).astype(F32)
    return int8_with_scale(x, scale[..., None]), scale


def int8_per_block(x: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """x [..., S, D] -> (int8 [..., S, D], float32 scale [..., ceil(S/block)]); the last block is short."""
    s = x.shape[-2]
    starts = range(0, s, block)
    scale = np.stack([np.abs(x[..., i:i + block, :].astype(F32)).max((-1, -2)) / I8_MAX for i in starts], -1).astype(F32)
    per_token = np.repeat(scale, block, axis=-1)[..., :s]
    return int8_with_scale(x, per_token[..., None]), scale


def fp8_per_channel(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., S, D] -> (E4M3 bytes [..., S, D], float32 scale [..., D] = absmax over S / 448, IEEE)."""
    scale = (np.abs(x.astype(F32)).max(-2) / FP8_MAX).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.nan_to_num(x.astype(F32) / scale[..., None, :])
    return np.where(scale[..., None, :] > 0, e4m3_bytes(ratio), np.uint8(0)), scale


def tensor_scale(x: np.ndarray, axes) -> np.ndarray:
    """Per-tensor FP4 scale over ``axes``: amax of the finite |x| / (448 * 6), 1 where that amax is 0."""
    finite = np.where(np.isfinite(x), np.abs(x.astype(F32)), F32(0))
    amax = finite.max(axis=axes, keepdims=True)
    return np.where(amax > 0, amax / TENSOR_RANGE, F32(1)).astype(F32)


# --- decoders (exact: every FP4 value times a power of two or an E4M3 value is a float32) -----------
E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=F32)


def unpack(packed: np.ndarray) -> np.ndarray:
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def nvfp4_decode(packed: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    vals = E2M1_TABLE[unpack(packed)].reshape(packed.shape[:-1] + (-1, NV_BLOCK))
    return (vals * e4m3_value(scale_bits)[..., None]).reshape(packed.shape[:-1] + (-1,))


def mxfp4_decode(packed: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    vals = E2M1_TABLE[unpack(packed)].reshape(packed.shape[:-1] + (-1, MX_BLOCK))
    scale = np.exp2(e8m0.astype(np.float64) - 127)  # byte 0 is 2**-127; zero blocks have zero codes
    return (vals * scale[..., None]).reshape(packed.shape[:-1] + (-1,))
