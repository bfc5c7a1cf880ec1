"""SageBwd's Triton kernels against the torch reference (the spec).

On the CPU the kernels run in Triton's interpreter: ``test_kernels_under_interpreter`` runs this
file again in a child process with ``TRITON_INTERPRET=1`` set before triton is first imported
(triton decides at import which of its own helpers are interpreted, so the variable cannot be
switched on inside a session that imported it already), on small shapes. On a CUDA device the
compiled kernels run the same checks directly. Quantized operands must match bit for bit;
outputs and gradients, which differ only in float summation order (and exp2 on a GPU), within
the stated bounds. The backward is checked on the reference's own saved state, so its bounds do
not include the forward's rounding.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_diffusers.kernels import sagebwd_triton
from sage_diffusers.reference import cosine, relative_l1
from sage_diffusers.reference import sagebwd as ref
from sage_diffusers.reference.quant import _div

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels' own availability check reports it; nothing here runs without a device
    triton = None

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if IN_INTERPRETER else (["cuda"] if torch.cuda.is_available() else [])
needs_device = pytest.mark.skipif(not DEVICES, reason="no CUDA device: runs in the interpreter child")
# (rows on the wide tile side under the interpreter (a GPU autotunes it instead), how the
# kernels convert their int32 products: SAGE_DIFFUSERS_SAGEBWD_ACC, which backward kernels:
# SAGE_DIFFUSERS_SAGEBWD_BWD; the fused one always takes 64 keys per program)
VARIANTS = ([(128, "xu", "split"), (64, "alu", "lean"), (128, "xu", "fused")] if IN_INTERPRETER
            else [(None, "xu", "split"), (None, "alu", "split"), (None, "xu", "lean"), (None, "xu", "fused")])


def kernels():
    return sagebwd_triton


@pytest.fixture(params=VARIANTS, ids=lambda p: "-".join(([f"wide{p[0]}"] if p[0] else []) + list(p[1:])))
def variant(request, monkeypatch):
    """Runs a test under each variant (the kernels read the environment at call time)."""
    wide, acc, bwd = request.param
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_ACC", acc)
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", bwd)
    if wide:
        monkeypatch.setattr(sagebwd_triton, "INTERPRET_WIDE", wide)
    return request.param


def _triton_version() -> "tuple[int, int] | None":
    """(major, minor) of the installed triton; None without one."""
    return None if triton is None else tuple(int(p) for p in triton.__version__.split(".")[:2])


# Triton's CPU interpreter runs these kernels from 3.7 on (3.6's stops on them with a TypeError), and
# rounds tl.fma once, as a GPU does, from 3.9 on (before, the product and the sum round separately).
# PyPI's torch pins its triton (2.11: 3.6, 2.12: 3.7.0, 2.13: 3.7.1, 2.14: 3.8); the test extra adds no pin.
TRITON_VERSION = _triton_version()
if TRITON_VERSION is None:
    INTERPRETER_SKIP = ("triton does not import (CPU-only torch wheels bring none; the test extra installs it on "
                        "Linux): no interpreter to run the kernels")
elif TRITON_VERSION < (3, 7):
    INTERPRETER_SKIP = f"Triton {triton.__version__}'s CPU interpreter cannot run these kernels (3.7 and later can)"
else:
    INTERPRETER_SKIP = None
INTERPRETER_FMA_SKIP = IN_INTERPRETER and TRITON_VERSION is not None and TRITON_VERSION < (3, 9)


def run_under_interpreter(test_file: str) -> None:
    """Run ``test_file`` in a pytest child with ``TRITON_INTERPRET=1`` set before triton's import;
    fails unless its tests pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and " failed" not in res.stdout


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter child itself")
@pytest.mark.skipif(INTERPRETER_SKIP is not None, reason=INTERPRETER_SKIP or "")
def test_kernels_under_interpreter():
    run_under_interpreter(str(Path(__file__)))


