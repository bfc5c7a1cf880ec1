"""Semantics of sage_diffusers.attention: where it says "like SDPA", it is SDPA (issue 11 and later).

Each regression test's docstring names the bug it pins; the others say which wrong implementation
they fail on. CPU, small shapes: the low-bit modes run their torch references here (the kernels
follow the same numerics contract, tested on GPUs).
"""
import contextlib
import gc
import importlib
import math
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers import _dispatch, _masks, _shared, api
from sage_diffusers.reference import cosine, sage3_reference, sage8_reference

from _util import assert_unchanged, snapshot
from inputs import (EMPTY_SHAPES, MAGNITUDES, dit_qkv, exact_attention, key_padding_mask, poison_masked,
                    sdpa_masks, with_requires_grad)

LOW_BIT = ("int8", "fp4")
ALL_MODES = ("sdpa",) + LOW_BIT
# Accuracy floors of the references on DiT-like inputs (int8 ~0.9993, fp4 ~0.982 measured).
MIN_COS = {"sdpa": 0.99999, "int8": 0.998, "fp4": 0.97}


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


def _qkv(b=2, hq=2, hkv=2, sq=40, skv=40, d=64, seed=0, **kw):
    return dit_qkv(b, hq, hkv, sq, skv, d, seed=seed, **kw)


def _randn_qkv(b=2, h=2, s=8, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g) for _ in range(3))


