"""Gradient contracts of SageBwd (``sd.sagebwd`` and ``sd.attention(mode="int8")`` with gradients).

- no double backward: ``create_graph=True`` raises a RuntimeError naming SageBwd (it used to run
  and give a silently wrong second derivative);
- a float ``attn_mask`` that requires grad runs SDPA in every entry point, and gets its gradient.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sage_diffusers as sd
from sage_diffusers.sagebwd import Impl


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


def make_inputs(b, hq, hkv, sq, skv, d, dtype=torch.bfloat16, k_bias=2.0, device="cpu"):
    """Q, V ~ N(0, 1); K = N(0, 1) + a per-channel bias of scale ``k_bias`` (what smoothing removes)."""
    q = torch.randn(b, hq, sq, d).to(dtype)
    k = (torch.randn(b, hkv, skv, d) + k_bias * torch.randn(d)).to(dtype)
    v = torch.randn(b, hkv, skv, d).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def visible(b, sq, skv, key_mask, is_causal, device="cpu"):
    """bool (B, 1, Sq, Skv): which key each query sees."""
    vis = torch.ones(b, 1, sq, skv, dtype=torch.bool, device=device)
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    if is_causal:
        vis = vis & torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
    return vis


def exact_out_lse(q, k, v, key_mask=None, is_causal=False, scale=None):
    """Differentiable exact attention in the dtype of q: (out (B, Hq, Sq, D), lse (B, Hq, Sq));
    rows with no visible key give out 0, lse -inf and zero gradients (no NaN on any path)."""
    b, hq, sq, d = q.shape
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    vis = visible(b, sq, k.shape[2], key_mask, is_causal, q.device)
    s = torch.where(vis, (q @ ke.transpose(-1, -2)) * scale, -math.inf)  # (B, Hq, Sq, Skv)
    m = s.amax(-1, keepdim=True).detach()
    live = torch.isfinite(m)
    e = torch.exp(s - torch.where(live, m, 0.0))  # masked entries exp(-inf) = 0
    l = e.sum(-1, keepdim=True)
    l_safe = torch.where(live, l, 1.0)
    out = (e / l_safe) @ ve
    lse = torch.where(live, m + torch.log(l_safe), -math.inf).squeeze(-1)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Double backward


def _penalty_second_derivative(fn, q, k, v):
    """A gradient penalty: d/dq of |d sum(out^2) / dq|^2 (create_graph=True on the first grad)."""
    x = q.detach().clone().requires_grad_()
    out = fn(x, k, v)
    (g,) = torch.autograd.grad(out.float().pow(2).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad(g.pow(2).sum(), x)
    return g2


ENTRIES = {
    "sagebwd": lambda a, b, c: sd.sagebwd(a, b, c, impl=Impl.REFERENCE),
    "attention-int8": lambda a, b, c: sd.attention(a, b, c, mode="int8"),
    "attention-int8-lse": lambda a, b, c: sd.attention(a, b, c, mode="int8", return_lse=True)[0],
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_double_backward_is_refused_naming_sagebwd(entry):
    """Bug: SageBwd's double backward (create_graph=True, e.g. a gradient penalty) ran and was
    silently wrong (cosine -0.41 against exact): the backward's graph saw dO but not q, k, v (its
    saved state is integer codes). Now it raises, naming SageBwd and pointing to mode="sdpa"."""
    q, k, v = make_inputs(1, 2, 2, 40, 40, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r'sage_diffusers SageBwd .*mode="sdpa"'):
        _penalty_second_derivative(ENTRIES[entry], q, k, v)
    # the refusal is for create_graph only: a plain backward still runs
    x = q.clone().requires_grad_()
    ENTRIES[entry](x, k, v).float().pow(2).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0


def test_double_backward_refused_even_when_do_requires_grad():
    """Bug (same as above, the other branch): with a dO that itself requires grad the reference
    backward built a graph through dO only. The refusal does not depend on dO."""
    q, k, v = make_inputs(1, 2, 2, 40, 40, 64, dtype=torch.float32)
    w = torch.randn(1, 2, 40, 64, requires_grad=True)
    x = q.clone().requires_grad_()
    out = sd.sagebwd(x, k, v, impl=Impl.REFERENCE)
    with pytest.raises(RuntimeError, match="sage_diffusers SageBwd"):
        torch.autograd.grad((out * w).sum(), x, create_graph=True)


def test_suggested_sdpa_mode_double_backward_is_exact():
    """The refusal's advice works: mode="sdpa" under the MATH SDPA backend differentiates twice,
    matching float64 autograd of plain softmax attention."""
    q, k, v = make_inputs(1, 2, 2, 24, 24, 32, dtype=torch.float32)
    with sdpa_kernel(SDPBackend.MATH):
        got = _penalty_second_derivative(lambda a, b, c: sd.attention(a, b, c, mode="sdpa"), q, k, v)
    want = _penalty_second_derivative(lambda a, b, c: exact_out_lse(a, b, c)[0], q.double(), k.double(), v.double())
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Masks that require grad


def _key_padding_bias(b, skv, requires_grad=True):
    """Additive float key padding (B, 1, 1, Skv): 0 or -inf, the kind that runs natively."""
    keep = torch.rand(b, skv) > 0.3
    keep[:, 0] = True
    bias = torch.zeros(b, 1, 1, skv).masked_fill(~keep[:, None, None, :], -math.inf)
    return bias.requires_grad_(requires_grad), keep


MASK_ENTRIES = {
    "sagebwd": (lambda a, b, c, m: sd.sagebwd(a, b, c, attn_mask=m), "sagebwd: attn_mask requires grad"),
    "attention-int8": (lambda a, b, c, m: sd.attention(a, b, c, m, mode="int8"), "int8: backward"),
}


@pytest.mark.parametrize("entry", list(MASK_ENTRIES))
def test_float_mask_requiring_grad_runs_sdpa_and_gets_its_gradient(entry):
    """Bug: sd.sagebwd took a float (B, 1, 1, Skv) 0/-inf attn_mask that requires grad for key
    padding and ran SageBwd, which has no mask gradient: mask.grad stayed None. Every entry point
    now sends a mask that requires grad to SDPA (counted) and the mask gets SDPA's gradient."""
    fn, reason = MASK_ENTRIES[entry]
    q, k, v = make_inputs(2, 2, 2, 30, 40, 64, dtype=torch.float32)
    bias, _ = _key_padding_bias(2, 40)
    do = torch.randn_like(q)
    x, mask = q.clone().requires_grad_(), bias.clone().detach().requires_grad_()
    out = fn(x, k, v, mask)
    out.backward(do)
    stats = sd.fallback_stats()
    assert len(stats) == 1 and next(iter(stats)).startswith(reason), stats
    x2, mask2 = q.clone().requires_grad_(), bias.clone().detach().requires_grad_()
    want = F.scaled_dot_product_attention(x2, k, v, attn_mask=mask2)
    want.backward(do)
    assert torch.allclose(out, want, atol=1e-5)
    assert mask.grad is not None and torch.allclose(mask.grad, mask2.grad, atol=1e-4)
    assert torch.allclose(x.grad, x2.grad, atol=1e-4)


def test_sagebwd_mask_that_requires_grad_runs_natively_without_grad_mode():
    """Under torch.no_grad a mask that requires grad needs no gradient: SageBwd's forward runs with
    it as key padding (no fallback), exactly as with the equivalent bool key_mask."""
    q, k, v = make_inputs(1, 2, 2, 30, 40, 64, dtype=torch.float32)
    bias, keep = _key_padding_bias(1, 40)
    with torch.no_grad():
        out = sd.sagebwd(q, k, v, attn_mask=bias, impl=Impl.REFERENCE)
        want = sd.sagebwd(q, k, v, key_mask=keep, impl=Impl.REFERENCE)
    assert sd.fallback_stats() == {}
    assert torch.equal(out, want)
    assert bias.grad is None and bias.requires_grad  # the caller's mask untouched
