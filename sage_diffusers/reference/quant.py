"""Reference quantizers and their storage format, shared with the CUDA kernels.

Formats
-------
NVFP4  : E2M1 codes packed two per byte (element 2j in the low nibble) + one float8_e4m3fn scale
         per 16 consecutive elements along ``dim``; scale = E4M3(absmax / 6).
MXFP4  : the same codes + one E8M0 scale (uint8 biased exponent, value 2**(e - 127)) per 32
         elements; exponent = floor(log2(absmax)) - 2 as in the OCP MX specification.
INT8   : symmetric, scale = absmax / 127, per token or per block of tokens.
FP8    : float8_e4m3fn, scale = absmax / 448 per channel.
A block of zeros gets scale 0 and decodes to zeros, never NaN.

Every amax is taken over the finite values only (:func:`finite_abs`), so one NaN/Inf cannot
change the scale of the finite values around it; a NaN element itself gets code 0.

FP4 tensor scale (:func:`fp4_tensor_scale`): SageAttention3 pairs the block scales with one FP32
scale per (batch, head), s = amax / (448 * 6), so that x / s fills the E4M3 x E2M1 range whatever
the magnitude of x.
"""
from __future__ import annotations

import torch

from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    INT8_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    pack_nibbles,
    unpack_nibbles,
)

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127
FP4_TENSOR_RANGE = E4M3_MAX * E2M1_MAX  # 2688: largest block scale times largest E2M1 value


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c with IEEE division, as the kernels' ``a / 127.f``.

    torch turns division by a Python scalar into a multiplication by its rounded reciprocal,
    which differs in the last bit for some inputs; dividing by a full tensor does not.
    """
    return x / torch.full_like(x, c)


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf replaced by 0: what every amax of the quantizers looks at."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))


def fp4_tensor_scale(x: torch.Tensor, dims: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    """Per-tensor FP32 scale of the FP4 path: amax over finite |x| / (448 * 6), 1 where that amax is 0.

    x : float (B, H, S, D) (any shape with ``dims``). Returns float32 with ``dims`` kept as size 1
    ((B, H, 1, 1) by default). The quantized operand is then ``x / s`` (IEEE division, a full
    tensor divisor) and its dequantized value is multiplied by ``s`` again.
    """
    amax = finite_abs(x.float()).amax(dims, keepdim=True)
    return torch.where(amax > 0, _div(amax, FP4_TENSOR_RANGE), torch.ones_like(amax))


def _blocks_last(x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """Move ``dim`` last and split it into blocks: [..., n] -> float32 [..., n/block, block]."""
    x = x.float().movedim(dim, -1)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"quantized dim must be a multiple of {block}, got length {n}")
    return x.reshape(*x.shape[:-1], n // block, block)


def _encode_blocks(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Divide blocks [..., nb, blk] by their float32 scales [..., nb] and pack E2M1 codes.

    Returns uint8 [..., nb * blk / 2]. A zero scale gives zero codes.
    """
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # [..., nb]
    scaled = torch.where(scale[..., None] > 0, blocks / safe[..., None], torch.zeros_like(blocks))
    codes = e2m1_encode(scaled).flatten(-2)  # uint8 [..., n]
    return pack_nibbles(codes)


def quantize_nvfp4(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization along ``dim``.

    x : float [..., n, ...] with n % 16 == 0 at ``dim``.
    Returns packed uint8 (n/2 at ``dim``) and scales float8_e4m3fn (n/16 at ``dim``).
    """
    blocks = _blocks_last(x, dim, NVFP4_BLOCK)  # float32 [..., n/16, 16]
    scale = e4m3_round(_div(finite_abs(blocks).amax(-1), E2M1_MAX))  # e4m3 [..., n/16]
    packed = _encode_blocks(blocks, scale.float())  # uint8 [..., n/2]
    return packed.movedim(-1, dim), scale.movedim(-1, dim)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: -> float32 with n = 2 * packed.shape[dim] at ``dim``."""
    codes = unpack_nibbles(packed.movedim(dim, -1))  # uint8 [..., n]
    vals = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK))  # [..., n/16, 16]
    out = vals * scales.movedim(dim, -1).float()[..., None]
    return out.flatten(-2).movedim(-1, dim)


def quantize_mxfp4(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quantization along ``dim`` (OCP MX v1.0: E2M1 elements, E8M0 scale per 32).

    Returns packed uint8 (n/2 at ``dim``) and biased exponents uint8 (n/32 at ``dim``).
    """
    blocks = _blocks_last(x, dim, MXFP4_BLOCK)  # float32 [..., n/32, 32]
    amax = finite_abs(blocks).amax(-1)  # [..., n/32]
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = (exp - 1 - 2).clamp(-E8M0_BIAS, E8M0_BIAS)  # E2M1's largest exponent is 2
    biased = torch.where(amax > 0, shared + E8M0_BIAS, torch.zeros_like(shared)).to(torch.uint8)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), shared.float()), torch.zeros_like(amax))
    packed = _encode_blocks(blocks, scale)
    return packed.movedim(-1, dim), biased.movedim(-1, dim)


def dequantize_mxfp4(packed: torch.Tensor, exps: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: -> float32."""
    codes = unpack_nibbles(packed.movedim(dim, -1))  # uint8 [..., n]
    vals = e2m1_decode(codes).unflatten(-1, (-1, MXFP4_BLOCK))  # [..., n/32, 32]
    e = exps.movedim(dim, -1).float() - E8M0_BIAS  # [..., n/32]
    out = vals * torch.ldexp(torch.ones_like(e), e)[..., None]
    return out.flatten(-2).movedim(-1, dim)


def _int8_from_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float32 [...], scale broadcastable float32 -> int8 [...] (round half to even, clamp +-127)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe).clamp(-INT8_MAX, INT8_MAX)  # +-Inf saturates at +-127
    return torch.where((scale > 0) & ~torch.isnan(q), q, torch.zeros_like(q)).to(torch.int8)  # NaN -> 0


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., S, D] -> (int8 [..., S, D], float32 scale [..., S]); scale = absmax / 127."""
    x = x.float()
    scale = _div(finite_abs(x).amax(-1), INT8_MAX)  # [..., S]
    return _int8_from_scale(x, scale[..., None]), scale


def quantize_int8_per_block(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., S, D] -> (int8 [..., S, D], float32 scale [..., ceil(S / block)]).

    Block t covers tokens block*t .. block*t + block - 1 (the last one may be shorter).
    """
    x = x.float()
    s = x.shape[-2]
    nb = -(-s // block)
    pad = nb * block - s
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad))  # [..., nb*block, D], zeros change no absmax
    amax = finite_abs(padded.unflatten(-2, (nb, block))).amax((-1, -2))  # [..., nb]
    scale = _div(amax, INT8_MAX)
    per_token = scale.repeat_interleave(block, dim=-1)[..., :s]  # [..., S]
    return _int8_from_scale(x, per_token[..., None]), scale


def quantize_fp8_per_channel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., S, D] -> (float8_e4m3fn [..., S, D], float32 scale [..., D]); absmax over S / 448."""
    x = x.float()
    scale = _div(finite_abs(x).amax(-2), E4M3_MAX)  # [..., D]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = e4m3_round(torch.where(scale[..., None, :] > 0, x / safe[..., None, :], torch.zeros_like(x)))
    return q, scale