# ---- 1. attn_mask means what it means to SDPA; key padding is key_mask -----------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
def test_2d_bool_mask_is_sq_by_skv_like_sdpa(mode):
    """Bug: a 2-D bool attn_mask was read as (B, Skv); with B == Sq the answer was silently wrong
    (cos 0.77 against SDPA), otherwise it raised even in mode "sdpa"."""
    for b in (6, 2):  # B == Sq, and B != Sq
        q, k, v = _qkv(b=b, sq=6, skv=30)
        mask = torch.rand(6, 30, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[:, 0] = True
        out = sd.attention(q, k, v, mask, mode=mode)
        expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert cosine(out, expect) > MIN_COS[mode]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_sdpa_mask_form_matches_sdpa(mode):
    """Bug: only bool key masks had SDPA's meaning; every form torch SDPA accepts must agree with it."""
    b, hq, sq, skv = 2, 2, 24, 40
    q, k, v = _qkv(b=b, hq=hq, sq=sq, skv=skv)
    for form in sdpa_masks(b, hq, sq, skv, seed=3):
        out = sd.attention(q, k, v, form.mask, mode=mode)
        expect, _ = exact_attention(q, k, v, attn_mask=form.mask)
        assert cosine(out, expect) > MIN_COS[mode], form.name


@pytest.mark.parametrize("mode", LOW_BIT)
def test_key_padding_forms_run_natively(mode):
    """Bug: only (B, Skv) and (B, 1, 1, Skv) bool masks ran natively; a 0/-inf float key mask and a
    (B, 1, Sq, Skv) bool mask that is key padding in disguise (Chroma) forced SDPA on every call.
    Bool key-shaped masks run natively anywhere; the others inside a mask_scope (their values are
    read once there)."""
    b, sq, skv = 2, 24, 40
    q, k, v = _qkv(b=b, sq=sq, skv=skv)
    kp = key_padding_mask(b, skv, seed=4)
    native = sd.attention(q, k, v, key_mask=kp, mode=mode)
    additive = torch.zeros(b, 1, 1, skv).masked_fill(~kp[:, None, None, :], -math.inf)
    forms = {
        "bool-B11K": kp[:, None, None, :],
        "bool-1d-batch-1": kp[:1, :][0],  # (Skv,): broadcast over the batch
        "float-B11K": additive,
        "bool-B1QK-disguised": kp[:, None, None, :].expand(b, 1, sq, skv).clone(),
        "float-BHQK-disguised": additive.expand(b, 2, sq, skv).contiguous(),
    }
    for name, mask in forms.items():
        with api.mask_scope():
            out = sd.attention(q, k, v, mask, mode=mode)
        expect = native if mask.dim() > 1 else sd.attention(q, k, v, key_mask=kp[:1].expand(b, skv), mode=mode)
        torch.testing.assert_close(out, expect, rtol=0, atol=0, msg=name)
    # key_mask and attn_mask together: a key is visible when both allow it.
    both = sd.attention(q, k, v, kp[:, None, None, :], key_mask=kp.flip(1), mode=mode)
    torch.testing.assert_close(both, sd.attention(q, k, v, key_mask=kp & kp.flip(1), mode=mode), rtol=0, atol=0)
    assert sd.fallback_stats() == {}


def test_disguised_key_mask_is_checked_once_per_tensor_inside_a_mask_scope(monkeypatch):
    """Bug: a (B, 1, Sq, Skv) key mask forced SDPA on every call. The check that it is key padding
    reads the mask (a host sync): inside sd.mask_scope (what the integrations open per forward) it
    runs once per distinct tensor; outside a scope the mask is never read and runs SDPA, counted."""
    calls = []
    real = _masks._classify_key_padding
    monkeypatch.setattr(_masks, "_classify_key_padding", lambda m: calls.append(1) or real(m))
    b, sq, skv = 2, 16, 32
    q, k, v = _qkv(b=b, sq=sq, skv=skv)
    kp = key_padding_mask(b, skv, seed=5)
    mask = kp[:, None, None, :].expand(b, 1, sq, skv).clone()
    with api.mask_scope():
        for _ in range(4):
            out = sd.attention(q, k, v, mask, mode="int8")
    assert len(calls) == 1 and sd.fallback_stats() == {}
    torch.testing.assert_close(out, sd.attention(q, k, v, key_mask=kp, mode="int8"), rtol=0, atol=0)
    out = sd.attention(q, k, v, mask, mode="int8")  # no scope: SDPA, the mask never read
    assert len(calls) == 1 and any("not a key-padding mask" in r for r in sd.fallback_stats())


@pytest.mark.parametrize("edit", ["index", "data", "numpy"])
def test_mask_edited_in_place_between_scopes_is_classified_again(edit):
    """Bug: the mask cache keyed on the version counter kept a stale answer for a mask edited
    through .data or a NumPy view (cos 0.81 against SDPA in int8). Answers now live only as long as
    one mask_scope, so an edit between two forwards is always seen."""
    b, sq, skv = 2, 16, 32
    q, k, v = _qkv(b=b, sq=sq, skv=skv)
    kp = key_padding_mask(b, skv, seed=5)
    mask = kp[:, None, None, :].expand(b, 1, sq, skv).clone()
    with api.mask_scope():
        sd.attention(q, k, v, mask, mode="int8")
    target = {"index": mask, "data": mask.data, "numpy": torch.from_numpy(mask.numpy())}[edit]
    if edit == "numpy":
        mask.numpy()[0, 0, 3, 5] = not bool(mask[0, 0, 3, 5])
    else:
        target[0, 0, 3, 5] = not bool(target[0, 0, 3, 5])  # no longer key padding
    with api.mask_scope():
        out = sd.attention(q, k, v, mask, mode="int8")
    torch.testing.assert_close(out, sd.attention(q, k, v, mask, mode="sdpa"), rtol=0, atol=0)


def test_masks_made_under_inference_mode_run_natively_in_a_scope():
    """Bug: a (B, 1, Sq, Skv) mask created inside torch.inference_mode() raised "Inference tensors do
    not track version counter" in mode int8 (the mask cache read _version)."""
    b, sq, skv = 2, 16, 32
    q, k, v = _qkv(b=b, sq=sq, skv=skv)
    kp = key_padding_mask(b, skv, seed=5)
    with torch.inference_mode():
        bool_mask = kp[:, None, None, :].expand(b, 1, sq, skv).clone()
        float_mask = torch.zeros(b, 1, sq, skv).masked_fill(~bool_mask, float("-inf"))
        for m in (bool_mask, float_mask):
            sd.reset_fallback_stats()
            with api.mask_scope():
                out = sd.attention(q, k, v, m, mode="int8")
            assert sd.fallback_stats() == {}
            torch.testing.assert_close(out, sd.attention(q, k, v, key_mask=kp, mode="int8"), rtol=0, atol=0)
            sd.attention(q, k, v, m, mode="int8")  # outside a scope: SDPA, no crash


def test_mask_scopes_are_per_thread():
    """Bug: with 12 threads and more than 16 live masks the shared OrderedDict raised KeyError, and
    every later call with such a mask raised too. Scopes are context-local: threads never share one."""
    import concurrent.futures

    b, sq, skv = 1, 8, 16
    q, k, v = _qkv(b=b, sq=sq, skv=skv)

    def work(i):
        kp = key_padding_mask(b, skv, seed=i)
        masks = [kp[:, None, None, :].expand(b, 1, sq, skv).clone() for _ in range(20)]
        with api.mask_scope():
            outs = [sd.attention(q, k, v, m, mode="int8") for m in masks]
        ref = sd.attention(q, k, v, key_mask=kp, mode="int8")
        return all(torch.equal(o, ref) for o in outs)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert all(pool.map(work, range(24)))


@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_bool_mask_broadcast_over_keys_runs(mode):
    """Bug: a bool attn_mask (B, 1, 1, 1) (valid SDPA: broadcast over heads, queries and keys) raised
    a RuntimeError in _native_key_mask, which reshaped it to (B, Skv) instead of (B, 1)."""
    q, k, v = _randn_qkv()
    mask = torch.tensor([True, False]).reshape(2, 1, 1, 1)  # batch 0 sees every key, batch 1 none
    out = sd.attention(q, k, v, attn_mask=mask, mode=mode)
    want = sd.attention(q, k, v, key_mask=mask.reshape(2, 1).expand(2, 8), mode=mode)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert out[1].abs().max() == 0  # no visible key: zeros


def test_a_bool_key_padding_attn_mask_is_never_read_on_the_host(monkeypatch):
    """A bool (B, 1, 1, Skv) attn_mask is key padding by its shape: used as a view, its values
    never read (no host sync). Fails on: the shape test looking at the wrong dim or size."""
    reads = []
    real = _masks._classify_key_padding
    monkeypatch.setattr(_masks, "_classify_key_padding", lambda m: reads.append(1) or real(m))
    q, k, v = dit_qkv(2, 2, 2, 24, 24, 64, seed=11)
    kp = key_padding_mask(2, 24, seed=12)
    out = sd.attention(q, k, v, kp[:, None, None, :], mode="int8")
    assert reads == [] and torch.equal(out, sd.attention(q, k, v, key_mask=kp, mode="int8"))


def test_mask_scope_does_not_keep_the_callers_mask_alive():
    """Bug: _classify_key_padding returned a view of a bool mask, so the mask memo held every
    classified (B, 1, Sq, Skv) mask alive after the caller dropped it. A scope holds its masks only
    until it ends."""
    q, k, v = _randn_qkv(b=1)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., -2:] = False
    alive = weakref.ref(mask)
    before = sd.fallback_stats()
    with api.mask_scope():
        sd.attention(q, k, v, attn_mask=mask, mode="int8")
    assert sd.fallback_stats() == before  # classified as key padding (native path)
    del mask
    gc.collect()
    assert alive() is None


def _mask(b: int, skv: int, seed: int) -> torch.Tensor:
    """A (B, 1, Sq, Skv) bool mask whose query rows are all equal: key padding in disguise."""
    return key_padding_mask(b, skv, seed=seed)[:, None, None, :].expand(b, 1, 3, skv).contiguous()


def test_mask_scope_classifies_once_per_tensor_and_forgets_at_exit():
    """Inside a mask_scope a mask is classified once per tensor (a view of it included), a nested
    scope uses the outer scope's answers, and no answer outlives its scope (outside one nothing is
    read). Fails on: the memo keyed without the owner (a view's geometry alone), kept past the
    scope, or shared by nested scopes incorrectly."""
    calls = []

    def compute(m):
        calls.append(m)
        return m[:, 0, 0, :].clone()

    a, b = _mask(2, 20, 1), _mask(2, 20, 2)
    with api.mask_scope():
        for m in (a, b, a, a[:, :, :, :]):
            assert torch.equal(_masks.classify_in_scope(m, compute), m[:, 0, 0, :])
        with api.mask_scope():  # nested: the outer scope's answers
            _masks.classify_in_scope(b, compute)
        assert len(calls) == 2
    assert _masks.classify_in_scope(a, compute) is None  # no scope: nothing read
    with api.mask_scope():
        _masks.classify_in_scope(a, compute)
    assert len(calls) == 3


