"""Property: attention over shares of the keys, merged by log-sum-exp, is as accurate as one call over all keys.

This is what ring attention (context parallelism) relies on: every path's LSE must be consistent with its own
output (the lse of the scores the output was normalized by, K-mean shift included). For each mode (SDPA, and the
INT8 / FP4 algorithms: torch references on the CPU, the kernels on a GPU) K and V are split into 2-4 shares on and
off 128-key boundaries, each share is one ``sage_diffusers.attention(..., return_lse=True)`` call, the shares are
merged with ``merge_attention_shares``, and both the merged result and one call over all keys are compared with
float64 exact attention. Key masks (with a share that is all padding for some rows, and a row with no key at all),
GQA and causal attention (queries split like the keys: earlier shares in full, the diagonal share causal, later
shares absent, i.e. out 0 / lse -inf) are covered.
"""
from __future__ import annotations

import math

import pytest
import torch

import sage_diffusers as sd
from inputs import dit_qkv, exact_attention, key_padding_mask
from sage_diffusers.processors.context_parallel import merge_attention_pair, merge_attention_shares
from sage_diffusers.reference import cosine, relative_l1

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
MODES = ["sdpa", "int8", "fp4"]
# Key-share boundaries (Skv = 300): on multiples of the kernels' 128-key tile, and off them.
CUTS = {"on128": (128, 256), "off128": (37, 201), "four": (64, 131, 250)}
SKV = 300
CAUSAL_SKV, CAUSAL_CUTS = 200, (57, 128)  # Sq = Skv; one cut off, one on the 128 boundary


def _lse_finite_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse is -inf on other rows than exact attention's"
    return float((lse[finite].double() - ref[finite]).abs().max()) if finite.any() else 0.0


def _errors(out, lse, ref_out, ref_lse):
    return relative_l1(out.double(), ref_out), 1 - cosine(out.double(), ref_out), _lse_finite_err(lse, ref_lse)


def _assert_as_accurate(merged, single, mode):
    """The merged result may be a little worse than one call (other block scales, other K means), not more."""
    floor = (1e-5, 1e-9, 1e-4) if mode == "sdpa" else (2e-3, 2e-5, 2e-3)
    for name, m, s, f in zip(("rel-L1", "1-cos", "lse"), merged, single, floor):
        assert m <= 1.5 * s + f, f"{mode}: merged {name} {m:.3g} vs one call {s:.3g}"


def _inputs(device, dtype, *, sq=48, skv=SKV, seed=0):
    """GQA inputs (Hq 2 per K/V head), D 64 on the CPU (the references are slow), 128 on a GPU; key mask (B, Skv)."""
    hq, hkv, d = (2, 1, 64) if device == "cpu" else (8, 4, 128)
    q, k, v = dit_qkv(2, hq, hkv, sq, skv, d, seed=seed, dtype=dtype, device=device)
    mask = key_padding_mask(2, skv, seed=seed, device=device)
    mask[1, 37:201] = False  # batch row 1: one share of "off128" and of "four" is all padding
    return q, k, v, mask


