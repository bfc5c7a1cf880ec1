"""Every quantizer of sage_diffusers.reference, byte for byte against the independent encoders.

``independent_quant`` is written from the format definitions with numpy and ml_dtypes only. Each test
compares every storage byte (packed E2M1 nibbles, E4M3 / E8M0 block scales, INT8 codes, FP8 codes) and
every float32 scale bit for bit, on inputs built to hit the edge cases of each format: both signs,
exact ties, saturation, E4M3 subnormal and underflowing scales, float32 subnormals, zero blocks, and
scales where ``x * (1/127)`` and IEEE ``x / 127`` differ in the last bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import independent_quant as ind
from sage_diffusers.reference import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_encode,
    e4m3_round,
    quantize_fp8_per_channel,
    quantize_int8_per_block,
    quantize_int8_per_token,
    quantize_mxfp4,
    quantize_nvfp4,
)

F32 = np.float32
E2M1_MAGS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=F32)
E2M1_MIDS = (E2M1_MAGS[1:] + E2M1_MAGS[:-1]) / 2  # 0.25 ... 5.0: every E2M1 tie


def _u8(t: torch.Tensor) -> np.ndarray:
    """Storage bytes of a uint8 / float8 tensor."""
    return t.contiguous().view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()


def _bits(t) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=F32).view(np.uint32)


def _assert_bytes_equal(ours: np.ndarray, theirs: np.ndarray, what: str):
    bad = np.argwhere(ours != theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs {theirs.shape}"
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first at {bad[:3].tolist()}: ours {ours[tuple(bad[0])]}, independent {theirs[tuple(bad[0])]}"


def _reciprocal_differs(amax: np.ndarray, c: float) -> np.ndarray:
    """Where amax * (1/c) and IEEE amax / c differ in float32 (the mutant the tests must see)."""
    return (amax * F32(1.0 / c)).astype(F32) != (amax / F32(c)).astype(F32)


# ---- element formats, exhaustively over every finite float16 and bfloat16 value -------------------
def _all_half_values() -> np.ndarray:
    h = np.arange(0, 0x10000, dtype=np.uint16)
    f16 = h.view(np.float16).astype(F32)
    bf16 = (h.astype(np.uint32) << 16).view(F32)
    x = np.concatenate([f16, bf16])
    return x[np.isfinite(x)]


def test_e2m1_encode_every_half_value():
    x = _all_half_values()
    _assert_bytes_equal(e2m1_encode(torch.from_numpy(x)).numpy(), ind.e2m1_codes(x), "E2M1 codes")


def test_e4m3_round_every_half_value():
    x = _all_half_values()
    _assert_bytes_equal(_u8(e4m3_round(torch.from_numpy(x))), ind.e4m3_bytes(x), "E4M3 bytes")


# ---- FP4 block formats -----------------------------------------------------------------------------
def _fp4_edge_blocks(block: int, fmt: str) -> np.ndarray:
    """Rows of ``block`` values, each row one edge case (both signs everywhere)."""
    rows = []
    # scales of the block: E4M3-exact for NVFP4 (normal, subnormal, max) / powers of two for MXFP4
    bases = [1.0, 0.5, 2.0**-9, 2.0**-7 * 1.5, 448.0, 3.0] if fmt == "nv" else [1.0, 2.0**-20, 2.0**60, 2.0**-126, 0.25]
    for base in bases:
        # the block max maps exactly to 6 (scale = base); every other element is an exact E2M1 tie
        vals = np.resize(np.concatenate([E2M1_MIDS, -E2M1_MIDS, E2M1_MAGS, -E2M1_MAGS]), block - 1)
        rows.append(np.concatenate([[6.0], vals]) * base)
        rows.append(-rows[-1])
    rows.append(np.zeros(block))  # zero block: scale 0 / exponent byte 0, codes 0, never NaN
    rows.append(-np.zeros(block))  # negative zeros
    one = np.zeros(block)
    one[block // 2] = -3.0  # a single non-zero of either sign
    rows.append(one)
    rows.append(np.full(block, 1e-4))  # NVFP4: absmax / 6 below E4M3's subnormals -> scale 0
    rows.append(np.full(block, 6 * 2.0**-10))  # NVFP4: absmax / 6 = 2**-10, the tie between 0 and 2**-9
    rows.append(np.linspace(-1e4, 3e4, block))  # NVFP4: scale saturates at 448, codes saturate at +-6
    rows.append(np.linspace(-7.5, 7.5, block))  # MXFP4: amax 7.5 -> exponent 0, 7.5 and 6.5 saturate
    rows.append(np.linspace(-1e-40, 3e-40, block))  # float32 subnormal inputs
    rows.append(np.linspace(1e38, -3e38, block))  # near float32 max
    # E4M3 scale ties: absmax / 6 exactly halfway between two E4M3 values
    for mid in (1.0625, 2.0**-8 * 1.0625, 200.0, 2.0**-9 * 1.5):
        r = np.linspace(-1, 1, block) * 6 * mid
        rows.append(r)
    return np.stack(rows).astype(F32)


def _random_blocks(n_rows: int, width: int, seed: int) -> np.ndarray:
    """Gaussian rows with a per-row magnitude from 1e-6 to 1e6 and a few outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, width)) * 10.0 ** rng.uniform(-6, 6, (n_rows, 1))
    x[rng.random(x.shape) < 0.01] *= 50
    return x.astype(F32)