def test_mask_scope_reads_nothing_while_compiling_or_on_meta(monkeypatch):
    """Under torch.compile, and for meta / fake tensors, nothing is read (the mask counts as
    general and runs SDPA). Regression: meta/FakeTensor inputs with a general mask failed in
    int8 / fp4 (``.item()`` on meta)."""
    with api.mask_scope():
        assert _masks.classify_in_scope(torch.ones(1, 1, 2, 2, device="meta"), lambda m: pytest.fail("read")) is None
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert _masks.classify_in_scope(_mask(2, 20, 1), lambda m: pytest.fail("the mask was read")) is None


@pytest.mark.parametrize("bad, match", [
    (lambda b, s: torch.ones(b, s), "bool"),
    (lambda b, s: torch.ones(b, s + 1, dtype=torch.bool), "shape"),
    (lambda b, s: torch.ones(b, 1, 1, s, dtype=torch.bool), "shape"),  # 4-D belongs in attn_mask
])
def test_key_mask_is_validated(bad, match):
    """key_mask is exactly bool (B, Skv); anything else is a ValueError naming the expected shape."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"key_mask.*{match}"):
        sd.attention(q, k, v, key_mask=bad(2, 40), mode="int8")


def test_general_masks_fall_back_and_are_counted():
    """A mask that is not key padding runs SDPA (exact) and says so, counted on every call."""
    q, k, v = _qkv(sq=24, skv=40)
    mask = torch.rand(24, 40, generator=torch.Generator().manual_seed(6)) > 0.5
    mask[:, 0] = True
    for _ in range(2):
        out = sd.attention(q, k, v, mask, mode="int8")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    (reason, count), = sd.fallback_stats().items()
    assert "not a key-padding mask" in reason and count == 2


@pytest.mark.parametrize("mode", LOW_BIT)
def test_dropout_runs_sdpa_counted(mode):
    """Bug: dropout_p did not exist; SDPA's fourth positional argument must mean dropout."""
    q, k, v = _qkv()
    torch.manual_seed(0)
    out = sd.attention(q, k, v, None, 0.5, mode=mode)
    torch.manual_seed(0)
    expect = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(out, expect)
    assert sd.fallback_stats() == {f"{mode}: dropout": 1}
    with pytest.raises(ValueError, match="dropout_p"):
        sd.attention(q, k, v, dropout_p=1.5, mode=mode)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_a_mask_is_sdpas_dropout(causal):
    """dropout_p with a key mask (and causal): the same draws as torch SDPA with the same seed.

    Fails on: the masked SDPA call (non-causal) and the chunked causal call without ``dropout_p``."""
    q, k, v = dit_qkv(2, 2, 2, 40, 40, 64, seed=5)
    kp = key_padding_mask(2, 40, seed=6)
    mask = kp[:, None, None, :]
    if causal:
        mask = mask & torch.ones(40, 40, dtype=torch.bool).tril()
    torch.manual_seed(0)
    out = sd.attention(q, k, v, dropout_p=0.5, is_causal=causal, key_mask=kp, mode="sdpa")
    torch.manual_seed(0)
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    torch.testing.assert_close(out, expect)
    torch.manual_seed(0)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("mode", ["sdpa", "int8"])
def test_dropout_of_one_is_accepted_like_sdpa(mode):
    """dropout_p = 1.0 is valid SDPA (every weight dropped: zeros). Fails on: a range check ``value < 1.0``."""
    q, k, v = dit_qkv(1, 2, 2, 16, 16, 64, seed=15)
    assert (sd.attention(q, k, v, dropout_p=1.0, mode=mode) == 0).all()


# ---- 2. masked keys cannot leak ---------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("poison", [100.0, 1e4, math.nan, -math.inf])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_masked_key_values_never_reach_the_output(mode, poison, causal):
    """Bug: padded keys fed the K mean and the K/V scales (padding of 1e4 gave cos 0.10, NaN in the
    padding poisoned every row), and SDPA's math path propagated NaN from masked V (0 * NaN)."""
    b, skv = 2, 150  # two key tiles
    q, k, v = _qkv(b=b, sq=33, skv=skv)
    kp = key_padding_mask(b, skv, seed=7)
    clean = sd.attention(q, k, v, key_mask=kp, is_causal=causal, mode=mode)
    kx, vx = poison_masked(k, v, kp, poison)
    before = snapshot(kx, vx)
    dirty = sd.attention(q, kx, vx, key_mask=kp, is_causal=causal, mode=mode)
    for b_, a_ in zip(before, (kx, vx)):
        torch.testing.assert_close(a_, b_, rtol=0, atol=0, equal_nan=True)  # untouched, NaN included
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=1e-6 if mode == "sdpa" else 0)
    # the same through an SDPA-style mask, where only the masked-for-every-query keys are dropped
    dirty4 = sd.attention(q, kx, vx, kp[:, None, None, :], is_causal=causal, mode=mode)
    torch.testing.assert_close(dirty4, clean, rtol=0, atol=1e-6 if mode == "sdpa" else 0)


