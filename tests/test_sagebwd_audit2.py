"""Regressions found by an audit of SageBwd's training path (sd.sagebwd, sd.attention(mode="int8")
with gradients), on the torch reference (CPU).

- fp16 operands x1e4: the reference's backward recomputed the 16-bit scores with one matmul over
  all keys where the forward had summed them per key tile; at |s| ~ 2**30 the two float32 orders
  differ by up to 128 (log2 units), so P~ = exp2(s - m) overflowed and every gradient was NaN
  (output finite, SDPA's gradients finite).
- a NaN / Inf in one query row: with INT8 scores its output row came back finite (the quantizer
  takes NaN as 0), and with 16-bit scores its NaN reached the dQ of the 63 other rows of its dS
  tile through the tile's INT8 scale. Now the row is NaN (where it sees a key), as in exact
  attention and the inference path, and stays out of every other row and gradient.
- sd.sagebwd with zero heads raised ZeroDivisionError; sd.attention returns the empty result.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers._sagebwd_autograd import rows_with_a_key
from sage_diffusers.reference import cosine
from sage_diffusers.reference.online_softmax import visible_keys
from sage_diffusers.sagebwd import Impl


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("causal", [False, True])
def test_fp16_x1e4_operands_give_finite_gradients(causal):
    """Bug: every gradient NaN for N(0, 1e4^2) fp16 q, k, v (scores ~1e9) with 16-bit scores. The
    softmax is one-hot there: dV is P^T dO (checked against float64), dQ and dK must be finite."""
    shape_q, shape_kv = (1, 2, 100, 64), (1, 2, 130, 64)
    q, k, v = (torch.randn(s, generator=_gen(i)).mul(1e4).half() for i, s in enumerate((shape_q, shape_kv, shape_kv)))
    do = torch.randn(shape_q, generator=_gen(3)).half()
    for entry in ("sagebwd", "attention"):
        xs = _leaves(q, k, v)
        if entry == "sagebwd":
            out = sd.sagebwd(*xs, is_causal=causal, scores="fp16", impl=Impl.REFERENCE)
        else:
            out = sd.attention(*xs, is_causal=causal, mode="int8")
        out.backward(do)
        assert torch.isfinite(out).all()
        for name, x in zip("qkv", xs):
            assert torch.isfinite(x.grad).all(), (entry, name)
        vd = v.double().requires_grad_()
        F.scaled_dot_product_attention(q.double(), k.double(), vd, is_causal=causal).backward(do.double())
        assert cosine(xs[2].grad, vd.grad) > 0.999, entry


def test_rows_with_a_key_matches_visible_keys():
    for b, sq, skv, causal, masked in [(2, 7, 5, True, True), (2, 70, 90, False, True), (1, 5, 9, True, False),
                                       (3, 70, 4, True, True), (1, 3, 0, False, False)]:
        key_mask = (torch.rand(b, skv, generator=_gen(sq)) > 0.6) if masked else None
        if masked:
            key_mask[0] = False
            key_mask[-1, 0] = False
        got = rows_with_a_key(key_mask, causal, sq, skv, "cpu").expand(b, 1, sq, 1)
        vis = visible_keys(0, skv, sq, key_mask, causal, "cpu")
        want = torch.full((b, 1, sq, 1), skv > 0) if vis is None else vis.any(-1, keepdim=True).expand(b, 1, sq, 1)
        assert torch.equal(got, want), (b, sq, skv, causal, masked)


@pytest.mark.parametrize("scores", ["fp16", "int8"])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_query_row_stays_in_its_row(scores, causal, monkeypatch):
    """A NaN in row 5 and an Inf in row 70 of batch 0, a NaN in row 0 of batch 1 (which sees no key:
    its key 0 is masked and the call is causal, or its whole row is masked): out and lse NaN exactly
    on the rows that see a key, as the inference path; everything else as if those rows were 0,
    gradients finite everywhere (the NaN rows get none)."""
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_SCORES", scores)
    b, h, sq, skv, d = 2, 2, 150, 140, 64
    q = torch.randn(b, h, sq, d, generator=_gen(0)).bfloat16()
    k, v = (torch.randn(b, 1, skv, d, generator=_gen(i)).bfloat16() for i in (1, 2))
    key_mask = torch.rand(b, skv, generator=_gen(3)) > 0.3
    key_mask[1, 0] = False
    if not causal:
        key_mask[1] = False
    bad = torch.zeros(b, h, sq, dtype=torch.bool)
    bad[0, :, 5] = bad[0, 1, 70] = bad[1, :, 0] = True
    q_bad = q.clone()
    q_bad[0, :, 5, 7] = math.nan
    q_bad[0, 1, 70, 0] = math.inf
    q_bad[1, :, 0, 3] = math.nan
    sees = bad.clone()
    sees[1] = False  # batch 1's row 0 sees no key: it stays 0

    def run(qq):
        xs = _leaves(qq, k, v)
        out, lse = sd.attention(*xs, key_mask=key_mask, is_causal=causal, mode="int8", return_lse=True)
        loss = out.float().nan_to_num(0.0, 0.0, 0.0).square().sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum()
        loss.backward()
        return out.detach(), lse.detach(), *(x.grad for x in xs)

    out, lse, dq, dk, dv = run(q_bad)
    ref_out, ref_lse = run(torch.where(bad[..., None], 0.0, q))[:2]
    assert torch.equal(out.isnan().any(-1), sees) and torch.equal(out.isnan().all(-1), sees)
    assert torch.equal(lse.isnan(), sees)
    assert torch.all(out[1, :, 0] == 0)
    keep = ~sees
    assert torch.equal(out[keep], ref_out[keep]) and torch.equal(lse[keep], ref_lse[keep])
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.all(dq[sees] == 0)
    with torch.no_grad():  # the inference path: the same NaN rows
        plain = sd.attention(q_bad, k, v, key_mask=key_mask, is_causal=causal, mode="int8")
    assert torch.equal(out.isnan(), plain.isnan())


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_sagebwd_zero_heads_is_empty(layout):
    """Bug: sd.sagebwd with 0 query and 0 key/value heads raised ZeroDivisionError (the reference's
    head-group check); sd.attention returns the empty result, and so does sd.sagebwd now."""
    q = torch.randn(1, 0, 5, 64, requires_grad=True)
    k = torch.randn(1, 0, 7, 64, requires_grad=True)
    v = torch.randn(1, 0, 7, 64, requires_grad=True)
    tr = (lambda t: t.transpose(1, 2)) if layout == "BSHD" else (lambda t: t)
    out = sd.sagebwd(tr(q), tr(k), tr(v), layout=layout)
    assert out.shape == tr(q).shape and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
