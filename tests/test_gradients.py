"""Gradient contracts of SageBwd (``sd.sagebwd`` and ``sd.attention(mode="int8")`` with gradients).

- no double backward: ``create_graph=True`` raises a RuntimeError naming SageBwd (it used to run
  and give a silently wrong second derivative);
- the LSE of ``return_lse=True`` is differentiable, its gradient taken by the quantized backward
  (dS = P o (dP - (delta - dlse))), checked against float64 autograd;
- a float ``attn_mask`` that requires grad runs SDPA in every entry point, and gets its gradient.

The Triton kernels' part runs on the CPU in Triton's interpreter: ``test_kernel_cases_under_interpreter``
runs this file again in a child process with ``TRITON_INTERPRET=1`` (set before triton is imported,
as in tests/test_sagebwd_triton.py) and only the tests named ``*triton*``, on small shapes.
"""
import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sage_diffusers as sd
from sage_diffusers.reference import cosine, relative_l1
from sage_diffusers.reference import sagebwd as ref
from sage_diffusers.reference.sagebwd import DoVPrecision
from sage_diffusers.sagebwd import Impl, SageBwdFunction

from inputs import dit_qkv, key_padding_mask

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if IN_INTERPRETER else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason="no CUDA device: runs in the interpreter child")


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


def _loss(out, lse, do, dl):
    """sum(out o dO) + sum(lse o dl) over rows whose lse is finite (the -inf rows carry no gradient)."""
    acc = torch.promote_types(out.dtype, torch.float32)  # float64 for the exact reference
    lse_part = torch.where(torch.isfinite(lse), lse, 0.0) * dl.to(lse.dtype)
    return (out.to(acc) * do.to(acc)).sum() + lse_part.sum()


def grads(fn, q, k, v, do, dl):
    """(out, lse, dq, dk, dv) of ``fn(q, k, v) -> (out, lse)`` under :func:`_loss`, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    _loss(out, lse, do, dl).backward()
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def exact_grads(q, k, v, do, dl, **kw):
    got = grads(lambda a, b, c: exact_out_lse(a, b, c, **kw), q.double(), k.double(), v.double(), do, dl)
    return tuple(g.double() for g in got)


def int8_attention(**kw):
    return lambda a, b, c: sd.attention(a, b, c, mode="int8", return_lse=True, **kw)


def _assert_close_to_exact(got, want, names=("out", "lse", "dq", "dk", "dv"), cos_min=0.998, rl1_max=0.07):
    for name, g, w in zip(names, got, want):
        if w.abs().max() == 0:
            assert g.abs().max() == 0, name
            continue
        fin = torch.isfinite(w)
        assert torch.equal(fin, torch.isfinite(g)), name
        g, w = g.double()[fin], w[fin]
        assert cosine(g, w) > cos_min and relative_l1(g, w) < rl1_max, (name, cosine(g, w), relative_l1(g, w))


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
# The LSE's gradient

LSE_CASES = [
    # (b, hq, hkv, sq, skv, d, causal, masked, k_bias)
    (1, 2, 2, 96, 128, 64, False, False, 2.0),
    (2, 4, 2, 70, 90, 64, True, True, 20.0),  # GQA; a large K bias: the smoothing shift's dQ term matters
    (1, 2, 1, 65, 130, 128, False, True, 5.0),
]


def _lse_case_inputs(case):
    b, hq, hkv, sq, skv, d, causal, masked, k_bias = case
    q, k, v = make_inputs(b, hq, hkv, sq, skv, d, k_bias=k_bias)
    key_mask = None
    if masked:
        key_mask = torch.rand(b, skv) > 0.3
        key_mask[0, 0] = True
        if b > 1:
            key_mask[1] = False  # a batch row with no visible key: out 0, lse -inf, zero gradients
    do = torch.randn(b, hq, sq, d).to(q.dtype)
    dl = 4.0 * torch.randn(b, hq, sq)
    return q, k, v, do, dl, dict(key_mask=key_mask, is_causal=causal)


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}m{int(c[7])}")
def test_lse_gradient_matches_float64(case):
    """Bug: sd.attention(mode="int8", return_lse=True) with inputs requiring grad returned an LSE
    without a gradient: a loss using it got nothing from it. Now out and lse backpropagate together
    through SageBwd's quantized backward (dS = P o (dP - delta + dlse)) and match float64 autograd."""
    q, k, v, do, dl, kw = _lse_case_inputs(case)
    got = grads(int8_attention(**kw), q, k, v, do, dl)
    assert sd.fallback_stats() == {}  # SageBwd ran, not SDPA
    _assert_close_to_exact(got, exact_grads(q, k, v, do, dl, **kw))
    if kw["key_mask"] is not None and q.shape[0] > 1:  # the row without keys
        assert torch.all(got[1][1] == -math.inf) and torch.all(got[2][1] == 0) and torch.all(got[4][1] == 0)