@pytest.mark.parametrize("layout", ["causal", "rows_mask", "causal_rows_mask"])
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_keys_hidden_from_some_rows_never_reach_those_rows(mode, poison, layout):
    """Bug: a key hidden from only some query rows by an attn_mask kept its NaN/Inf, and SDPA computed
    NaN + (-inf) and 0 * NaN into the rows that cannot see it: every mode leaked (the low-bit ones run
    SDPA for per-row masks). The rows that see the key are NaN. Causality alone: the low-bit paths
    never leak; mode "sdpa" keeps torch SDPA's behaviour there (documented), so it is not asserted."""
    if layout == "causal" and mode == "sdpa":
        pytest.skip("keys hidden by causality alone follow torch SDPA in mode sdpa")
    b, hq, hkv, s = 2, 4, 2, 40  # GQA: query heads 0, 1 read KV head 0
    q, k, v = _qkv(b=b, hq=hq, hkv=hkv, sq=s, skv=s)
    j = 25
    hidden = torch.zeros(s, s, dtype=torch.bool)
    hidden[:10, j] = True  # key j hidden from rows 0..9 (besides causality)
    causal = layout != "rows_mask"
    mask = None if layout == "causal" else ~hidden
    sees = ~hidden[:, j] & (torch.arange(s) >= j if causal else True)  # (Sq,): rows that see key j
    kx, vx = k.clone(), v.clone()
    kx[0, 0, j, 3] = poison  # batch 0, KV head 0: its query heads 0, 1
    vx[1, 1, j, 5] = poison  # batch 1, KV head 1: its query heads 2, 3
    before = snapshot(kx, vx)
    out = sd.attention(q, kx, vx, mask, is_causal=causal, mode=mode)
    for b_, a_ in zip(before, (kx, vx)):
        torch.testing.assert_close(a_, b_, rtol=0, atol=0, equal_nan=True)  # untouched, NaN included
    clean = sd.attention(q, k.where(torch.isfinite(kx), 0), v.where(torch.isfinite(vx), 0), mask,
                         is_causal=causal, mode=mode)
    for part, rest in ((out[0, :2], clean[0, :2]), (out[1, 2:], clean[1, 2:])):  # the poisoned heads
        assert torch.isfinite(part[:, ~sees]).all()
        if mask is not None:  # SDPA for every mode: exact, and the rows that see key j NaN
            torch.testing.assert_close(part[:, ~sees], rest[:, ~sees], rtol=0, atol=1e-6)
            assert part[:, sees].isnan().all()
        else:  # natively: key j's finite entries enter K's mean and scales, as any key's do
            assert cosine(part[:, ~sees], rest[:, ~sees]) > MIN_COS[mode]
    torch.testing.assert_close(out[0, 2:], clean[0, 2:], rtol=0, atol=0)  # untouched heads: bit for bit
    torch.testing.assert_close(out[1, :2], clean[1, :2], rtol=0, atol=0)


@pytest.mark.parametrize("ref", [sage8_reference, sage3_reference])
def test_references_ignore_masked_rows_bit_for_bit(ref):
    """Bug: the references took the K mean and the K/V scales over padded keys too."""
    q, k, v = _qkv(b=2, sq=20, skv=140)
    kp = key_padding_mask(2, 140, seed=8)
    clean = ref(q, k, v, key_mask=kp, return_lse=True)
    for poison in (1e4, math.nan):
        dirty = ref(q, *poison_masked(k, v, kp, poison), key_mask=kp, return_lse=True)
        for a, c in zip(dirty, clean):
            assert torch.equal(a, c)


# ---- 3. FP4 at any magnitude ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_keeps_its_accuracy_at_any_magnitude(fmt):
    """Bug: FP4 had no per-tensor scale: V around 1e-3 came out exactly 0, V around 1e4 was clipped
    (cos 0.84). V x1e-4..x1e4 and Q, K x1e-3..x1 must keep the accuracy of the N(0, 1) case."""
    q, k, v = _qkv(b=1, sq=128, skv=256, q_bias=0.0, k_bias=0.0, v_bias=0.0)
    base = cosine(sage3_reference(q, k, v, fmt=fmt), exact_attention(q, k, v)[0])
    for mag in MAGNITUDES:
        got = cosine(sage3_reference(q, k, v * mag, fmt=fmt), exact_attention(q, k, v * mag)[0])
        assert got > base - 1e-4, (mag, got, base)
    for mag in (1e-3, 1e-2, 1e-1, 1.0):
        qs, ks = q * mag, k * mag
        got = cosine(sage3_reference(qs, ks, v, fmt=fmt), exact_attention(qs, ks, v)[0])
        assert got > base - 0.002, (mag, got, base)


def test_fp4_sharpness_curve_is_reported(capsys):
    """Sharper attention (Q, K x2 and up) costs FP4 accuracy by nature, not by a range bug: report
    the curve next to int8's (measured at this shape: fp4 0.95 at x2, 0.80 at x10; int8 >= 0.995)."""
    q, k, v = _qkv(b=1, sq=128, skv=256, q_bias=0.0, k_bias=0.0, v_bias=0.0)
    rows = []
    for mag in (1, 2, 4, 6, 8, 10):
        ref = exact_attention(q * mag, k * mag, v)[0]
        rows.append((mag, cosine(sage3_reference(q * mag, k * mag, v), ref),
                     cosine(sage8_reference(q * mag, k * mag, v), ref)))
    with capsys.disabled():
        print("\nFP4 sharpness curve (Q, K scaled; cos vs float64): "
              + ", ".join(f"x{m}: fp4 {a:.4f} int8 {b:.4f}" for m, a, b in rows))
    assert all(a > 0.5 and b > 0.99 for _, a, b in rows)


# ---- 4. non-finite values stay where they are -------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_nonfinite_query_row_affects_only_that_row(mode, bad):
    """Bug: in fp4 a NaN in one query row spread to its whole 128-row block (the block mean), and
    the per-head scales would spread it to the head. The bad row itself is NaN, as in exact attention
    (mode "sdpa": whatever torch SDPA gives there)."""
    q, k, v = _qkv(b=1, sq=200, skv=64)
    qx = q.clone()
    qx[0, 1, 70, 5] = bad
    out = sd.attention(qx, k, v, mode=mode)
    clean = sd.attention(q, k, v, mode=mode)
    broken = ~torch.isfinite(out).all(-1)  # (B, H, Sq)
    if mode != "sdpa":
        assert torch.isnan(out[0, 1, 70]).all()
    broken[0, 1, 70] = False
    assert not broken.any()
    assert torch.equal(out[:, 0], clean[:, 0])  # another head: bit for bit
    others = torch.ones(200, dtype=torch.bool)
    others[70] = False
    exact = exact_attention(q, k, v)[0]
    assert cosine(out[:, 1, others], exact[:, 1, others]) > MIN_COS[mode]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_infinite_values_in_v_propagate_like_sdpa(mode, causal):
    """Bug: fp4 turned +-Inf in V into finite numbers. An Inf in V reaches the rows that see its key,
    in its channel, with exact attention's value (+Inf, -Inf, or NaN where both signs meet); rows
    that do not see the key stay finite (torch's causal SDPA gives some of them NaN, 0 * Inf: only
    the untouched channels are checked for mode "sdpa" with is_causal)."""
    sq = 40
    q, k, v = _qkv(b=1, sq=sq, skv=50)
    vx = v.clone()
    vx[0, 0, 10, 3] = math.inf
    vx[0, 1, 20, 4] = -math.inf
    vx[0, 1, 30, 4] = math.inf
    out = sd.attention(q, k, vx, is_causal=causal, mode=mode)
    rows = torch.arange(sq)
    sees = (lambda j: rows >= j) if causal else (lambda j: torch.ones(sq, dtype=torch.bool))
    expect = torch.zeros_like(out)  # 0 = finite
    expect[0, 0, :, 3] = torch.where(sees(10), math.inf, 0.0)
    expect[0, 1, :, 4] = torch.where(sees(30), math.nan, torch.where(sees(20), -math.inf, 0.0))
    assert torch.isfinite(out[:, :, :, :3]).all() and torch.isfinite(out[:, :, :, 5:]).all()
    if mode == "sdpa" and causal:
        return  # torch's causal kernel multiplies the hidden keys' 0 weights by Inf within a tile
    assert torch.equal(torch.isposinf(out), torch.isposinf(expect))
    assert torch.equal(torch.isneginf(out), torch.isneginf(expect))
    assert torch.equal(torch.isnan(out), torch.isnan(expect))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", LOW_BIT)