QUANT_FP4 = {"nvfp4": (quantize_nvfp4, ind.nvfp4, ind.NV_BLOCK, "nv"), "mxfp4": (quantize_mxfp4, ind.mxfp4, ind.MX_BLOCK, "mx")}


@pytest.mark.parametrize("fmt", list(QUANT_FP4))
@pytest.mark.parametrize("suite", ["edges", "random"])
def test_fp4_every_storage_byte(fmt, suite):
    quant, independent, block, tag = QUANT_FP4[fmt]
    if suite == "edges":
        x = np.concatenate([_fp4_edge_blocks(block, "nv"), _fp4_edge_blocks(block, "mx")])
        x = np.tile(x, (1, 2))  # two blocks per row: the scales of neighbouring blocks are independent
    else:
        x = _random_blocks(512, 4 * block, seed=3)
    packed, scales = quant(torch.from_numpy(x))
    want_packed, want_scales = independent(x)
    _assert_bytes_equal(_u8(packed), want_packed, f"{fmt} packed codes")
    _assert_bytes_equal(_u8(scales), want_scales, f"{fmt} block scales")


@pytest.mark.parametrize("fmt", list(QUANT_FP4))
def test_fp4_quantized_dim_moves_the_same_bytes(fmt):
    """Quantizing along a middle dim stores exactly the bytes of quantizing its transpose along the last."""
    quant, independent, block, _ = QUANT_FP4[fmt]
    x = _random_blocks(6 * 2 * block, 24, seed=4).reshape(6, 2 * block, 24)
    packed, scales = quant(torch.from_numpy(x), dim=1)
    want_packed, want_scales = independent(np.ascontiguousarray(x.transpose(0, 2, 1)))
    _assert_bytes_equal(_u8(packed.transpose(1, 2)), want_packed, f"{fmt} packed, dim=1")
    _assert_bytes_equal(_u8(scales.transpose(1, 2)), want_scales, f"{fmt} scales, dim=1")


DEQUANT_FP4 = {"nvfp4": (dequantize_nvfp4, ind.nvfp4_decode), "mxfp4": (dequantize_mxfp4, ind.mxfp4_decode)}


@pytest.mark.parametrize("fmt", list(QUANT_FP4))
@pytest.mark.parametrize("dim", [-1, 1])
def test_fp4_dequantize_matches_independent_decoder(fmt, dim):
    """Decoding every stored byte, on 3-D tensors along the last and a middle dim, is exact."""
    quant, independent, block, _ = QUANT_FP4[fmt]
    dequant, decode = DEQUANT_FP4[fmt]
    x = np.concatenate([_fp4_edge_blocks(block, "nv"), _fp4_edge_blocks(block, "mx")])
    x = x[: (len(x) // 2) * 2].reshape(2, -1, 2 * block)  # [2, rows/2, 2*block]
    packed, scales = quant(torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, dim))), dim=dim)
    got = np.moveaxis(dequant(packed, scales, dim=dim).numpy(), dim, -1)
    want = decode(*independent(x))
    assert np.array_equal(got.view(np.uint32), want.astype(F32).view(np.uint32)), f"{fmt} decode along dim {dim}"