def inputs(b, hq, hkv, sq, skv, d, dtype, device, masked):
    q = torch.randn(b, hq, sq, d).to(dtype)
    k = (torch.randn(b, hkv, skv, d) + 2 * torch.randn(d)).to(dtype)
    v = torch.randn(b, hkv, skv, d).to(dtype)
    do = torch.randn(b, hq, sq, d).to(dtype)
    key_mask = (torch.rand(b, skv) > 0.3) if masked else None
    if masked == "text":  # contiguous windows, as text padding gives: whole key tiles outside them are skipped
        key_mask = torch.zeros(b, skv, dtype=torch.bool)
        for i in range(b):  # batch 0: trailing padding; 1: both sides; 2: no attended key at all
            if i % 3 == 0:
                key_mask[i, :skv // 5] = True
            elif i % 3 == 1:
                key_mask[i, skv // 2:skv - 7] = True
    elif masked == "hole":  # text first, its padding a run of whole key tiles inside the attended extent
        key_mask = torch.ones(b, skv, dtype=torch.bool)
        key_mask[:, 9:140] = False  # whole tiles 64-127 (64-key tiles) masked; the run after it all attended
        key_mask[-1, 300:] = False  # the last batch: a window cut short as well
    elif masked:
        key_mask[0, :3] = True
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return tuple(map(move, (q, k, v, do, key_mask)))


QUANTIZED = ("q8", "sq", "k8", "sk", "v8", "sv", "vc", "qc", "kc")  # qc, kc: 16-bit, empty with INT8 scores
CASES = [
    # (b, hq, hkv, sq, skv, d, dtype, causal, masked, pv, dov, scores)
    (1, 2, 2, 64, 64, 32, torch.float16, False, False, "int8", "fp16", "int8"),
    (1, 2, 1, 113, 77, 64, torch.bfloat16, True, True, "int8", "fp16", "int8"),
    (2, 2, 2, 65, 130, 32, torch.float16, False, True, "fp16", "int8", "int8"),
    (1, 1, 1, 1, 1, 32, torch.bfloat16, False, False, "int8", "fp16", "int8"),
    (1, 2, 2, 40, 70, 128, torch.bfloat16, True, False, "int8", "int8", "int8"),
    (1, 2, 2, 33, 50, 32, torch.float32, False, True, "int8", "fp16", "int8"),
    # GQA, two wide tiles and a partial one
    (1, 4, 2, 239, 150, 64, torch.bfloat16, True, True, "int8", "fp16", "int8"),
    # 16-bit scores (ScorePrecision.FP16): as SageBwd pairs them (pv fp16), and with the other axes' INT8 choices
    (1, 2, 1, 113, 77, 64, torch.bfloat16, True, True, "fp16", "fp16", "fp16"),
    (2, 2, 2, 65, 130, 32, torch.float16, False, True, "int8", "int8", "fp16"),
    (1, 2, 2, 40, 70, 128, torch.float32, True, False, "fp16", "fp16", "fp16"),  # float32: bfloat16 operands
    # key-padding windows longer than a key tile (the kernels skip the tiles outside them), odd lengths
    (3, 2, 1, 97, 333, 64, torch.bfloat16, False, "text", "int8", "fp16", "int8"),
    (3, 2, 2, 150, 333, 32, torch.float16, True, "text", "fp16", "fp16", "fp16"),
    # the padding of a text-first joint sequence: whole key tiles masked inside the extent (skipped)
    (2, 2, 1, 140, 333, 64, torch.bfloat16, False, "hole", "fp16", "fp16", "fp16"),
    (2, 2, 2, 333, 333, 32, torch.float16, True, "hole", "int8", "fp16", "int8"),
]


def _id(c):
    mask = c[8] if isinstance(c[8], str) else int(c[8])
    return f"{'x'.join(map(str, c[:6]))}-{str(c[6])[6:]}-c{int(c[7])}m{mask}-pv{c[9]}-dov{c[10]}-s{c[11]}"


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernels_match_reference(case, device, variant):
    b, hq, hkv, sq, skv, d, dtype, causal, masked, pv, dov, scores = case
    tri = kernels()
    q, k, v, do, key_mask = inputs(b, hq, hkv, sq, skv, d, dtype, device, masked)
    want = ref.sagebwd_forward(q, k, v, key_mask, causal, None, pv, scores)
    got = tri.sagebwd_forward(q, k, v, key_mask, causal, None, pv, scores)
    for field in QUANTIZED:  # the pre-pass is bit-exact
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    tol = 1e-5 if device == "cpu" else 1e-4  # exp2 / summation order only
    assert torch.allclose(got.m2, want.m2, atol=tol, rtol=0)
    assert torch.allclose(got.lse2, want.lse2, atol=tol, rtol=0)
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 2 ** -8
    assert (got.out.float() - want.out.float()).abs().max() <= 4 * eps * want.out.float().abs().max() + 1e-6
    # backward on the reference's state: the same inputs for both implementations
    gw = ref.sagebwd_backward(do, want, key_mask, causal, None, dov, scores=scores)
    gg = tri.sagebwd_backward(do, want, key_mask, causal, None, dov, scores=scores)
    for name, a, w in zip(("dq", "dk", "dv"), gg, gw):
        if w.abs().max() == 0:
            assert a.abs().max() == 0, name
            continue
        # a dS element on an INT8 rounding tie may take the neighbouring code: tiny, isolated errors
        assert cosine(a, w) > 0.9999 and relative_l1(a, w) < 5e-3, (name, cosine(a, w), relative_l1(a, w))


KEY_EXTENT_CASE = [[0, 4, 0, 4], [3, 9, 3, 9], [2, 8, 7, 8], [10, 0, 0, 0], [0, 10, 5, 10]]


def test_key_extent_and_token_stride():
    """The attended keys' extent per batch (first, last + 1; Skv, 0 when none), the all-attended
    run ending at the last attended key (the window itself when there is no hole), and the aligned token
    stride of the transposed copies: the bounds the kernels' tile skipping, mask-test skipping and
    loads rely on."""
    tri = kernels()
    mask = torch.zeros(5, 10, dtype=torch.bool)
    mask[0, :4] = True
    mask[1, 3:9] = True
    mask[2, [2, 7]] = True
    mask[4, :2] = mask[4, 5:] = True  # text first, its padding a hole: the run after it
    extent = tri.key_extent_reference(mask)  # the spec of the kernel (test_key_extent_kernel)
    assert extent.dtype == torch.int32 and extent.tolist() == KEY_EXTENT_CASE
    placeholder = torch.zeros(1, dtype=torch.int32)
    assert tri.key_extent(None, placeholder) is placeholder  # unmasked: nothing computed, never read
    assert [tri.token_stride(s) for s in (1, 16, 17, 15565)] == [16, 16, 32, 15568]
    x8 = torch.randint(-127, 128, (1, 2, 37, 8), dtype=torch.int8)
    t = tri._transposed(x8)
    assert torch.equal(t, x8.transpose(-1, -2)) and t.stride(-2) == 48 and t.stride(-1) == 1


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_key_extent_kernel(device):
    """The key-extent kernel equals its torch spec: the hand-made rows above, then rows past one
    1024-key block with holes, edges, empty and full rows, and a batch of none."""
    tri = kernels()
    mask = torch.zeros(5, 10, dtype=torch.bool)
    mask[0, :4] = True
    mask[1, 3:9] = True
    mask[2, [2, 7]] = True
    mask[4, :2] = mask[4, 5:] = True
    placeholder = torch.zeros(1, dtype=torch.int32, device=device)
    assert tri.key_extent(mask.to(device), placeholder).tolist() == KEY_EXTENT_CASE
    g = torch.Generator().manual_seed(0)
    for skv in (1, 1023, 1024, 2500):
        m = torch.rand(6, skv, generator=g) < 0.7
        m[1] = False
        m[2] = True
        m[3, :] = False
        m[3, skv // 2:] = True
        m[4, :] = False
        m[4, :min(77, skv)] = True
        m[4, min(512, skv - 1):] = True  # text first, a hole of whole tiles, then the image
        got = tri.key_extent(m.to(device), placeholder).cpu()
        assert torch.equal(got, tri.key_extent_reference(m)), skv
    assert tri.key_extent(torch.zeros(0, 5, dtype=torch.bool, device=device), placeholder).shape == (0, tri.KEXT)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dov", ["fp16", "int8"])
def test_backward_prepass_matches_reference(device, dov):
    """The pre-pass kernel: delta, 1/l and the row max as the reference computes them, and the
    codes of dO' = dO / l (and of dO for the INT8 dP) bit for bit as the reference quantizes
    them given that 1/l; a row without a visible key (lse -inf) gets 1/l = 1 and row max +inf."""
    tri = kernels()
    q, k, v, do, key_mask = inputs(1, 2, 1, 70, 50, 32, torch.bfloat16, device, True)
    st = ref.sagebwd_forward(q, k, v, key_mask, True, None)
    lse2, m2 = st.lse2.clone(), st.m2.clone()
    lse2[0, 1, 3], m2[0, 1, 3] = float("-inf"), float("-inf")
    st = st._replace(lse2=lse2, m2=m2)
    do_t = do.transpose(-1, -2).contiguous().transpose(-1, -2)  # any strides
    r = tri.backward_rows(do_t, st, dov == "int8")
    live = torch.isfinite(lse2)
    want_inv_l = torch.exp2(torch.where(live, m2, 0.0) - torch.where(live, lse2, 0.0))
    inv_l = r.inv_l / tri.DS_PRESCALE.value  # an exact power-of-two factor
    assert torch.allclose(inv_l, want_inv_l, rtol=1e-6, atol=0) and inv_l[0, 1, 3] == 1
    assert torch.equal(r.mb, torch.where(live, m2, float("inf")))
    assert torch.allclose(r.delta, (do.float() * st.out.float()).sum(-1), rtol=1e-5, atol=1e-6)
    dos8, sdos = ref.quantize_int8_per_block(do.float() * inv_l[..., None], ref.BLOCK_Q)
    assert torch.equal(r.dos8t.transpose(-1, -2), dos8) and torch.equal(r.sdos, sdos)
    if dov == "int8":
        do8, sdo = ref.quantize_int8_per_block(do, ref.BLOCK_Q)
        assert torch.equal(r.do8, do8) and torch.equal(r.sdo, sdo)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,masked", [(False, True), (True, True), (False, "text")])
def test_backward_kernel_choices_agree(device, causal, masked, monkeypatch):
    """LEAN reorders SPLIT's dK/dV kernel (dV product last, int32 products in column halves at
    D = 128) without changing any operation: the same bits. FUSED computes dK and dV the same way
    (same bits) and adds dQ by atomics, so only dQ's summation order differs; both of its paths:
    128 keys per program (two dS tiles per atomic add) and 64.

    Under the interpreter each fused run is compared with split at the same tile width: there the
    16-bit dP product is a BLAS matmul whose summation order can depend on the matrix shape and on
    the CPU (OpenBLAS picks its kernel per CPU: on an AVX2-only one, 64 and 128 rows round apart)."""
    tri = kernels()
    q, k, v, do, key_mask = inputs(1 if masked is True else 2, 4, 2, 100, 130, 128, torch.bfloat16, device, masked)
    st = ref.sagebwd_forward(q, k, v, key_mask, causal, None)
    runs = [(c, 128) for c in tri.BwdKernels] + [(tri.BwdKernels.FUSED, 64)]
    if IN_INTERPRETER:
        runs.append((tri.BwdKernels.SPLIT, 64))
    grads = {}
    for choice, wide in runs:
        monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", choice.value)
        if IN_INTERPRETER:
            monkeypatch.setattr(tri, "INTERPRET_WIDE", wide)
        elif choice is tri.BwdKernels.FUSED:  # one config: the autotuner runs it untimed, uncached
            monkeypatch.setattr(tri._bwd_fused_kernel, "configs",
                                [triton.Config({"BLOCK_N": wide}, num_warps=wide // 16, num_stages=2,
                                               pre_hook=tri._zero_dq)])
        grads[choice, wide] = tri.sagebwd_backward(do, st, key_mask, causal, None)
    split = grads[tri.BwdKernels.SPLIT, 128]
    for name, a, w in zip(("dq", "dk", "dv"), grads[tri.BwdKernels.LEAN, 128], split):
        assert torch.equal(a, w), name
    for choice, wide in runs:
        if choice is tri.BwdKernels.FUSED:
            dq, dk, dv = grads[choice, wide]
            same = grads[tri.BwdKernels.SPLIT, wide] if IN_INTERPRETER else split
            assert torch.equal(dk, same[1]) and torch.equal(dv, same[2]), wide
            assert (dq - same[0]).abs().max() <= 1e-5 * same[0].abs().max(), wide


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [False, True], ids=["scattered", "text-window"])
def test_no_visible_key_rows_and_nan_in_masked_rows(device, variant, window):
    """Batch 1 attends no key; NaN sits in masked K rows. ``window``: batch 0 keeps one window of
    150 keys (text padding), so whole key tiles are skipped and the window's edge tiles test the mask,
    with NaN in K and V everywhere outside it."""
    tri = kernels()
    skv = 150 if window else 70
    q, k, v, do, _ = inputs(2, 2, 2, 40, skv, 32, torch.float16, device, False)
    if window:
        key_mask = torch.zeros(2, skv, dtype=torch.bool, device=device)
        key_mask[0, 20:83] = True
        k[:, :, ~key_mask[0]] = float("nan")
        v[:, :, ~key_mask[0]] = float("nan")
        hidden = ~key_mask[0]
    else:
        key_mask = torch.rand(2, skv, device=device) > 0.5
        key_mask[1] = False
        k[:, :, 5] = float("nan")
        key_mask[:, 5] = False
        hidden = torch.arange(skv, device=device) == 5
    st = tri.sagebwd_forward(q, k, v, key_mask, False, None)
    assert torch.all(st.out[1] == 0) and torch.all(torch.isinf(st.lse2[1]))
    assert torch.isfinite(st.out).all()
    dq, dk, dv = tri.sagebwd_backward(do, st, key_mask, False, None)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.all(dq[1] == 0) and torch.all(dk[:, :, hidden] == 0) and torch.all(dv[1] == 0)
    assert torch.all(dv[:, :, hidden] == 0)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_recomputed_scores_above_the_row_max_stay_bounded(device, variant):
    """The backward recomputes S; nothing guarantees its float32 sums repeat the forward's bits (they
    did on the H100 in the shipped tile shapes), and a score above the saved row max m would make
    P~ exceed 1. Modelled here by a state whose 16-bit Q differs from the one the
    forward scored by 2**-5 of each element (random sign), on a sharp head (x20): P~ = exp2(s - m) is
    clamped at 1 in the kernels and the reference alike, so the gradients stay bounded (dV 0.9x the
    unperturbed one's largest element, cos 0.92; dQ, dK 2-3x); unclamped, each grew 12-13x (dV cos 0.49)."""
    tri = kernels()
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 2, 64, 32, generator=g) * 20).bfloat16().to(device)
    k = (torch.randn(1, 2, 96, 32, generator=g) + 2 * torch.randn(32, generator=g)).bfloat16().to(device)
    v = torch.randn(1, 2, 96, 32, generator=g).bfloat16().to(device)
    do = torch.randn(1, 2, 64, 32, generator=g).bfloat16().to(device)
    st = ref.sagebwd_forward(q, k, v, None, False, None, "fp16", "fp16")
    exact = ref.sagebwd_backward(do, st, scores="fp16")
    sign = torch.randint(0, 2, st.qc.shape, generator=g).to(device) * 2 - 1
    off = st._replace(qc=(st.qc.float() * (1 + 2 ** -5 * sign)).to(st.qc.dtype))
    want = ref.sagebwd_backward(do, off, scores="fp16")
    got = tri.sagebwd_backward(do, off, scores="fp16")
    for name, a, w, e, bound in zip(("dq", "dk", "dv"), got, want, exact, (6, 6, 1.5)):
        assert cosine(a, w) > 0.9999, (name, cosine(a, w))
        assert w.abs().max() < bound * e.abs().max(), (name, w.abs().max() / e.abs().max())
    assert cosine(want[2], exact[2]) > 0.85


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_output_saturates_instead_of_overflowing(device):
    """V at fp16's largest value: exact attention gives 65504 everywhere, but P~'s INT8 codes round
    up in some rows and the quantized sum exceeds 65520 there, which a plain cast makes inf. The
    kernel's output and the reference's saturate at 65504 instead (float32 inputs of the same values
    show the overshoot)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 64, 32, generator=g).half()
    k = torch.randn(1, 2, 96, 32, generator=g).half()
    v = torch.full((1, 2, 96, 32), 65504.0).half()
    wide = ref.sagebwd_forward(q.float(), k.float(), v.float()).out
    assert (wide > 65520).any()  # would be inf in fp16
    want = ref.sagebwd_forward(q, k, v).out
    got = kernels().sagebwd_forward(q.to(device), k.to(device), v.to(device)).out.cpu()
    for out in (want, got):
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert (out[wide > 65520] == 65504).all()
    assert torch.equal(got, want)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_inference_backend_lse_matches_reference(device):
    tri = kernels()
    q, k, v, _, key_mask = inputs(1, 2, 1, 50, 90, 64, torch.float16, device, True)
    out, lse = tri.attention_int8_triton(q, k, v, key_mask=key_mask, is_causal=False, scale=None, return_lse=True)
    st = ref.sagebwd_forward(q, k, v, key_mask, pv="fp16")  # the inference default: 16-bit P~.V
    exact = torch.logsumexp((q.float() @ k.float().transpose(-1, -2) / 8.0).repeat_interleave(1, 1)
                            .masked_fill(~key_mask[:, None, None, :], float("-inf")), -1)
    assert torch.allclose(lse, exact, atol=0.05)
    assert (out.float() - st.out.float()).abs().max() < 4e-3


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scores", ["int8", "fp16"])
def test_custom_ops_and_compile(device, scores):
    """The kernels run as torch ops with fake implementations: opcheck, and torch.compile over
    sd.sagebwd on the Triton path (fullgraph: no tracing into Triton launches); with 16-bit scores
    the state's 16-bit Q and K are real outputs (empty ones with INT8 scores)."""
    import sage_diffusers as sd
    from sage_diffusers.sagebwd import Impl

    tri = kernels()
    pv = ref.ScorePrecision(scores).pv.value  # what SageBwd pairs with these scores
    q, k, v, do, key_mask = inputs(1, 2, 1, 40, 70, 32, torch.float16, device, True)
    torch.library.opcheck(torch.ops.sage_diffusers.sagebwd_triton_fwd.default,
                          (q, k, v, key_mask, False, 0.125, pv, scores),
                          test_utils=("test_schema", "test_faketensor"))
    st = tri.sagebwd_forward(q, k, v, key_mask, False, 0.125, pv, scores)
    torch.library.opcheck(torch.ops.sage_diffusers.sagebwd_triton_bwd.default,
                          (do, *st, key_mask, False, 0.125, "fp16", None, None, scores),
                          test_utils=("test_schema", "test_faketensor"))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    fn = torch.compile(lambda a, b, c: sd.sagebwd(a, b, c, key_mask=key_mask, scores=scores, impl=Impl.TRITON),
                       backend="aot_eager", fullgraph=True)
    out = fn(qs, ks, vs)
    out.backward(do)
    want = tri.sagebwd_forward(q, k, v, key_mask, False, None, pv, scores)
    assert torch.equal(out, want.out)
    gq, gk, gv = tri.sagebwd_backward(do, want, key_mask, False, None, scores=scores)
    assert torch.equal(qs.grad, gq.to(q.dtype)) and torch.equal(vs.grad, gv.to(v.dtype))