def test_nonfinite_entry_of_an_attended_key_leaves_the_other_keys_alone(mode, causal, bad):
    """Bug: a NaN / Inf entry of an attended key entered K's token mean, so its channel's mean, and
    every key's smoothed value there, became NaN and quantized to 0: every row lost that channel
    (cos 0.74 against exact attention, causal rows that never see the key included). The entry now
    counts as 0 in the mean (docs/algorithms.md). A NaN entry is quantized as 0: the output is exact
    attention with that entry at the mean of the others, within the quantization error. An Inf
    saturates at the largest code, which changes that key's scores only: the rows that do not see
    it (causal) are checked."""
    q, k, v = _qkv(b=1, sq=150, skv=150)
    j = 90
    kx = k.clone()
    kx[0, 1, j, :] = bad  # the whole key row: every channel's mean was hit
    out = sd.attention(q, kx, v, is_causal=causal, mode=mode)
    assert torch.isfinite(out).all()
    mean = torch.where(torch.isfinite(kx[0, 1]), kx[0, 1], 0).float().sum(0) / kx.shape[2]  # (D,)
    ke = k.clone()
    ke[0, 1, j, :] = mean.to(k.dtype)  # smoothed: exactly 0, as the low-bit paths quantize the entries
    exact = exact_attention(q, ke, v, is_causal=causal)[0]
    rows = slice(None) if math.isnan(bad) else slice(0, j if causal else 0)
    assert cosine(out[:, :, rows], exact[:, :, rows]) > MIN_COS[mode]


# ---- 5. gradients are never silently wrong ----------------------------------------------------------


@pytest.mark.parametrize("mode", LOW_BIT)
def test_gradients_are_never_silently_wrong(mode):
    """Bug: with requires_grad inputs the int8/fp4 references returned gradients with cos 0.02-0.2
    against SDPA, silently. Now "fp4" runs SDPA (counted "backward") and "int8" trains through
    SageBwd (INT8 forward and backward, its own accuracy, no fallback)."""
    t = with_requires_grad(_qkv(hq=4, hkv=2, sq=30, skv=45))
    kp = key_padding_mask(2, 45, seed=9)
    out = sd.attention(*t, key_mask=kp, mode=mode)
    out.square().sum().backward()
    r = with_requires_grad(t)
    expect, _ = exact_attention(*r, key_mask=kp)
    expect.float().square().sum().backward()
    for a, e in zip(t, r):
        assert cosine(a.grad, e.grad) > (0.99999 if mode == "fp4" else 0.995)
    counted = {"fp4: backward": 1} if mode == "fp4" else {}
    assert sd.fallback_stats() == counted
    with torch.no_grad():
        sd.attention(*t, key_mask=kp, mode=mode)  # no gradients needed: the inference path
    assert sd.fallback_stats() == counted