def test_edge_blocks_hit_what_they_claim():
    """The edge suite really contains ties, saturation and subnormal / zero scales (else it proves nothing)."""
    x = _fp4_edge_blocks(ind.NV_BLOCK, "nv")
    _, scale_bits = ind.nvfp4(x)
    scale = ind.e4m3_value(scale_bits)[:, 0]
    assert (scale == 0).any() and ((scale > 0) & (scale < 2.0**-6)).any() and (scale == 448).any()
    ratio = np.abs(x) / np.where(scale > 0, scale, 1)[:, None]
    assert np.isin(ratio, E2M1_MIDS).sum() > 50 and (ratio > 6).any()


# ---- INT8 and FP8 ----------------------------------------------------------------------------------
def _int8_rows(seed: int, batch: int = 4) -> np.ndarray:
    """[batch, 300, 64]: random tokens at many magnitudes, zero tokens, exact .5 ties (scale 1)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 300, 64)) * 10.0 ** rng.uniform(-5, 5, (batch, 300, 1))
    x[0, 7] = 0.0
    ties = np.resize(np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 63.5]), 63)
    x[1, 11] = np.concatenate([[127.0], ties])  # scale exactly 1: every .5 is a tie
    x[2, 128:256] = 0.0  # a whole zero block for the per-block scales
    x[3, 299, 0] = 1e30  # one huge value
    return x.astype(F32)


def test_int8_per_token_codes_and_scales():
    x = _int8_rows(5)
    q, s = quantize_int8_per_token(torch.from_numpy(x))
    want_q, want_s = ind.int8_per_token(x)
    assert np.array_equal(_bits(s), _bits(want_s)), "INT8 per-token scales (IEEE absmax / 127)"
    assert np.array_equal(q.numpy(), want_q), "INT8 per-token codes"
    assert _reciprocal_differs(np.abs(x).max(-1), 127.0).sum() > 10, "inputs must expose x * (1/127)"


@pytest.mark.parametrize("block", [128, 64, None])
def test_int8_per_block_codes_and_scales(block):
    """(B, H, S, D) as the references call it; ``None``: the default block, the kernels' 128-key tile."""
    x = _int8_rows(6, batch=48).reshape(12, 4, 300, 64)
    q, s = quantize_int8_per_block(torch.from_numpy(x)) if block is None else quantize_int8_per_block(torch.from_numpy(x), block)
    block = block or 128
    want_q, want_s = ind.int8_per_block(x, block)
    assert s.shape == want_s.shape and np.array_equal(_bits(s), _bits(want_s)), "INT8 block scales, the short last block included"
    assert np.array_equal(q.numpy(), want_q), "INT8 per-block codes"
    amax = np.stack([np.abs(x[..., i:i + block, :]).max((-1, -2)) for i in range(0, x.shape[-2], block)], -1)
    assert _reciprocal_differs(amax, 127.0).sum() > 5, "inputs must expose x * (1/127)"


def test_int8_scale_division_is_ieee_on_purpose_built_values():
    """Absmaxes where amax * (1/127) is one ulp off amax / 127: the scale and the codes must be IEEE's."""
    cand = (np.arange(1, 20000, dtype=F32) * F32(0.013)).astype(F32)
    amax = cand[_reciprocal_differs(cand, 127.0)][:64]
    assert amax.size == 64
    x = np.zeros((64, 32), F32)
    x[:, 0] = amax
    x[:, 1:] = amax[:, None] * np.linspace(-1, 1, 31, dtype=F32)
    q, s = quantize_int8_per_token(torch.from_numpy(x))
    assert np.array_equal(_bits(s), _bits(amax / F32(127))), "scale must be IEEE amax / 127"
    assert np.array_equal(q.numpy(), ind.int8_per_token(x)[0])


def test_fp8_per_channel_codes_and_scales():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 200, 48)) * 10.0 ** rng.uniform(-6, 6, (3, 1, 48))).astype(F32)
    x[0, :, 5] = 0.0  # a zero channel: scale 0, codes 0
    x[1, :, 6] = np.linspace(-448, 448, 200)  # scale exactly 1: the codes are E4M3 of the inputs
    x[2, :, 7] = 1e-38  # subnormal-adjacent scale
    q, s = quantize_fp8_per_channel(torch.from_numpy(x))
    want_q, want_s = ind.fp8_per_channel(x)
    assert np.array_equal(_bits(s), _bits(want_s)), "FP8 per-channel scales (IEEE absmax / 448)"
    _assert_bytes_equal(_u8(q), want_q, "FP8 codes")
    assert _reciprocal_differs(np.abs(x).max(-2).ravel(), 448.0).any(), "inputs must expose x * (1/448)"


