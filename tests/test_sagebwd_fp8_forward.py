"""SageBwd's forward through the sm_90a 8-bit kernel (``SAGE_DIFFUSERS_SAGEBWD_FWD=fp8``, the default
where it serves the call) against the Triton INT8 forward and float32 attention's gradients.

GPU (sm_90) only; the CPU part checks the policy's answers where the kernel cannot run.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers import realistic
from sage_diffusers.reference import cosine
from sage_diffusers.reference import sagebwd as ref
from sage_diffusers.reference.sagebwd import PVPrecision

sagebwd_triton = pytest.importorskip("sage_diffusers.kernels.sagebwd_triton")


def _sm90_kernel_or_skip():
    if not torch.cuda.is_available() or sagebwd_triton.INTERPRET:
        pytest.skip("needs a CUDA GPU (not the Triton interpreter)")
    from sage_diffusers.kernels import int8_sm90

    ok, why = int8_sm90.is_available()
    if not ok:
        pytest.skip(why)


def test_reference_refuses_fp8_and_takes_none_as_int8():
    q = k = v = torch.randn(1, 1, 8, 32)
    with pytest.raises(ValueError, match="fp8"):
        ref.sagebwd_forward(q, k, v, pv="fp8")
    a, b = ref.sagebwd_forward(q, k, v, pv=None), ref.sagebwd_forward(q, k, v, pv="int8")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_policy_keeps_int8_where_the_kernel_cannot_serve(monkeypatch):
    """CPU tensors, float32, head dim 32 and the int8 setting all give the Triton forward."""
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_FWD", "fp8")
    x = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    assert sagebwd_triton.training_pv(x, x, x) is PVPrecision.INT8  # not on a GPU
    if torch.cuda.is_available() and not sagebwd_triton.INTERPRET:
        g = x.cuda()
        assert sagebwd_triton.training_pv(g.float(), g.float(), g.float()) is PVPrecision.INT8
        h32 = torch.randn(1, 2, 16, 32, dtype=torch.bfloat16, device="cuda")
        assert sagebwd_triton.training_pv(h32, h32, h32) is PVPrecision.INT8
        monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_FWD", "int8")
        assert sagebwd_triton.training_pv(g, g, g) is PVPrecision.INT8


# (b, hq, hkv, sq, skv, d, causal, dtype)
STATE_CASES = [
    (2, 4, 2, 1000, 1000, 128, False, torch.bfloat16),
    (1, 4, 4, 777, 1531, 64, False, torch.float16),
    (2, 4, 1, 640, 640, 64, True, torch.bfloat16),
    (1, 2, 2, 300, 4100, 128, False, torch.float16),
]


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}")
@pytest.mark.parametrize("rcase", realistic.CASES, ids=lambda c: c.name.replace(" ", "_"))
def test_fp8_forward_state(case, rcase):
    """The saved operands are the Triton quantization's (bit for bit), the output is the 8-bit
    kernel's (bit for bit against ``attention_int8_sm90`` with its LSE), and the new log2-domain
    row statistics agree with that kernel's tested natural-log LSE: lse = ln2 lse2 + scale q.k_mean,
    with m2 <= lse2 <= m2 + log2(keys). (They differ from the Triton forward's by more than rounding
    on sharp heads: the two kernels quantize Q per token and per 64-row block.)"""
    _sm90_kernel_or_skip()
    from sage_diffusers.kernels import int8_sm90

    b, hq, hkv, sq, skv, d, causal, dtype = case
    q, k, v, mask = realistic.case_inputs(rcase, b, hq, hkv, sq, skv, d, seed=3, dtype=dtype, device="cuda")
    scale = d ** -0.5
    a = sagebwd_triton.sagebwd_forward(q, k, v, mask, causal, scale, pv="fp8")
    w = sagebwd_triton.sagebwd_forward(q, k, v, mask, causal, scale, pv="int8")
    for name in ("q8", "sq", "k8", "sk", "v8", "sv", "vc"):
        assert torch.equal(getattr(a, name), getattr(w, name)), name
    out, lse = int8_sm90.attention_int8_sm90(q, k, v, key_mask=mask, is_causal=causal, scale=scale, return_lse=True)
    assert torch.equal(a.out, out)
    assert a.out.is_contiguous()
    live = torch.isfinite(lse)
    assert torch.equal(live, torch.isfinite(a.lse2)) and torch.equal(live, torch.isfinite(a.m2))
    assert torch.equal(live, torch.isfinite(w.lse2))  # the same rows see keys
    assert (a.m2[~live] == -float("inf")).all() and (a.lse2[~live] == -float("inf")).all()
    k_mean = ref.key_mean(k, mask).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, D)
    shift = scale * (q.float() @ k_mean[..., None]).squeeze(-1)
    got = a.lse2 * math.log(2.0) + shift
    tol = 1e-3 + 2e-6 * (lse.abs() + shift.abs())
    assert ((got - lse).abs()[live] <= tol[live]).all(), (rcase.name, (got - lse).abs()[live].max().item())
    assert (a.m2[live] <= a.lse2[live] + 1e-4).all()
    assert (a.lse2[live] <= a.m2[live] + math.log2(skv) + 1e-3).all()


def _exact_grads(q, k, v, do, mask, causal, scale):
    """float32 attention's output and gradients; masked keys' NaN never enter (they are zeroed)."""
    hidden = None if mask is None else ~mask[:, None, :, None]
    k0, v0 = ((t if hidden is None else t.masked_fill(hidden, 0.0)) for t in (k, v))
    x = [t.detach().float().requires_grad_() for t in (q, k0, v0)]
    sq, skv = q.shape[2], k.shape[2]
    m = None if mask is None else mask[:, None, None, :]
    if causal:
        tri = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
        m = tri if m is None else m & tri
    out = F.scaled_dot_product_attention(*x, attn_mask=m, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(do.float())
    return [out.detach()] + [t.grad for t in x]


def _sage_grads(q, k, v, do, mask, causal, scale, fwd, monkeypatch):
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_FWD", fwd)
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = sd.sagebwd(*x, attn_mask=None, is_causal=causal, scale=scale, key_mask=mask)
    out.backward(do)
    return [out.detach()] + [t.grad for t in x]


GRAD_CASES = [
    (2, 4, 2, 1000, 1000, 128, False, torch.bfloat16),
    (1, 4, 4, 777, 1531, 64, True, torch.float16),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}")
@pytest.mark.parametrize("rcase", realistic.CASES, ids=lambda c: c.name.replace(" ", "_"))
def test_fp8_forward_gradients(case, rcase, monkeypatch):
    """Gradients through the fp8 forward: finite wherever float32 attention's are in the input dtype,
    and no more than 2e-3 (cos against float32 attention) behind the Triton forward's."""
    _sm90_kernel_or_skip()
    b, hq, hkv, sq, skv, d, causal, dtype = case
    q, k, v, mask = realistic.case_inputs(rcase, b, hq, hkv, sq, skv, d, seed=5, dtype=dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to("cuda", dtype)
    scale = d ** -0.5
    want = _exact_grads(q, k, v, do, mask, causal, scale)
    fp8 = _sage_grads(q, k, v, do, mask, causal, scale, "fp8", monkeypatch)
    int8 = _sage_grads(q, k, v, do, mask, causal, scale, "int8", monkeypatch)
    for name, g8, gi, w in zip(("out", "dq", "dk", "dv"), fp8, int8, want):
        # fp16 gradients can overflow where float32 attention's are finite: SDPA's in fp16 would too
        assert torch.isfinite(g8)[torch.isfinite(w.to(dtype))].all(), name
        c8, ci = cosine(g8, w), cosine(gi, w)
        assert c8 > ci - 2e-3, (rcase.name, name, c8, ci)