def test_needs_grad_is_the_one_decision():
    q, k, v = _qkv()
    assert not _dispatch.needs_grad(q, k, v)
    qg = q.clone().requires_grad_()
    assert _dispatch.needs_grad(qg, k, v) and _dispatch.needs_grad(None, k, qg)
    with torch.no_grad():
        assert not _dispatch.needs_grad(qg, k, v)
    with torch.inference_mode():
        assert not _dispatch.needs_grad(q, k, v)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_any_one_input_requiring_grad_chooses_the_gradient_path(monkeypatch, mode, which):
    """Whichever one of q, k, v requires grad: "int8" trains through SageBwd, "fp4" runs SDPA
    counted "backward" (never the inference reference, whose gradients are silently wrong).

    Fails on: ``_dispatch.plan`` asking ``needs_grad`` about only two of q, k, v (either check)."""
    sagebwd = importlib.import_module("sage_diffusers._sagebwd_autograd")  # where the API takes its gradient path
    calls = []
    real = sagebwd.attention_sagebwd
    monkeypatch.setattr(sagebwd, "attention_sagebwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t = list(dit_qkv(1, 2, 2, 24, 24, 64, seed=7))
    t[which] = t[which].requires_grad_()
    sd.attention(*t, mode=mode).sum().backward()
    assert t[which].grad is not None
    assert (len(calls), sd.fallback_stats()) == ((1, {}) if mode == "int8" else (0, {"fp4: backward": 1}))


def test_sagebwd_path_gets_causal_and_returns_the_lse():
    """mode "int8" with gradients: causal and return_lse reach SageBwd (output and LSE of causal
    attention). Fails on: SageBwd called without ``is_causal`` or ``return_lse``."""
    q, k, v = dit_qkv(1, 2, 2, 40, 40, 64, seed=10, dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    out, lse = sd.attention(qg, k, v, is_causal=True, mode="int8", return_lse=True)
    expect, expect_lse = exact_attention(q, k, v, is_causal=True)
    assert torch.nn.functional.cosine_similarity(out.detach().double().flatten(), expect.flatten(), 0) > 0.995
    assert lse is not None and (lse.double() - expect_lse).abs().max() < 1e-4


# ---- 6. edge cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("mode", ALL_MODES)
def test_empty_inputs_give_the_right_shapes(mode, shape, layout):
    """Bug: Sq = 0 / Skv = 0 crashed with IndexError."""
    b, hq, hkv, sq, skv = shape
    q, k, v = torch.randn(b, hq, sq, 64), torch.randn(b, hkv, skv, 64), torch.randn(b, hkv, skv, 64)
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kp = torch.ones(b, skv, dtype=torch.bool)
    out, lse = sd.attention(q, k, v, key_mask=kp, mode=mode, layout=layout, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    assert (out == 0).all() and torch.isneginf(lse).all()
    qg = q.detach().clone().requires_grad_()
    sd.attention(qg, k, v, mode=mode, layout=layout).sum().backward()  # backward runs, zero gradient
    assert qg.grad.shape == q.shape and (qg.grad == 0).all()


@pytest.mark.parametrize("mode", ["sdpa", "int8", "fp4"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_empty_input_keeps_every_input_in_the_graph(mode, which):
    """Sq = 0: whichever of q, k, v requires grad gets a zero gradient of its shape, as with SDPA.

    Fails on: ``_dispatch.empty_result`` asking ``needs_grad`` about q and only one of k, v."""
    t = [torch.randn(2, 2, 0, 64), torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64)]
    t[which] = t[which].requires_grad_()
    out = sd.attention(*t, mode=mode)
    assert out.requires_grad
    out.sum().backward()
    assert t[which].grad.shape == t[which].shape and (t[which].grad == 0).all()


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.125, -1.0])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_zero_and_negative_scale_are_computed_like_sdpa(mode, scale):
    """Bug: a zero or negative softmax scale was not handled the same way on every path. The sign is
    folded into q: scale -s on q is exactly scale s on -q."""
    q, k, v = _qkv(sq=33, skv=45)
    kp = key_padding_mask(2, 45, seed=10)
    out, lse = sd.attention(q, k, v, key_mask=kp, scale=scale, mode=mode, return_lse=True)
    if scale < 0 and mode != "sdpa":
        folded = sd.attention(-q, k, v, key_mask=kp, scale=-scale, mode=mode, return_lse=True)
        assert torch.equal(out, folded[0]) and torch.equal(lse, folded[1])
    if scale >= -0.125:  # sharper attention has its own (larger) low-bit error
        expect, expect_lse = exact_attention(q, k, v, key_mask=kp, scale=scale)
        assert cosine(out, expect) > MIN_COS[mode]
        assert (lse.double() - expect_lse).abs().max() < {"sdpa": 1e-4, "int8": 0.05, "fp4": 0.3}[mode]


@pytest.mark.parametrize("scale", [True, False, torch.tensor(0.1), "x", math.nan])
def test_bad_scales_are_refused(scale):
    """Bug: scale=True passed as 1.0."""
    with pytest.raises(ValueError, match="scale"):
        sd.attention(*_qkv(), scale=scale, mode="int8")


@pytest.mark.parametrize("ref", [sage8_reference, sage3_reference])
def test_float32_inputs_follow_the_bfloat16_rule(ref):
    """float32 into a low-bit mode: rounded to bfloat16 first (the kernels' rule, the references' too),
    output float32."""
    q, k, v = _qkv(sq=20, skv=30)
    mode = "int8" if ref is sage8_reference else "fp4"
    out = sd.attention(q, k, v, mode=mode)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref(*(t.bfloat16() for t in (q, k, v))), rtol=0, atol=0)


# ---- 7. SDPA path efficiency ------------------------------------------------------------------------


@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 1)])
def test_sdpa_path_chunks_agree_with_one_shot(monkeypatch, hq, hkv):
    """Bug: is_causal built an Sq x Skv mask and the LSE repeated K per query head. The chunked
    causal + mask path and the grouped LSE must give SDPA's numbers, for any chunk size."""
    q, k, v = _qkv(hq=hq, hkv=hkv, sq=50, skv=37)
    kp = key_padding_mask(2, 37, seed=11)
    for form in (None, kp[:, None, None, :].float().log()):  # no mask, and an additive key mask
        expect, expect_lse = exact_attention(q, k, v, key_mask=kp, is_causal=True, attn_mask=form)
        for chunk in (1 << 24, 37 * 2 * hq * 3):  # one chunk; chunks of 3 query rows
            monkeypatch.setattr(_shared, "CHUNK_ELEMENTS", chunk)
            out, lse = sd.attention(q, k, v, form, is_causal=True, key_mask=kp, mode="sdpa", return_lse=True)
            torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse.double(), expect_lse, rtol=1e-5, atol=1e-5)