if triton is not None:
    @triton.jit
    def _quant_ds_probe(x_ptr, codes_ptr, scale_ptr, R: tl.constexpr, SUB: tl.constexpr):
        """Runs the kernels' dS quantizer on one (R, SUB) tile."""
        rows = tl.arange(0, R)
        cols = tl.arange(0, SUB)
        ds = tl.load(x_ptr + rows[:, None] * SUB + cols[None, :])
        codes, scale = sagebwd_triton._quant_ds_rows(ds * sagebwd_triton.DS_PRESCALE, R, SUB)
        tl.store(codes_ptr + rows[:, None] * SUB + cols[None, :], codes)
        tl.store(scale_ptr + rows, scale)


@needs_device
@pytest.mark.skipif(INTERPRETER_FMA_SKIP, reason=f"Triton {getattr(triton, '__version__', '?')}'s CPU interpreter rounds "
                    "tl.fma twice (product, then sum; a GPU, and the interpreter from Triton 3.9 on, round once): "
                    "the quantizer's residual step is exact only with one rounding")
@pytest.mark.parametrize("device", DEVICES)
def test_ds_quantizer_is_the_ieee_division_at_rounding_ties(device):
    """The kernels' dS codes (reciprocal + one FMA residual step on dS * 2**32, no per-element division)
    equal the reference's rint(x / s) where it is hardest: x within a few ulps of (k + 1/2) s for
    every k, scales of every mantissa, a tile whose scale is subnormal (1/s would overflow without
    the prescale), an all-zero tile."""
    g = torch.Generator().manual_seed(0)
    tiles = []
    for t in range(8):
        amax = (1 + torch.rand((), generator=g)) * 2.0 ** torch.randint(-40, 40, (), generator=g).item()
        if t == 6:
            amax = torch.tensor(2e-38)  # tile scale subnormal, 1/s overflows: the rescaled path
        s = _div(amax.float().reshape(1), 127.0)[0]
        k = torch.randint(0, 127, (64, 64), generator=g).float()
        mid = ((k + 0.5) * s).float()
        ulps = torch.randint(-4, 5, (64, 64), generator=g, dtype=torch.int32)
        x = (mid.view(torch.int32) + ulps).view(torch.float32)
        x = torch.where(torch.rand(64, 64, generator=g) < 0.5, -x, x).clamp(-amax.float(), amax.float())
        x[0, 0] = amax  # the tile's absmax, so its scale is s
        tiles.append(torch.zeros(64, 64) if t == 7 else x)
    ds = torch.cat(tiles).reshape(4, 128, 64)  # four probes of two quantization tiles each
    want_codes, want_scale = ref.quantize_ds_tiles(ds.reshape(1, 1, 512, 64))
    want_codes = want_codes.reshape(512, 64).to(torch.int8)
    want_scale = want_scale.reshape(8).repeat_interleave(64)
    for i in range(4):
        x = ds[i].contiguous().to(device)
        codes = torch.empty(128, 64, dtype=torch.int8, device=device)
        scale = torch.empty(128, dtype=torch.float32, device=device)
        _quant_ds_probe[(1,)](x, codes, scale, R=128, SUB=64)
        assert torch.equal(codes.cpu(), want_codes[128 * i:128 * (i + 1)]), i
        assert torch.equal(scale.cpu(), want_scale[128 * i:128 * (i + 1)]), i


