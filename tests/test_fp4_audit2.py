"""Audit of the FP4 (SageAttention3) torch reference: regressions and guards (CPU only).

- empty shapes: ``sage3_reference`` called directly with B, Hq, Sq or Skv = 0 raised IndexError
  (an amax over no element); it now returns what the API returns for them (zeros, LSE -inf);
  zero key/value heads with query heads raised ZeroDivisionError instead of ValueError.
- guards of properties the audit checked: E2M1 is round-to-nearest-even over a dense grid, the
  smoothing (K token mean, per-128 Q block mean with qbar.K^T added back) is exact when the
  quantizers are the identity, even with NaN in masked keys, GQA, causal and odd lengths; masked
  keys holding NaN / Inf change no output or LSE bit.
- a known defect shared with the CUDA kernel's MXFP4 path (not fixed: the kernel must change
  with it): the FP4 tensor scale amax / 2688 and the two-level factor rowmax / 2688 put the
  largest element at 2688 = 5.25 * 2^9, which MXFP4 (E8M0 scale 2^9) rounds to 6 * 2^9, +14.3 %.
"""
import math

import pytest
import torch

import sage_diffusers as sd
from sage_diffusers.reference import E2M1_VALUES, e2m1_decode, e2m1_encode, sage3_reference
from sage_diffusers.reference import sage3 as sage3_module

from inputs import exact_attention


# ---- empty shapes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape_q,shape_kv", [
    ((1, 2, 5, 64), (1, 2, 0, 64)),   # Skv = 0: rows without a visible key
    ((1, 2, 0, 64), (1, 2, 7, 64)),   # Sq = 0
    ((0, 2, 5, 64), (0, 1, 5, 64)),   # B = 0
    ((1, 0, 5, 64), (1, 0, 5, 64)),   # no heads at all
], ids=["skv0", "sq0", "b0", "h0"])
def test_sage3_reference_takes_empty_shapes(shape_q, shape_kv):
    q, k, v = torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv)
    out, lse = sage3_reference(q, k, v, return_lse=True)
    assert out.shape == shape_q and out.dtype == torch.float32 and not out.any()
    assert lse.shape == shape_q[:3] and bool((lse == -math.inf).all())
    assert sage3_reference(q, k, v).shape == shape_q
    # the same as the API's answer for the same call
    api_out, api_lse = sd.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mode="fp4", return_lse=True)
    assert torch.equal(api_out.float(), out) and torch.equal(api_lse, lse)


def test_sage3_reference_refuses_query_heads_without_kv_heads():
    q = torch.randn(1, 2, 5, 64)
    kv = torch.randn(1, 0, 5, 64)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sage3_reference(q, kv, kv)