def _row_bias(b: int, sq: int, skv: int, *, seed: int, dead_key: int, dead_row: int) -> torch.Tensor:
    """Additive float mask (B, 1, Sq, Skv) that differs per query row (so it is no key padding):
    random biases, scattered -inf, key ``dead_key`` hidden from every row, query row ``dead_row``
    of batch 0 sees no key."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(b, 1, sq, skv, generator=g)
    bias = bias.masked_fill(torch.rand(b, 1, sq, skv, generator=g) < 0.2, -math.inf)
    bias[..., 0] = 0.0  # every other row keeps key 0
    bias[..., dead_key] = -math.inf
    bias[0, 0, dead_row] = -math.inf
    return bias


# The (Hq, Hkv, Sq, Skv) cases: grouped heads with as many keys as query heads (a head count read
# from the wrong dim goes unnoticed when the two differ), and more heads x batch than keys.
_SHAPES = [(4, 2, 9, 4), (4, 2, 50, 37)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", _SHAPES)
def test_sdpa_path_general_mask_scale_gqa_and_lse(monkeypatch, shape, causal):
    """The SDPA path with a per-row additive mask, a non-default scale, grouped heads and the LSE,
    in one chunk and in chunks of 3 query rows, against float64 attention.

    Fails on: the chunk's mask rows taken from row 0 (``attn_mask[..., :kend]`` for a per-row mask),
    the LSE ignoring ``attn_mask``, the causal chunks' SDPA call without ``scale`` or ``enable_gqa``,
    the GQA flag computed from the key length, ``_visible`` with ``>=`` (keys hidden by -inf from
    every row then keep their NaN), and a chunk step computed with ``/`` (a float step)."""
    hq, hkv, sq, skv = shape
    q, k, v = dit_qkv(2, hq, hkv, sq, skv, 64, seed=3)
    bias = _row_bias(2, sq, skv, seed=4, dead_key=skv - 1, dead_row=sq // 2)
    expect, expect_lse = exact_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=0.3)
    k, v = k.clone(), v.clone()
    k[:, :, skv - 1] = math.nan  # hidden from every row by the mask: must not reach any output
    v[:, :, skv - 1] = math.nan
    for chunk in (1 << 24, skv * 2 * hq * 3):
        monkeypatch.setattr(_shared, "CHUNK_ELEMENTS", chunk)
        out, lse = sd.attention(q, k, v, bias, is_causal=causal, scale=0.3, mode="sdpa", return_lse=True)
        torch.testing.assert_close(out.double(), expect, rtol=1e-4, atol=1e-4)  # float32 of sharp rows
        torch.testing.assert_close(lse.double(), expect_lse, rtol=1e-5, atol=1e-5)
        assert (out[0, :, sq // 2] == 0).all() and torch.isneginf(lse[0, :, sq // 2]).all()


_PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn.functional as F
    import sage_diffusers as sd
    torch.set_num_threads(2)
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))
    fn = {"torch": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
          "ours": lambda q, k, v: sd.attention(q, k, v, is_causal=True, mode="sdpa")}[sys.argv[1]]
    fn(*(torch.randn(1, 2, 256, 128) for _ in range(3)))  # warm-up: thread pools, first allocations
    q, k, v = (torch.randn(1, 2, 16384, 128) for _ in range(3))
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS to the current RSS
    base = status("VmRSS")
    out = fn(q, k, v)
    print(status("VmHWM") - base)
""")


def test_causal_sdpa_memory_report(capsys):
    """Bug: mode="sdpa", is_causal=True materialized an Sq x Skv mask (45x torch SDPA's extra memory
    at 1x2x16384x128). Reported, not asserted as a timing: the extra peak (RSS, each in a fresh
    process) must stay within 2x torch SDPA's own."""
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to measure peak RSS")
    peaks = {}
    for who in ("torch", "ours"):
        run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, who], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        peaks[who] = int(run.stdout.split()[-1])
    with capsys.disabled():
        print(f"\ncausal 1x2x16384x128 float32, extra peak RSS: torch SDPA {peaks['torch'] / 1024:.1f} MiB, "
              f"sage_diffusers sdpa {peaks['ours'] / 1024:.1f} MiB")
    assert peaks["ours"] <= 2 * max(peaks["torch"], 16 * 1024)  # 16 MiB = the output itself


# ---- 8. torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["sdpa", "int8", "fp4", "fallback-head-dim", "fallback-mask", "backward-fp4",
                                  "train-int8"])
def test_torch_compile_fullgraph_on_every_path(case):
    """Bug: torch.compile(fullgraph=True) failed on any call that fell back (the counter's lock)."""
    torch._dynamo.reset()
    d = 96 if case == "fallback-head-dim" else 64
    q, k, v = _qkv(b=1, sq=16, skv=24, d=d)
    mode = {"sdpa": "sdpa", "fp4": "fp4", "backward-fp4": "fp4"}.get(case, "int8")
    mask = None
    if case == "fallback-mask":
        mask = torch.rand(16, 24, generator=torch.Generator().manual_seed(12)) > 0.3
        mask[:, 0] = True
    if case in ("backward-fp4", "train-int8"):
        q = q.clone().requires_grad_()

    def fn(q, k, v):
        return sd.attention(q, k, v, mask, is_causal=True, mode=mode)

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    expect = fn(q, k, v)
    sd.reset_fallback_stats()
    for _ in range(2):
        out = compiled(q, k, v)
    torch.testing.assert_close(out, expect)
    if case.startswith("fallback") or case == "backward-fp4":
        (count,) = sd.fallback_stats().values()
        assert count >= 1  # counted: under compile when traced (see _fallback.record), eagerly every call
    else:
        assert sd.fallback_stats() == {}
    if q.requires_grad:
        out.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


# ---- 9. inputs never modified -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
def test_no_input_is_modified(mode):
    """Bug (upstream SageAttention): k -= k.mean() on the caller's tensor; masks, too, stay as given."""
    q, k, v = _qkv(sq=30, skv=40)
    kp = key_padding_mask(2, 40, seed=13)
    mask = kp[:, None, None, :].expand(2, 1, 30, 40).clone()
    before = snapshot(q, k, v, kp, mask)
    sd.attention(q, k, v, mask, key_mask=kp, is_causal=True, scale=-0.1, mode=mode, return_lse=True)
    assert_unchanged(before, (q, k, v, kp, mask))


# ---- the same contract on a GPU (kernels where the device has them) --------------------------------

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@GPU
@pytest.mark.parametrize("mode", ["auto", "int8", "fp4", "sdpa"])
def test_gpu_paths_keep_the_contract(mode):
    """Masked poison, a NaN query row, Inf in V, empty inputs and gradient routing on the GPU paths,
    where the kernels (custom ops without autograd) must never see a gradient-carrying call."""
    dev, dt = "cuda", torch.bfloat16
    b, sq, skv = 2, 300, 333
    q, k, v = dit_qkv(b, 4, 2, sq, skv, 128, seed=20, dtype=dt, device=dev)
    kp = key_padding_mask(b, skv, seed=21, device=dev)
    clean = sd.attention(q, k, v, key_mask=kp, mode=mode)
    exact = exact_attention(q, k, v, key_mask=kp)[0]
    assert cosine(clean, exact) > (0.95 if mode in ("auto", "fp4") else 0.99)
    for poison in (1e4, math.nan, math.inf):
        dirty = sd.attention(q, *poison_masked(k, v, kp, poison), key_mask=kp, mode=mode)
        assert torch.isfinite(dirty).all() and cosine(dirty, clean) > 0.9999, poison
    qx = q.clone()
    qx[0, 1, 70, 5] = math.nan
    broken = ~torch.isfinite(sd.attention(qx, k, v, key_mask=kp, mode=mode)).all(-1)
    assert not broken[0, 1, :70].any() and not broken[0, 1, 71:].any() and not broken[:, 0].any()
    vx = v.clone()
    vx[0, 0, 10, 3] = math.inf
    out = sd.attention(q, k, vx, mode=mode)
    assert torch.isposinf(out[0, :2, :, 3]).all() and torch.isfinite(out[0, :2, :, 4:]).all()
    empty = sd.attention(q[:, :, :0], k, v, mode=mode, return_lse=True)
    assert empty[0].shape == (b, 4, 0, 128) and empty[1].shape == (b, 4, 0)
    sd.reset_fallback_stats()
    qg = q.detach().clone().requires_grad_()
    sd.attention(qg, k, v, key_mask=kp, mode=mode).float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    if mode in ("auto", "fp4"):  # "int8" trains through SageBwd instead
        assert any("backward" in r for r in sd.fallback_stats())