def _shares(cuts, skv=SKV):
    edges = (0, *cuts, skv)
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cuts", list(CUTS), ids=list(CUTS))
def test_key_shares_merge_like_one_call(device, mode, cuts):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, mask = _inputs(device, dtype)
    single_out, single_lse = sd.attention(q, k, v, key_mask=mask, mode=mode, return_lse=True)
    outs, lses = [], []
    for s in _shares(CUTS[cuts]):
        o, l = sd.attention(q, k[:, :, s], v[:, :, s], key_mask=mask[:, s], mode=mode, return_lse=True)
        outs.append(o)
        lses.append(l)
    assert cuts == "on128" or any(bool((l[1] == -math.inf).all()) for l in lses)  # the merge meets lse -inf
    out, lse = merge_attention_shares(outs, lses)  # BHSD out, (B, H, S) lse: lse is out's leading dims
    ref_out, ref_lse = exact_attention(q, k, v, key_mask=mask)
    _assert_as_accurate(_errors(out, lse, ref_out, ref_lse),
                        _errors(single_out, single_lse, ref_out, ref_lse), mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_causal_shares_with_offsets(device, mode):
    """Ring attention's causal split: query share i sees key shares j < i fully, share i causally, none after."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, mask = _inputs(device, dtype, sq=CAUSAL_SKV, skv=CAUSAL_SKV)
    mask[:, 0] = True  # every causal row sees key 0 (no empty row: SDPA's reference has none either)
    single_out, single_lse = sd.attention(q, k, v, key_mask=mask, is_causal=True, mode=mode, return_lse=True)
    shares = _shares(CAUSAL_CUTS, CAUSAL_SKV)
    merged_out, merged_lse = [], []
    for i, qs in enumerate(shares):
        qi = q[:, :, qs]
        outs, lses = [], []
        for j, ks in enumerate(shares):
            if j > i:  # keys after the query share: nothing visible, as a ring rank sees it
                outs.append(torch.zeros_like(qi))
                lses.append(torch.full(qi.shape[:3], -math.inf, device=device))
                continue
            o, l = sd.attention(qi, k[:, :, ks], v[:, :, ks], key_mask=mask[:, ks], is_causal=i == j, mode=mode,
                                return_lse=True)
            outs.append(o)
            lses.append(l)
        o, l = merge_attention_shares(outs, lses)
        merged_out.append(o)
        merged_lse.append(l)
    out, lse = torch.cat(merged_out, dim=2), torch.cat(merged_lse, dim=2)
    ref_out, ref_lse = exact_attention(q, k, v, key_mask=mask, is_causal=True)
    _assert_as_accurate(_errors(out, lse, ref_out, ref_lse), _errors(single_out, single_lse, ref_out, ref_lse), mode)


def test_row_without_keys_merges_to_zero_and_minus_inf():
    q, k, v, mask = _inputs("cpu", torch.float32)
    mask[0] = False  # batch row 0 sees no key in any share
    outs, lses = [], []
    for s in _shares(CUTS["off128"]):
        o, l = sd.attention(q, k[:, :, s], v[:, :, s], key_mask=mask[:, s], mode="int8", return_lse=True)
        outs.append(o)
        lses.append(l)
    out, lse = merge_attention_shares(outs, lses)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_merge_pair_edge_cases():
    """-inf on one side returns the other side exactly; on both sides 0 / -inf, never NaN (even if out is NaN)."""
    out_a, out_b = torch.randn(3, 5), torch.full((3, 5), float("nan"))
    lse_a = torch.tensor([0.5, -math.inf, -math.inf])
    lse_b = torch.tensor([-math.inf, 1.0, -math.inf])
    out_b[1] = 2.0
    out, lse = merge_attention_pair(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0], out_a[0]) and torch.equal(out[1], out_b[1]) and torch.equal(out[2], torch.zeros(5))
    assert lse.tolist() == [0.5, 1.0, -math.inf]
    with pytest.raises(ValueError, match="as many"):
        merge_attention_shares([out_a], [])


def test_wrong_lse_fails_the_bound():
    """Negative control: a share's lse off by 0.5 (e.g. a K-mean shift left out) breaks the property."""
    q, k, v, mask = _inputs("cpu", torch.float32)
    single = sd.attention(q, k, v, key_mask=mask, mode="int8", return_lse=True)
    shares = _shares(CUTS["on128"])
    parts = [sd.attention(q, k[:, :, s], v[:, :, s], key_mask=mask[:, s], mode="int8", return_lse=True)
             for s in shares]
    outs = [o for o, _ in parts]
    lses = [l for _, l in parts]
    lses[0] = lses[0] + 0.5
    out, lse = merge_attention_shares(outs, lses)
    ref_out, ref_lse = exact_attention(q, k, v, key_mask=mask)
    with pytest.raises(AssertionError):
        _assert_as_accurate(_errors(out, lse, ref_out, ref_lse), _errors(*single, ref_out, ref_lse), "int8")