# ---- E2M1 against a brute-force nearest-even rounding --------------------------------------------
def test_e2m1_is_nearest_even_with_saturation_on_a_dense_grid():
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)  # (8,)
    x = torch.cat([torch.linspace(-9, 9, 36001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    a = x.double().abs().clamp(max=6.0)[:, None]
    dist = (a - grid).abs()  # (N, 8)
    best = dist.min(-1, keepdim=True).values
    code = torch.arange(8)
    # among the nearest codes take the even one (ties), else the only one
    idx = torch.where(dist == best, (code % 2) * 8 + code, 99).min(-1).values % 8
    expected = grid[idx] * torch.where(torch.signbit(x), -1.0, 1.0).double()
    got = e2m1_decode(e2m1_encode(x.float())).double()
    assert torch.equal(got, expected.float().double())
    assert e2m1_decode(e2m1_encode(torch.tensor([math.inf, -math.inf]))).tolist() == [6.0, -6.0]
    assert torch.signbit(e2m1_decode(e2m1_encode(torch.tensor([-0.0, -0.2])))).all()


# ---- smoothing exact without quantization, masked keys invisible ----------------------------------
SHAPES = [
    # (B, Hq, Hkv, Sq, Skv, D)
    (2, 4, 2, 333, 129, 64),
    (1, 2, 1, 1, 15, 128),
    (1, 2, 2, 129, 300, 64),
]


def _inputs(b, hq, hkv, sq, skv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(b, hq, sq, d, generator=g) + 2 * torch.randn(1, hq, 1, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g) + 4 * torch.randn(1, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g) + 1.0
    mask = torch.rand(b, skv, generator=g) > 0.3
    mask[:, 0] = True
    return q, k, v, mask


def _poison(x, mask, value):
    return x.masked_fill(~mask[:, None, :, None], value)


@pytest.mark.parametrize("p_quant", ["two_level", "direct"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_smoothing_is_exact_when_quantization_is_the_identity(monkeypatch, shape, causal, p_quant):
    """K - mean(K over attended keys), Q - per-128-block mean with qbar.K^T added back and the LSE's
    q.k_mean term are exact algebra: with identity quantizers the reference is exact attention."""
    monkeypatch.setattr(sage3_module, "fp4_tensor_roundtrip",
                        lambda x, dim, fmt: torch.where(torch.isfinite(x), x, torch.zeros((), device=x.device)))
    monkeypatch.setattr(sage3_module, "fp4_roundtrip", lambda x, dim, fmt: x)
    q, k, v, mask = _inputs(*shape, seed=1)
    out, lse = sage3_reference(q, _poison(k, mask, math.nan), _poison(v, mask, math.nan), key_mask=mask,
                               is_causal=causal, p_quant=p_quant, return_lse=True)
    ref, ref_lse = exact_attention(q, k, v, key_mask=mask, is_causal=causal)
    assert (out.double() - ref).abs().max().item() < 2e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse.double() - ref_lse)[fin].abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_masked_keys_change_no_bit_and_outputs_stay_finite(shape, causal, dtype):
    q, k, v, mask = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(*shape, seed=2))
    out, lse = sd.attention(q, k, v, key_mask=mask, is_causal=causal, mode="fp4", return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for kval, vval in ((math.nan, math.nan), (math.inf, -math.inf), (6e4, 6e4)):
        out2, lse2 = sd.attention(q, _poison(k, mask, kval), _poison(v, mask, vval), key_mask=mask,
                                  is_causal=causal, mode="fp4", return_lse=True)
        assert torch.equal(out2, out) and torch.equal(lse2, lse), (kval, vval)
    ref, _ = exact_attention(q, k, v, key_mask=mask, is_causal=causal)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.97, cos


def test_nan_query_row_stays_in_its_row():
    q, k, v, _ = _inputs(1, 2, 2, 300, 300, 64, seed=3)
    q, k, v = q.half(), k.half(), v.half()
    base = sd.attention(q, k, v, mode="fp4")
    q2 = q.clone()
    q2[0, 0, 5, 3] = math.nan
    out = sd.attention(q2, k, v, mode="fp4")
    bad = ~torch.isfinite(out).all(-1)
    assert bad.nonzero().tolist() == [[0, 0, 5]]
    assert torch.equal(out[:, 1], base[:, 1])  # other heads untouched bit for bit


# ---- known defect, shared with the kernel's MXFP4 path (reported, not fixed) ------------------------
@pytest.mark.xfail(strict=True, reason="MXFP4: tensor scale amax/2688 and two-level s1 = rowmax/2688 put the "
                   "largest element at 5.25 * 2^9, rounded to 6 * 2^9 (+14.3 %); the kernel shares it")
def test_mxfp4_does_not_inflate_the_largest_element():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 256, 64, generator=g)
    q = 30 * k[:, :, :4]  # each row attends (almost) only to its own key
    v = torch.ones(1, 1, 256, 64)
    out = sage3_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), fmt="mxfp4")
    # exact attention: 1.0 everywhere; NVFP4 two-level gives exactly 1.0; MXFP4 today 1.306 (= (8/7)^2)
    assert (out - 1.0).abs().max().item() < 0.03