def test_independent_encoders_agree_with_ml_dtypes_decoding():
    """Sanity of the independent side itself: decode(encode(x)) is ml_dtypes' own rounding of x / scale."""
    x = _random_blocks(64, 64, seed=8)
    packed, sb = ind.nvfp4(x)
    scale = np.repeat(ind.e4m3_value(sb), ind.NV_BLOCK, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(scale > 0, np.clip(x / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32) * scale, 0)
    np.testing.assert_array_equal(ind.nvfp4_decode(packed, sb), want)


# ---- non-finite inputs and the FP4 per-tensor scale -------------------------------------------------
def _with_nonfinite(x: np.ndarray, seed: int) -> np.ndarray:
    """x with ~2 % of its entries replaced by NaN, +Inf or -Inf."""
    rng = np.random.default_rng(seed)
    x = x.copy()
    hit = rng.random(x.shape) < 0.02
    x[hit] = rng.choice(np.array([np.nan, np.inf, -np.inf], F32), hit.sum())
    return x


def _finite_part(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, F32(0)).astype(F32)


@pytest.mark.parametrize("fmt", list(QUANT_FP4))
def test_fp4_block_scales_ignore_nonfinite_values(fmt):
    """A NaN/Inf cannot change the scale of the finite values of its block (nor their codes)."""
    quant, independent, _, _ = QUANT_FP4[fmt]
    x = _with_nonfinite(_random_blocks(256, 128, seed=9), seed=10)
    packed, scales = quant(torch.from_numpy(x))
    want_packed, want_scales = independent(_finite_part(x))
    _assert_bytes_equal(_u8(scales), want_scales, f"{fmt} block scales with NaN/Inf present")
    finite = np.isfinite(x)
    got_codes, want_codes = ind.unpack(_u8(packed)), ind.unpack(want_packed)
    _assert_bytes_equal(np.where(finite, got_codes, 0), np.where(finite, want_codes, 0), f"{fmt} codes of finite values")


def test_int8_and_fp8_scales_ignore_nonfinite_values():
    x = _with_nonfinite(_int8_rows(11), seed=12)
    clean = _finite_part(x)
    finite = np.isfinite(x)
    for quant, independent, what in ((quantize_int8_per_token, ind.int8_per_token, "INT8 per token"),
                                     (quantize_int8_per_block, ind.int8_per_block, "INT8 per block")):
        q, s = quant(torch.from_numpy(x))
        want_q, want_s = independent(clean)
        assert np.array_equal(_bits(s), _bits(want_s)), f"{what}: scales with NaN/Inf present"
        assert np.array_equal(np.where(finite, q.numpy(), 0), np.where(finite, want_q, 0)), f"{what}: codes"
    q, s = quantize_fp8_per_channel(torch.from_numpy(x))
    want_q, want_s = ind.fp8_per_channel(clean)
    assert np.array_equal(_bits(s), _bits(want_s)), "FP8 per-channel scales with NaN/Inf present"
    _assert_bytes_equal(np.where(finite, _u8(q), 0), np.where(finite, want_q, 0), "FP8 codes of finite values")


def _tensor_scale_inputs() -> np.ndarray:
    """(B=2, H=3, S=64, D=32): one (batch, head) per magnitude 1e-4 ... 1e4, an all-zero one, NaN/Inf."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 3, 64, 32)).astype(F32)
    mags = np.array([[1e-4, 1e-2, 1.0], [1e2, 1e4, 0.0]], F32)
    x = (x * mags[:, :, None, None]).astype(F32)
    x[0, 1, 5, 7], x[1, 0, 9, 2], x[1, 1, 0, 0] = np.nan, np.inf, -np.inf
    return x


def test_fp4_tensor_scale_bit_exact():
    """s = amax over finite |x| per (batch, head) / (448 * 6) (IEEE), 1 for an all-zero head."""
    from sage_diffusers.reference.quant import fp4_tensor_scale

    x = _tensor_scale_inputs()
    s = fp4_tensor_scale(torch.from_numpy(x))
    want = ind.tensor_scale(x, axes=(2, 3))
    assert s.shape == (2, 3, 1, 1) and np.array_equal(_bits(s.numpy()), _bits(want)), (s.flatten(), want.flatten())
    assert want[1, 2, 0, 0] == 1.0
    amax = np.where(np.isfinite(x), np.abs(x), 0).max((2, 3))
    assert _reciprocal_differs(amax[amax > 0], 448.0 * 6.0).any(), "inputs must expose amax * (1/2688)"


@pytest.mark.parametrize("fmt", list(QUANT_FP4))
def test_fp4_tensor_scaled_operands_bit_exact(fmt):
    """What the FP4 path stores for an operand: block FP4 of x / s (IEEE division by the tensor scale),
    the same bytes as the independent encoders at every magnitude 1e-4 ... 1e4."""
    from sage_diffusers.reference.quant import fp4_tensor_scale

    quant, independent, _, _ = QUANT_FP4[fmt]
    x = _finite_part(_tensor_scale_inputs())
    s = fp4_tensor_scale(torch.from_numpy(x))
    scaled = torch.from_numpy(x) / s.expand(*x.shape)
    want_scaled = (x / ind.tensor_scale(x, axes=(2, 3))).astype(F32)
    assert np.array_equal(_bits(scaled.numpy()), _bits(want_scaled))
    packed, scales = quant(scaled)
    want_packed, want_scales = independent(want_scaled)
    _assert_bytes_equal(_u8(packed), want_packed, f"{fmt} packed codes of x / s")
    _assert_bytes_equal(_u8(scales), want_scales, f"{fmt} block scales of x / s")
    # every magnitude uses the format's range: some block scale reaches 448 (NVFP4) / 2**7 x 6 (MXFP4)
    top = ind.e4m3_value(want_scales).max((2, 3)) if fmt == "nvfp4" else want_scales.max((2, 3))
    assert (top[[0, 0, 0, 1, 1], [0, 1, 2, 0, 1]] == (448.0 if fmt == "nvfp4" else 127 + 9)).all(), top


def test_int8_codes_of_nonfinite_values():
    """+-Inf saturates at +-127 and NaN gets code 0 (never the undefined float -> int8 cast of either)."""
    x = np.array([[1.0, np.inf, -np.inf, np.nan, -0.5, 0.25]], F32)
    for quant in (quantize_int8_per_token, quantize_int8_per_block):
        q, _ = quant(torch.from_numpy(x))
        assert q.tolist() == [[127, 127, -127, 0, -64, 32]], (quant.__name__, q.tolist())


# ---- realistic operands (sage_diffusers.realistic) -------------------------------------------------
REALISTIC_SHAPE = (2, 4, 2, 200, 300)  # B, Hq, Hkv, Sq, Skv: GQA, a short last key block of 44


def _realistic_np(case, dtype, d):
    """(q, k, v, mask) of ``case`` as torch (dtype) and as float32 numpy (exact from fp16 / bf16)."""
    from sage_diffusers.realistic import CASES, case_inputs

    q, k, v, mask = case_inputs(case, *REALISTIC_SHAPE, d, seed=CASES.index(case), dtype=dtype)
    return (q, k, v, mask), tuple(t.float().numpy() for t in (q, k, v)) + (None if mask is None else mask.numpy(),)


def _smoothed_k(k: np.ndarray, k_mean: np.ndarray, mask) -> np.ndarray:
    """where(mask, k - k_mean, 0) in float32 (k (B, H, S, D), k_mean (B, H, D)): the NaN of masked keys vanishes."""
    with np.errstate(invalid="ignore"):
        ks = (k - k_mean[:, :, None, :]).astype(F32)
    return ks if mask is None else np.where(mask[:, None, :, None], ks, F32(0))


def _attended(v: np.ndarray, mask) -> np.ndarray:
    """V with masked rows and non-finite entries 0 (what the V quantizers see)."""
    keep = np.isfinite(v) if mask is None else np.isfinite(v) & mask[:, None, :, None]
    return np.where(keep, v, F32(0)).astype(F32)


def _realistic_params():
    from sage_diffusers.realistic import CASES

    return [pytest.param(c, dt, id=f"{c.name}-{name}") for c in CASES
            for dt, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"))]


@pytest.mark.parametrize("case,dtype", _realistic_params())
def test_8bit_prepass_bytes_on_realistic_inputs(case, dtype):
    """sage8_quantize on DiT-like inputs (sharp heads, heavy tails, text padding with NaN in the
    masked K / V rows, x1e-4 operands in the fp16 subnormals, x1e4 operands at fp16's largest value),
    head dim 64: every INT8 / FP8 code and float32 scale bit against the independent encoders on the
    same operands: Q per token, K - k_mean per 128-key block (masked keys code 0), V per channel
    with masked rows 0. The mean itself is summed in float32 by the reference, in float64 here: it
    agrees to float32 rounding, not bit for bit, so the independent side smooths with the reference's."""
    from sage_diffusers.reference import sage8_quantize

    (q, k, v, mask), (qn, kn, vn, mn) = _realistic_np(case, dtype, 64)
    t = sage8_quantize(q, k, v, key_mask=mask)
    want_q8, want_sq = ind.int8_per_token(qn)
    assert np.array_equal(t["q8"].numpy(), want_q8) and np.array_equal(_bits(t["sq"]), _bits(want_sq)), "Q"
    ks = _smoothed_k(kn, t["k_mean"].numpy(), mn)
    want_k8, want_sk = ind.int8_per_block(ks, 128)
    assert np.array_equal(_bits(t["sk"]), _bits(want_sk)), "K block scales"
    assert np.array_equal(t["k8"].numpy(), want_k8), "K codes"
    want_v8, want_sv = ind.fp8_per_channel(_attended(vn, mn))
    assert np.array_equal(_bits(t["sv"]), _bits(want_sv)), "V channel scales"
    _assert_bytes_equal(_u8(t["v8"]), want_v8, "V codes")
    k_att = kn if mn is None else np.where(mn[:, None, :, None], kn, 0)
    n = kn.shape[2] if mn is None else mn.sum(1)[:, None, None]
    mean64 = k_att.astype(np.float64).sum(2) / n
    np.testing.assert_allclose(t["k_mean"].numpy(), mean64, rtol=1e-5, atol=1e-6 * np.abs(k_att).max())
    if mn is not None:
        assert not t["k8"].numpy()[~np.broadcast_to(mn[:, None, :, None], want_k8.shape)].any()


@pytest.mark.parametrize("fmt", list(QUANT_FP4))
@pytest.mark.parametrize("case,dtype", _realistic_params())
def test_fp4_operand_bytes_on_realistic_inputs(case, dtype, fmt):
    """What sage3_reference quantizes on DiT-like inputs, head dim 64: Q minus its 128-row block means,
    K minus its attended mean with masked rows 0, V with masked rows 0, each divided by its
    per-(batch, head) tensor scale (IEEE), then block FP4 along D (Q, K) or along the tokens (V,
    zero-padded to 320): every tensor-scale bit and storage byte against the independent encoders on
    the same operands. The tensor scale puts each head's largest value at the top of the format at
    every magnitude (block scale 448 for NVFP4, exponent 127 + 9 for MXFP4)."""
    from sage_diffusers.reference.quant import fp4_tensor_scale
    from sage_diffusers.reference.sage3 import smooth_q
    from sage_diffusers.reference._common import attended_mean

    quant, independent, _, _ = QUANT_FP4[fmt]
    (q, k, v, mask), (qn, kn, vn, mn) = _realistic_np(case, dtype, 64)
    qs = smooth_q(q)[0].numpy()
    ks = _smoothed_k(kn, attended_mean(k, mask)[:, :, 0].numpy(), mn)
    v0 = _attended(vn, mn)
    v0 = np.concatenate([v0, np.zeros(v0.shape[:2] + (320 - v0.shape[2], v0.shape[3]), F32)], 2)
    for name, x, dim in (("Q", qs, -1), ("K", ks, -1), ("V", v0, 2)):
        s = fp4_tensor_scale(torch.from_numpy(x))
        want_s = ind.tensor_scale(x, axes=(2, 3))
        assert np.array_equal(_bits(s.numpy()), _bits(want_s)), f"{name} tensor scales"
        scaled = torch.from_numpy(x) / s.expand(*x.shape)
        want_scaled = (x / want_s).astype(F32)
        assert np.array_equal(_bits(scaled.numpy()), _bits(want_scaled)), f"{name} / s"
        packed, scales = quant(scaled, dim=dim)
        if dim == 2:  # blocks along the tokens: compare with the independent encoder along the last axis
            packed, scales, want_scaled = packed.transpose(2, 3), scales.transpose(2, 3), want_scaled.transpose(0, 1, 3, 2)
        want_packed, want_scales = independent(np.ascontiguousarray(want_scaled))
        _assert_bytes_equal(_u8(packed), want_packed, f"{fmt} {name} packed codes")
        _assert_bytes_equal(_u8(scales), want_scales, f"{fmt} {name} block scales")
        top = ind.e4m3_value(want_scales).max((2, 3)) if fmt == "nvfp4" else want_scales.max((2, 3))
        assert (top == (448.0 if fmt == "nvfp4" else 127 + 9)).all(), (name, top)