def test_lse_only_loss_has_gradients():
    """Bug: a loss of the LSE alone raised "element 0 of tensors does not require grad". Now q and k
    get the LSE's gradient (dv stays exactly 0: the LSE does not depend on v), including the K mean's
    term (a K bias of 20 makes it most of dQ)."""
    q, k, v = make_inputs(1, 2, 2, 64, 96, 64, k_bias=20.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _, lse = sd.attention(*leaves, mode="int8", return_lse=True)
    assert lse.requires_grad and lse.dtype == torch.float32
    lse.sum().backward()
    assert torch.all(leaves[2].grad == 0)
    want = exact_grads(q, k, v, torch.zeros_like(q), torch.ones(1, 2, 64))
    _assert_close_to_exact((leaves[0].grad, leaves[1].grad), want[2:4], names=("dq", "dk"))


def test_lse_value_unchanged_and_out_gradient_unaffected():
    """The LSE keeps its value (exact float32 scores, as SDPA's path computes it), and a loss of the
    output alone gets the same gradients with or without return_lse (dlse = 0 changes nothing)."""
    q, k, v = make_inputs(1, 2, 1, 70, 70, 64)
    do = torch.randn_like(q)
    outs = []
    for return_lse in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        res = sd.attention(*leaves, mode="int8", return_lse=return_lse)
        out = res[0] if return_lse else res
        out.backward(do)
        outs.append((out.detach(), *(t.grad for t in leaves)))
        if return_lse:
            with torch.no_grad():
                exact = sd.attention(q, k, v, mode="sdpa", return_lse=True)[1]
            assert torch.equal(res[1].detach(), exact)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_reference_lse_gradient_ignores_rows_without_keys():
    """A NaN or Inf dlse on a row that sees no key (lse -inf, P = 0) must not leak: dS = P o dlse
    would be 0 * NaN. Those rows' dlse count as 0."""
    q, k, v = make_inputs(2, 2, 2, 40, 50, 32)
    key_mask = torch.rand(2, 50) > 0.3
    key_mask[1] = False
    st = ref.sagebwd_forward(q, k, v, key_mask)
    do = torch.randn_like(q)
    dl = torch.randn(2, 2, 40)
    clean = ref.sagebwd_backward(do, st, key_mask, dlse=dl, k_mean=ref.key_mean(k, key_mask))
    dl[1] = float("nan")
    dl[1, 0, 0] = float("inf")
    dirty = ref.sagebwd_backward(do, st, key_mask, dlse=dl, k_mean=ref.key_mean(k, key_mask))
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def test_reference_backward_checks_lse_grad_shapes():
    q, k, v = make_inputs(1, 2, 1, 20, 30, 32)
    st = ref.sagebwd_forward(q, k, v)
    do = torch.randn_like(q)
    with pytest.raises(ValueError, match=r"dlse: expected shape \(B, Hq, Sq\) = \(1, 2, 20\), got \(1, 2, 21\)"):
        ref.sagebwd_backward(do, st, dlse=torch.zeros(1, 2, 21), k_mean=torch.zeros(1, 1, 32))
    with pytest.raises(ValueError, match=r"k_mean: expected shape \(B, Hkv, D\) = \(1, 1, 32\) with dlse, got None"):
        ref.sagebwd_backward(do, st, dlse=torch.zeros(1, 2, 20))


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


@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_a_float_mask_that_requires_grad_runs_sdpa(mode):
    """A float key-padding mask (0 / -inf) that requires grad has no gradient on the low-bit paths
    (SageBwd included): SDPA runs, counted "backward", and the mask gets its gradient.

    Fails on: the float mask left out of the gradient decision (always None, or ``needs_grad(None)``)."""
    q, k, v = dit_qkv(1, 2, 2, 24, 24, 64, seed=8)
    kp = key_padding_mask(1, 24, seed=9)
    bias = torch.zeros(1, 1, 1, 24).masked_fill(~kp[:, None, None, :], -math.inf).requires_grad_()
    qg = q.clone().requires_grad_()
    sd.attention(qg, k, v, bias, mode=mode).sum().backward()
    assert sd.fallback_stats() == {f"{mode}: backward": 1}
    assert bias.grad is not None and qg.grad is not None


def test_sagebwd_mask_that_requires_grad_runs_natively_without_grad_mode():
    """Under torch.no_grad a mask that requires grad needs no gradient: SageBwd's forward runs with
    it as key padding (no fallback), exactly as with the equivalent bool key_mask."""
    q, k, v = make_inputs(1, 2, 2, 30, 40, 64, dtype=torch.float32)
    bias, keep = _key_padding_bias(1, 40)
    with torch.no_grad(), sd.mask_scope():  # a float mask is read (once) only inside a scope
        out = sd.sagebwd(q, k, v, attn_mask=bias, impl=Impl.REFERENCE)
        want = sd.sagebwd(q, k, v, key_mask=keep, impl=Impl.REFERENCE)
    assert sd.fallback_stats() == {}
    assert torch.equal(out, want)
    assert bias.grad is None and bias.requires_grad  # the caller's mask untouched


# ---------------------------------------------------------------------------------------------
# Triton kernels (the interpreter child on CPU, the compiled kernels on a GPU)


@pytest.mark.skipif(IN_INTERPRETER or TRITON_DEVICE is not None, reason="this is the interpreter child, or a GPU runs the kernels")
def test_kernel_cases_under_interpreter():
    # Triton's CPU interpreter runs SageBwd's kernels from 3.7 on (tests/test_sagebwd_triton.py says more).
    try:
        import triton
    except ImportError as exc:
        pytest.skip(f"triton does not import ({exc}; CPU-only torch wheels bring none, the test extra installs it "
                    "on Linux): no interpreter to run the kernels")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s CPU interpreter cannot run SageBwd's kernels (3.7 and later can)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k", "triton"],
        env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and " failed" not in res.stdout and " skipped" not in res.stdout, res.stdout[-2000:]


TRITON_LSE_CASES = [
    # (b, hq, hkv, sq, skv, d, causal, masked, bwd kernels)
    (1, 2, 1, 70, 90, 32, False, True, "split"),
    (2, 2, 2, 65, 64, 32, True, True, "fused"),
    (1, 2, 2, 64, 100, 64, False, False, "lean"),
]


@needs_triton
@pytest.mark.parametrize("case", TRITON_LSE_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}m{int(c[7])}-{c[8]}")
def test_triton_lse_gradient_matches_reference(case, monkeypatch):
    """The Triton backward takes dlse as the reference does (delta - dlse in every dS tile, the
    K mean's dQ term): on the reference's own state, within the kernels' usual bounds (only dS
    codes at INT8 rounding ties may differ); dlse = 0 gives the plain backward's bits."""
    from sage_diffusers.kernels import sagebwd_triton as tri

    b, hq, hkv, sq, skv, d, causal, masked, kernels = case
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", kernels)
    q, k, v = make_inputs(b, hq, hkv, sq, skv, d, k_bias=10.0, device=TRITON_DEVICE)
    key_mask = None
    if masked:
        key_mask = torch.rand(b, skv, device=TRITON_DEVICE) > 0.3
        key_mask[:, 0] = True
        if b > 1:
            key_mask[1] = False
    do = torch.randn_like(q)
    dl = 4.0 * torch.randn(b, hq, sq, device=TRITON_DEVICE)
    k_mean = ref.key_mean(k, key_mask)
    st = ref.sagebwd_forward(q, k, v, key_mask, causal)
    want = ref.sagebwd_backward(do, st, key_mask, causal, dlse=dl, k_mean=k_mean)
    got = tri.sagebwd_backward(do, st, key_mask, causal, dlse=dl, k_mean=k_mean)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        if w.abs().max() == 0:
            assert a.abs().max() == 0, name
            continue
        assert cosine(a, w) > 0.9999 and relative_l1(a, w) < 5e-3, (name, cosine(a, w), relative_l1(a, w))
    plain = tri.sagebwd_backward(do, st, key_mask, causal)
    zero = tri.sagebwd_backward(do, st, key_mask, causal, dlse=torch.zeros_like(dl), k_mean=k_mean)
    for name, a, w in zip(("dq", "dk", "dv"), zero, plain):
        assert torch.allclose(a, w, rtol=0, atol=1e-6 * w.abs().max().item()), name


@needs_triton
def test_triton_autograd_function_lse_and_double_backward():
    """Through the autograd function on the Triton path: out and lse backpropagate together close
    to float64 autograd, and create_graph=True is refused there as on the reference path."""
    q, k, v = make_inputs(1, 2, 1, 70, 90, 64, k_bias=10.0, device=TRITON_DEVICE)
    key_mask = torch.rand(1, 90, device=TRITON_DEVICE) > 0.3
    do = torch.randn_like(q)
    dl = 4.0 * torch.randn(1, 2, 70, device=TRITON_DEVICE)

    def fn(a, b, c):
        return SageBwdFunction.apply(a, b, c, key_mask, False, 0.125, DoVPrecision.FP16, Impl.TRITON, True)

    got = grads(fn, q, k, v, do, dl)
    want = exact_grads(q, k, v, do, dl, key_mask=key_mask)
    _assert_close_to_exact(tuple(g.cpu() for g in got), tuple(w.cpu() for w in want))
    with pytest.raises(RuntimeError, match=r'sage_diffusers SageBwd .*mode="sdpa"'):
        _penalty_second_derivative(lambda a, b, c: fn(a, b, c)[0], q, k, v)


def _forward_ad(kind, fn, q, t):
    """fn's output and tangent at q along t, by torch.func.jvp or by forward_ad dual tensors."""
    if kind == "jvp":
        return torch.func.jvp(fn, (q,), (t,))
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(q, t)))
        return primal.clone(), tangent.clone()


