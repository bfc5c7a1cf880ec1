"""Gradient contracts of SageBwd (``sd.sagebwd`` and ``sd.attention(mode="int8")`` with gradients).

- a float ``attn_mask`` that requires grad runs SDPA in every entry point, and gets its gradient.
"""
import math

import pytest
import torch
import torch.nn.functional as F

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