def test_backward_kernel_default_per_head_dim(monkeypatch):
    """Without SAGE_DIFFUSERS_SAGEBWD_BWD: LEAN at D = 128, FUSED at D = 64 unless torch's
    deterministic algorithms are on (FUSED's dQ atomics are not); the variable overrides both."""
    choose, kinds = sagebwd_triton.bwd_kernels, sagebwd_triton.BwdKernels
    monkeypatch.delenv("SAGE_DIFFUSERS_SAGEBWD_BWD", raising=False)
    assert choose(128) is kinds.LEAN and choose(64) is kinds.FUSED
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert choose(64) is kinds.LEAN
    finally:
        torch.use_deterministic_algorithms(was)
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "split")
    assert choose(64) is kinds.SPLIT and choose(128) is kinds.SPLIT


@pytest.mark.skipif(triton is None, reason="triton not importable")
def test_every_launch_runs_on_the_inputs_device(monkeypatch):
    """A Triton launch runs on the current CUDA device, with its current stream, not on the device of
    the tensors it is handed: inputs on cuda:1 while cuda:0 was current (a pipeline spread over GPUs)
    were refused ("Pointer argument cannot be accessed from Triton") or launched on the wrong GPU.
    Every launch of the forward and of both backward variants must sit inside
    torch.cuda.device_of(an input). CPU: stand-in kernels record the guard around each launch; the
    two-GPU run is test_gpu_api_strict.py::test_inputs_on_a_gpu_that_is_not_the_current_one."""
    tri = kernels()
    open_guards, launches = [], []

    class Guard:  # torch.cuda.device_of, recorded
        def __init__(self, obj):
            self.device = obj.device

        def __enter__(self):
            open_guards.append(self.device)

        def __exit__(self, *exc):
            open_guards.pop()

    class Kernel:  # kernel[grid](*args): records the guard open at the launch
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, tuple(open_guards)))

    names = ("_key_extent_kernel", "_quant_kernel", "_fwd_kernel", "_bwd_prep_kernel", "_bwd_dkdv_kernel",
             "_bwd_fused_kernel", "_bwd_dq_kernel")
    for name in names:
        monkeypatch.setattr(tri, name, Kernel(name))
    monkeypatch.setattr(torch.cuda, "device_of", Guard)
    q, k, v = (torch.randn(1, 2, 80, 64, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(1, 80, dtype=torch.bool)
    for bwd in ("split", "fused"):
        monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", bwd)
        state = tri._forward_impl(q, k, v, mask, False, None, ref.PVPrecision.FP16)
        tri._backward_impl(torch.randn_like(q), state, mask, False, None, ref.DoVPrecision.FP16)
    assert {name for name, _ in launches} == set(names)
    unguarded = [name for name, guards in launches if not guards or guards[-1] != q.device]
    assert not unguarded, f"launched outside the inputs' device guard: {unguarded}"


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grid_limit", [4, 2], ids=["whole-rows", "kv-head-groups"])
def test_calls_in_pieces_give_the_whole_calls_bits(device, grid_limit, monkeypatch):
    """A call beyond the kernels' launch limits (B * H programs on the grid's y axis, int32 offsets)
    runs in pieces of (batch rows, kv heads) (launch_chunks; SVD's temporal attention, B * H = 92160,
    failed its launch before). With the grid limit lowered so that these inputs are split, by whole
    batch rows (4: one row's 4 query heads) or by kv-head groups (2), the pieces give the whole
    call's result: the inference forward with its LSE, and SageBwd's output and gradients (the
    deterministic split backward). Bit for bit in the interpreter; on a GPU torch's K-mean sum may
    split by the launch's size (its last bits, then a rare INT8 code at a rounding tie)."""
    from sage_diffusers import _sagebwd_autograd as sba

    tri = kernels()
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "split")
    q, k, v, do, mask = inputs(3, 4, 2, 70, 90, 64, torch.bfloat16, device, True)

    def run():
        out, lse = tri.attention_int8_triton(q, k, v, key_mask=mask, return_lse=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        train = sba.apply_sagebwd(*leaves, mask, True, 0.125, ref.DoVPrecision.FP16, sba.Impl.TRITON, False,
                                  ref.ScorePrecision.INT8)
        train.backward(do)
        return out, lse, train.detach(), *(t.grad for t in leaves)

    assert tri.launch_chunks(q, k) is None
    whole = run()
    monkeypatch.setattr(tri, "MAX_GRID_YZ", grid_limit)
    assert len(tri.launch_chunks(q, k)) == (3 if grid_limit == 4 else 6)
    pieces = run()
    for name, got, want in zip(("out", "lse", "train", "dq", "dk", "dv"), pieces, whole):
        if name == "lse":
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        elif device == "cpu":
            assert torch.equal(got, want), name
        else:
            assert cosine(got.float(), want.float()) > 0.99999 and relative_l1(got.float(), want.float()) < 1e-3, name


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_batch_times_heads_beyond_the_grid_limit_runs_in_pieces(device):
    """At the real limit (a GPU only: the interpreter would run 65540 programs one by one): SVD's
    temporal attention (B = 2 x latent pixels, 5 heads of 64; B * H = 92160 at 1024 x 576) put more
    than 65535 programs on the grid's y axis and failed its launch ("invalid argument"). It runs in
    pieces, each what a call of its own gives, in inference and with gradients."""
    if device == "cpu":
        pytest.skip("65540 programs: too slow in the interpreter")
    from sage_diffusers import _sagebwd_autograd as sba

    tri = kernels()
    gen = torch.Generator(device=device).manual_seed(0)
    b, h = 13108, 5  # B * H = 65540
    q, k, v = (torch.randn(b, h, 25, 64, device=device, generator=gen).to(torch.bfloat16) for _ in range(3))
    chunks = tri.launch_chunks(q, k)
    assert chunks is not None and len(chunks) == 2
    out, lse = tri.attention_int8_triton(q, k, v, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    train = sba.apply_sagebwd(*leaves, None, False, 0.125, ref.DoVPrecision.FP16, sba.Impl.TRITON, False,
                              ref.ScorePrecision.INT8)
    train.float().sum().backward()
    for rows, _ in chunks:
        want, want_lse = tri.attention_int8_triton(q[rows], k[rows], v[rows], return_lse=True)
        assert torch.equal(out[rows], want) and torch.equal(lse[rows], want_lse)
        part = sba.apply_sagebwd(q[rows], k[rows], v[rows], None, False, 0.125, ref.DoVPrecision.FP16,
                                 sba.Impl.TRITON, False, ref.ScorePrecision.INT8)
        assert torch.equal(train[rows].detach(), part)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