@pytest.mark.parametrize("math_backend", [False, True], ids=["default", "math"])
@pytest.mark.parametrize("kind", ["jvp", "forward_ad"])
@pytest.mark.parametrize("mode", ["int8", "fp4", "auto"])
def test_forward_mode_ad_takes_sdpas_path(mode, kind, math_backend):
    """Bug: forward-mode AD (torch.func.jvp, forward_ad dual tensors) sets no requires_grad, so the call
    took the inference references and forward AD differentiated their rounding: tangents at cos 0.06
    (int8) / 0.14 (fp4) against the exact ones, silently. Such calls run SDPA now (counted), which gives
    its tangent (the math backend has one) or torch's own error (CPU flash has none), as mode "sdpa"."""
    q, k, v = dit_qkv(1, 2, 2, 70, 70, 64, seed=3)
    t = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))

    def run(m):
        try:
            with sdpa_kernel(SDPBackend.MATH) if math_backend else contextlib.nullcontext():
                return _forward_ad(kind, lambda q_: sd.attention(q_, k, v, mode=m), q, t)
        except NotImplementedError as exc:
            return type(exc)

    sd.reset_fallback_stats()
    got, want = run(mode), run("sdpa")
    if isinstance(want, type):
        assert got is want
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if mode != "auto":  # auto runs SDPA on CPU anyway
        assert sd.fallback_stats().get(f"{mode}: forward-mode AD", 0) >= 1