@pytest.mark.parametrize("mode", ("int8", "fp4"))
def test_meta_and_fake_inputs_with_a_general_mask_do_not_read_it(mode):
    """Bug: meta / FakeTensor inputs with a general mask failed in int8 / fp4 (``.item()`` on meta while
    classifying the mask). Nothing is read there: the mask counts as general (SDPA), shapes come out right."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(1, 2, 16, 64, device="meta")
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device="meta")
    with api.mask_scope():
        assert sd.attention(q, q, q, mask, mode=mode).shape == (1, 2, 16, 64)
        with FakeTensorMode() as fake:
            fq = fake.from_tensor(torch.randn(1, 2, 16, 64))
            fm = fake.from_tensor(torch.ones(1, 1, 16, 16, dtype=torch.bool))
            assert sd.attention(fq, fq, fq, fm, mode=mode).shape == (1, 2, 16, 64)


@pytest.mark.parametrize("bad", ["False", 0, 1, None, torch.tensor(True)])
def test_flags_are_checked_as_sdpa_checks_them(bad):
    """Bug: is_causal="False" was taken as causal (a non-empty str is truthy). Bool flags are bools."""
    q, k, v = _qkv()
    for flag in ("is_causal", "return_lse", "enable_gqa"):
        with pytest.raises(ValueError, match=f"{flag}: expected a bool"):
            sd.attention(q, k, v, mode="sdpa", **{flag: bad})


def test_float32_mask_keeps_its_dtype_in_sdpa_mode():
    """Bug: a float32 additive mask with bf16 q was cast to bf16 in mode "sdpa" (cos 0.99944 against exact, where
    torch SDPA keeps 0.999998): the mask now reaches SDPA as given."""
    q, k, v = (t.bfloat16() for t in _qkv(sq=64, skv=64))
    bias = 3 * torch.randn(2, 2, 64, 64)
    out = sd.attention(q, k, v, bias, mode="sdpa")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                               rtol=0, atol=0)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_autocast_casts_the_inputs_like_sdpa(mode):
    """Bug: inside torch.autocast, q, k, v of mixed dtypes (a rotary embedding left in float32) raised
    "q, k, v must share a dtype" where torch SDPA casts them to the autocast dtype, and float32 inputs
    gave a float32 output where SDPA's is bfloat16. Now cast as SDPA does, float mask included."""
    q, k, v = _qkv(sq=40, skv=40)
    bias = torch.zeros(2, 1, 1, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sd.attention(q, k.bfloat16(), v, bias, mode=mode)
        if mode == "sdpa":
            torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k.bfloat16(), v, attn_mask=bias),
                                       rtol=0, atol=0)
        qg = q.clone().requires_grad_()
        sd.attention(qg, k, v, mode=mode).float().sum().backward()
    assert out.dtype == torch.bfloat16 and qg.grad.dtype == torch.float32
    torch.testing.assert_close(out, sd.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias.bfloat16(), mode=mode),
                               rtol=0, atol=0)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_float_mask_of_another_dtype_is_refused_on_every_path(mode):
    """Bug: a bf16 0 / -inf key mask with fp16 q ran natively inside a mask_scope and raised torch's
    RuntimeError outside one (SDPA's dtype rule): the answer depended on the path. Now a ValueError
    on every path, where torch SDPA refuses the pair; float32 and the query's dtype are accepted."""
    q, k, v = (t.half() for t in _qkv(sq=16, skv=16))
    keep = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    keep[1, ..., -4:] = False
    for dtype in (torch.bfloat16, torch.float64):
        for scoped in (False, True):
            with sd.mask_scope() if scoped else contextlib.nullcontext():
                with pytest.raises(ValueError, match="float32 or the query's dtype"):
                    sd.attention(q, k, v, torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -math.inf),
                                 mode=mode)
    for dtype in (torch.float16, torch.float32):
        sd.attention(q, k, v, torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -math.inf), mode=mode)


def test_fp16_output_saturates_at_its_range_instead_of_overflowing():
    """Fails on: FP4 on x1e4 heavy-tailed fp16 inputs gave +-inf in 445 output values on an H100 where its
    reference stays finite (an output at fp16's 65504 rounded a few ulps up, past 65520, to infinity;
    exact attention never exceeds max |V|). The kernels saturate finite results at the dtype's range and
    the references' float32 results are cast the same way; NaN and V's own infinities stay."""
    from sage_diffusers._shared import to_output_dtype

    x = torch.tensor([7e4, -1e5, 65519.0, 3.0, float("inf"), -float("inf"), float("nan")])
    half = to_output_dtype(x, torch.float16)
    assert half[:3].tolist() == [65504.0, -65504.0, 65504.0] and half[3] == 3.0
    assert half[4] == float("inf") and half[5] == -float("inf") and torch.isnan(half[6])
    bf16 = to_output_dtype(x, torch.bfloat16)  # inside bf16's range: an ordinary cast
    assert torch.equal(bf16[:4], x[:4].to(torch.bfloat16))
    assert to_output_dtype(x.half(), torch.float16).dtype == torch.float16
    # The API's reference path goes through it: an fp32 output past 65504 comes back finite.
    v = torch.full((1, 1, 4, 8), 65504.0, dtype=torch.float16)
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    for mode in ("int8", "fp4", "sdpa"):
        out = sd.attention(q, q, v, mode=mode)
        assert torch.isfinite(out).all() and out.dtype == torch.float16, mode
