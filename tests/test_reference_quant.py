"""Quantizers: rounding against an independent implementation (ml_dtypes), storage format."""
import ml_dtypes
import numpy as np
import pytest
import torch

from sage_diffusers.reference import (
    E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    pack_nibbles,
    quantize_fp8_per_channel,
    quantize_int8_per_block,
    quantize_int8_per_token,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_nibbles,
)


def _e2m1_points() -> torch.Tensor:
    """Every representable E2M1 value, every midpoint, and points just either side of each."""
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids])
    eps = torch.cat([pts * (1 + 2**-20), pts * (1 - 2**-20), pts + 2**-24])
    pos = torch.cat([pts, eps]).clamp_max(6.0)
    return torch.cat([pos, -pos])


def test_e2m1_matches_ml_dtypes_at_values_and_midpoints():
    x = _e2m1_points()
    ours = e2m1_encode(x).numpy()
    theirs = x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    mismatch = np.nonzero(ours != theirs)[0]
    assert mismatch.size == 0, f"codes differ at {x[mismatch].tolist()}: ours {ours[mismatch]}, ml_dtypes {theirs[mismatch]}"
    np.testing.assert_array_equal(e2m1_decode(torch.from_numpy(ours)).numpy(),
                                  x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e2m1_ties_go_to_even_and_saturate():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e9, float("inf"), -0.1, -7.0])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -6.0]
    assert e2m1_encode(torch.tensor([-0.1])).item() == 0x8  # sign kept on a value that rounds to zero


def test_e4m3_matches_ml_dtypes_saturates_and_underflows():
    # All 126 positive finite E4M3 values, the midpoints between them, and underflow neighbours.
    codes = np.arange(1, 127, dtype=np.uint8)
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (vals[1:] + vals[:-1]) / 2
    tiny = np.array([2.0**-10, 2.0**-10 * 1.01, 2.0**-11, 2.0**-9 * 1.5], dtype=np.float32)
    x = np.concatenate([vals, mids, tiny, -vals, -mids])
    ours = e4m3_round(torch.from_numpy(x)).float().numpy()
    theirs = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)
    big = torch.tensor([448.0, 460.0, 1e6, float("inf"), -1e6])
    assert e4m3_round(big).float().tolist() == [448.0, 448.0, 448.0, 448.0, -448.0]
    assert e4m3_round(torch.tensor([2.0**-10])).float().item() == 0.0  # tie to even: 0
    assert e4m3_round(torch.tensor([2.0**-10 * 1.01])).float().item() == 2.0**-9


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32)
    assert (packed[..., 0] & 0xF).tolist() == codes[..., 0].tolist()  # element 0 in the low nibble
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize("dim", [-1, 1])
def test_nvfp4_format_and_error(dim):
    x = torch.randn(4, 64, 48) * 3
    packed, scales = quantize_nvfp4(x, dim=dim)
    n = x.shape[dim]
    assert packed.dtype == torch.uint8 and packed.shape[dim] == n // 2
    assert scales.dtype == torch.float8_e4m3fn and scales.shape[dim] == n // 16
    y = dequantize_nvfp4(packed, scales, dim=dim)
    assert y.shape == x.shape
    rel = ((y - x).norm() / x.norm()).item()
    assert 0.02 < rel < 0.15  # 4-bit: visibly lossy, but far from garbage
    # Each block's largest magnitude maps to 6 (up to the E4M3 rounding of its scale).
    blocks = x.movedim(dim, -1).unflatten(-1, (-1, 16))
    assert torch.allclose(blocks.abs().amax(-1) / scales.movedim(dim, -1).float(), torch.tensor(6.0), rtol=0.07)


def test_zero_blocks_decode_to_zero_not_nan():
    x = torch.zeros(2, 64)
    x[1, 16:32] = 6.0  # exactly representable in both formats (scale 1)
    for q, dq in ((quantize_nvfp4, dequantize_nvfp4), (quantize_mxfp4, dequantize_mxfp4)):
        packed, scales = q(x)
        y = dq(packed, scales)
        assert torch.isfinite(y).all()
        assert torch.equal(y, x)
    q8, s8 = quantize_int8_per_token(torch.zeros(3, 8))
    assert torch.equal(q8, torch.zeros(3, 8, dtype=torch.int8)) and torch.equal(s8, torch.zeros(3))
    v8, sv = quantize_fp8_per_channel(torch.zeros(5, 8))
    assert torch.isfinite(v8.float()).all() and torch.equal(sv, torch.zeros(8))


def test_underflowing_nvfp4_scale_gives_zeros():
    x = torch.full((1, 16), 1e-4)  # absmax / 6 < 2**-10: the E4M3 scale rounds to 0
    packed, scales = quantize_nvfp4(x)
    assert scales.float().item() == 0.0 and packed.eq(0).all()


def test_mxfp4_scales_are_powers_of_two_per_ocp():
    x = torch.randn(8, 96) * 10
    packed, exps = quantize_mxfp4(x)
    assert exps.dtype == torch.uint8 and exps.shape == (8, 3)
    amax = x.unflatten(-1, (3, 32)).abs().amax(-1)
    expect = torch.floor(torch.log2(amax)) - 2 + 127
    assert torch.equal(exps.float(), expect)
    y = dequantize_mxfp4(packed, exps)
    assert ((y - x).norm() / x.norm()).item() < 0.2


def test_nvfp4_rejects_lengths_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 40))


def test_int8_per_token_and_per_block():
    x = torch.randn(2, 300, 64)
    q, s = quantize_int8_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (2, 300)
    assert q.abs().amax(-1).eq(127).all()  # the absmax element of every token maps to +-127
    assert ((q.float() * s[..., None] - x).abs() <= s[..., None] / 2 + 1e-7).all()
    qb, sb = quantize_int8_per_block(x, 128)
    assert sb.shape == (2, 3)  # 128 + 128 + 44 tokens
    assert torch.allclose(sb[:, 2], x[:, 256:].abs().amax((-1, -2)) / 127)
    # Round half to even, as the kernels' __float2int_rn.
    q2, _ = quantize_int8_per_token(torch.tensor([[127.0, 0.5, 1.5, -2.5]]))
    assert q2.tolist() == [[127, 0, 2, -2]]


def test_fp8_per_channel():
    x = torch.randn(3, 200, 16) * torch.logspace(-2, 2, 16)
    q, s = quantize_fp8_per_channel(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 16)
    assert torch.allclose(q.float().abs().amax(1), torch.tensor(448.0))
    y = q.float() * s[:, None, :]
    assert ((y - x).norm() / x.norm()).item() < 0.05
