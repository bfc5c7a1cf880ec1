"""SageBwd's Hopper backward (``kernels/sagebwd_sm90.py``, ``csrc/sm90_sagebwd/``).

On the CPU: the image layouts against the 8-bit forward's (the same swizzle patterns, written
independently), the host constants against ``api.h``, which calls the kernels take, and, in Triton's
interpreter (a child process, as ``test_sagebwd_triton.py`` runs its kernels), the image pre-pass
against its torch specs bit for bit and the backward's routing (the LSE gradient, the fallback). On an
sm_90 GPU: the whole backward against the torch reference on realistic inputs, and under a CUDA graph.
"""
import contextlib
import math
import os
import re
from pathlib import Path

import pytest
import torch

from sage_diffusers import _fallback
from sage_diffusers.kernels import int8_sm90, sagebwd_sm90, sagebwd_triton
from sage_diffusers.reference import cosine
from sage_diffusers.reference import sagebwd as ref
from sage_diffusers.reference.sagebwd import DoVPrecision, PVPrecision, ScorePrecision

from bench.sagebwd_cuda_dkdv import check_inputs
from test_sagebwd_triton import INTERPRETER_SKIP, run_under_interpreter

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if IN_INTERPRETER else (["cuda"] if torch.cuda.is_available() else [])
needs_device = pytest.mark.skipif(not DEVICES, reason="no CUDA device: runs in the interpreter child")
SM90_OK, SM90_WHY = (False, "the interpreter child runs the image pre-pass only") if IN_INTERPRETER \
    else sagebwd_sm90.is_available()
needs_sm90 = pytest.mark.skipif(not SM90_OK, reason=f"sm90 backward kernels: {SM90_WHY}")
API_H = Path(__file__).resolve().parents[1] / "csrc" / "sm90_sagebwd" / "api.h"


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter child itself")
@pytest.mark.skipif(INTERPRETER_SKIP is not None, reason=INTERPRETER_SKIP or "")
def test_pre_pass_under_interpreter():
    run_under_interpreter(str(Path(__file__)))


# ---- CPU: layouts, constants, which calls -----------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_image_offsets_are_the_forward_kernels_patterns(d):
    """The 16-bit tile pattern is the 8-bit forward's V image pattern for 64 keys, the INT8 one its
    SW64 K-major pattern with the forward's V^T token order; both are permutations of the tile."""
    off16 = sagebwd_sm90.image16_offsets(d)
    assert torch.equal(off16, int8_sm90._v16_offsets(64, d, None))
    assert torch.equal(off16.flatten().sort().values, torch.arange(64 * d))
    off8 = sagebwd_sm90.image8t_offsets(d)
    assert torch.equal(off8.flatten().sort().values, torch.arange(64 * d))
    # token 2t + (i & 1) + 8 (i >> 1) of each 16 sits at position 4t + i (the A fragment's byte order)
    assert sagebwd_sm90.token_position()[:16].tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    # channel row r, token 0: byte chunk 0 ^ ((r / 2) % 4)
    assert off8[:8, 0].tolist() == [0, 64, 128 + 16, 192 + 16, 256 + 32, 320 + 32, 384 + 48, 448 + 48]


def test_host_constants_are_the_kernels():
    text = API_H.read_text()
    value = lambda name: int(re.search(rf"\b{name} = (\d+)", text).group(1))  # noqa: E731
    assert value("kVecFloats") == sagebwd_sm90.VEC_FLOATS
    assert [value(n) for n in ("kVecM", "kVecInvL", "kVecDelta", "kVecDvFactor", "kVecSQ")] == [
        sagebwd_sm90.VEC_M, sagebwd_sm90.VEC_INV_L, sagebwd_sm90.VEC_DELTA, sagebwd_sm90.VEC_DV_FACTOR,
        sagebwd_sm90.VEC_SQ]
    assert value("kKScaleFloats") == sagebwd_sm90.K_SCALE_FLOATS
    assert [value(n) for n in ("kKScaleValue", "kKScaleBlock", "kKScaleWord")] == [
        sagebwd_sm90.K_ENTRY_SCALE, sagebwd_sm90.K_ENTRY_BLOCK, sagebwd_sm90.K_ENTRY_WORD]
    assert value("kDvInPlaceMaxQueries") == sagebwd_sm90.DV_IN_PLACE_MAX_QUERIES
    assert value("kBlockM") == value("kKeysPerWG") == sagebwd_sm90.TILE
    assert 2 * sagebwd_sm90.TILE == sagebwd_sm90.CTA_ROWS


def _state(b, hq, hkv, sq, skv, d, scores="fp16", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(sq + skv + d)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, skv, d, generator=g).to(dtype) for _ in range(2))
    return ref.sagebwd_forward(q, k, v, pv="fp16", scores=scores)


def test_which_calls_the_kernels_take(monkeypatch):
    ok = _state(1, 2, 2, 128, 256, 64)
    if not sagebwd_sm90.VISIBILITY_GPU_CHECKED:
        assert "not yet checked on a GPU" in sagebwd_sm90.unsupported(ok, None, True, DoVPrecision.FP16, True)
        monkeypatch.setattr(sagebwd_sm90, "VISIBILITY_GPU_CHECKED", True)
    why = lambda st, **kw: sagebwd_sm90.unsupported(  # noqa: E731
        st, kw.get("mask"), kw.get("causal", False), kw.get("dov", DoVPrecision.FP16), kw.get("qk16", True))
    assert why(ok) == "tensors not on a CUDA device"  # every other condition holds
    assert "INT8 scores" in why(_state(1, 2, 2, 128, 128, 64, scores="int8"), qk16=False)
    assert "INT8" in why(ok, dov=DoVPrecision.INT8)
    assert why(ok, mask=torch.ones(1, 256, dtype=torch.bool), causal=True) == "tensors not on a CUDA device"
    assert why(_state(1, 4, 2, 128, 128, 64)) == "tensors not on a CUDA device"  # GQA
    assert why(_state(1, 1, 1, 128, 128, 32)).startswith("head dim 32")
    assert "multiples of 128" in why(_state(1, 1, 1, 4429 % 512, 128, 64))
    assert "multiples of 128" in why(_state(1, 1, 1, 128, 192, 128))
    assert "multiples of 128" in why(_state(1, 1, 1, 0, 128, 64))  # an empty sequence: the Triton path's zeros


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch):
    """A device where the extension does not build gets the build's error as its reason (the backward
    then runs the Triton kernels and counts it)."""
    def boom():
        raise RuntimeError("nvcc not found\ndetails")

    monkeypatch.setattr(sagebwd_sm90, "is_available", lambda: (True, "ok"))
    monkeypatch.setattr(sagebwd_sm90, "_extension", boom)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    assert sagebwd_sm90._device_reason(0) == "build failed: RuntimeError: nvcc not found"


def test_sm90_is_a_choice_of_the_variable(monkeypatch):
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "sm90")
    assert sagebwd_triton.bwd_kernels(128) is sagebwd_triton.BwdKernels.SM90
    monkeypatch.delenv("SAGE_DIFFUSERS_SAGEBWD_BWD")
    assert sagebwd_triton.bwd_kernels(128) is sagebwd_triton.BwdKernels.LEAN  # opt-in: not the default


# ---- interpreter child / GPU: the image pre-pass and the routing ------------------------------------------
@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_image_pre_pass_matches_its_specs(device, d, dtype):
    """Each image bit for bit as its torch spec writes it, from strided sources (one a transposed copy,
    dO' codes from the row pre-pass's transposed copy with its padded token stride); the vectors likewise."""
    b, h, s = 2, 3, 128
    g = torch.Generator().manual_seed(d)
    x = torch.randn(b, h, s, d, generator=g).to(dtype).to(device)
    y = torch.randn(b, h, d, s, generator=g).to(dtype).to(device).transpose(-1, -2)  # token stride 1
    xo, yo = sagebwd_sm90.images16(x, y)
    assert xo.dtype == yo.dtype == dtype
    assert torch.equal(xo.cpu(), sagebwd_sm90.image16_reference(x.cpu()))
    assert torch.equal(yo.cpu(), sagebwd_sm90.image16_reference(y.cpu()))

    codes = torch.randint(-127, 128, (b, h, s, d), generator=g, dtype=torch.int8)
    codes_t = torch.empty(b, h, d, s + 16, dtype=torch.int8)[..., :s]  # a padded token stride, as backward_rows'
    codes_t.copy_(torch.randint(-127, 128, (b, h, d, s), generator=g, dtype=torch.int8))
    scale = torch.rand(b, h, s // 64, generator=g)
    xo8, yo8, ks = sagebwd_sm90.images8t(codes.to(device), codes_t.to(device).transpose(-1, -2), scale.to(device))
    assert torch.equal(xo8.cpu(), sagebwd_sm90.image8t_reference(codes))
    assert torch.equal(yo8.cpu(), sagebwd_sm90.image8t_reference(codes_t.transpose(-1, -2)))
    assert torch.equal(ks.cpu().view(torch.int32), sagebwd_sm90.key_entries_reference(scale))
    mask = torch.rand(b, s, generator=g) < 0.5
    mask[1, 64:] = False  # a fully masked block
    words = sagebwd_sm90.key_words(mask)
    _, _, ks = sagebwd_sm90.images8t(codes.to(device), scale=scale.to(device), words=words.to(device))
    assert torch.equal(ks.cpu().view(torch.int32), sagebwd_sm90.key_entries_reference(scale, words))
    alone, none, no_scale = sagebwd_sm90.images8t(codes.to(device))
    assert torch.equal(alone.cpu(), xo8.cpu()) and none is None and no_scale is None

    q = torch.randn(b, h, s, d, generator=g).to(dtype).to(device)
    st = ref.sagebwd_forward(q, q, q, pv="fp16", scores="fp16")
    rows = sagebwd_triton.backward_rows(q, st, False)
    vec = sagebwd_sm90.query_vectors(st.sq, rows)
    assert torch.equal(vec, sagebwd_sm90.query_vectors_reference(st.sq, rows))


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128])
def test_channel_codes_match_their_spec(device, d):
    """dO' per channel bit for bit as the spec quantizes it, from a strided float32 dO with a channel of
    zeros, a row of x1e4, +-Inf and NaN entries (0 in the absmax; saturated and 0 codes)."""
    b, h, s = 2, 2, 192
    g = torch.Generator().manual_seed(d + 1)
    do = torch.randn(b, h, d, s, generator=g).transpose(-1, -2)  # token stride 1
    do[:, :, :, 3] = 0.0
    do[0, 1, 70] *= 1e4
    do[1, 0, 5, 7], do[1, 0, 6, 8], do[1, 1, 100, 9] = math.inf, -math.inf, math.nan
    inv_l = torch.rand(b, h, s, generator=g) + 0.01
    inv_l = inv_l * sagebwd_sm90.DS_PRESCALE  # as the row pre-pass stores it
    rows = sagebwd_triton.BackwardRows(*(None,) * 2, inv_l.to(device), *(None,) * 4)
    img, scale = sagebwd_sm90.channel_codes(do.to(device), rows)
    want_codes, want_scale = sagebwd_sm90.channel_codes_reference(do, inv_l / sagebwd_sm90.DS_PRESCALE)
    assert torch.equal(scale.cpu(), want_scale) and bool((want_scale[:, :, 3] == 0).all())
    assert torch.equal(img.cpu(), sagebwd_sm90.image8t_reference(want_codes))
    assert want_codes[1, 0, 5, 7] == 127 and want_codes[1, 0, 6, 8] == -127 and want_codes[1, 1, 100, 9] == 0


def test_dv_in_place_where_the_build_and_the_int32_sums_allow():
    assert sagebwd_sm90.dv_in_place(torch.bfloat16, 4096)
    assert sagebwd_sm90.dv_in_place(torch.bfloat16, sagebwd_sm90.DV_IN_PLACE_MAX_QUERIES)
    assert not sagebwd_sm90.dv_in_place(torch.bfloat16, sagebwd_sm90.DV_IN_PLACE_MAX_QUERIES + 128)
    assert not sagebwd_sm90.dv_in_place(torch.float16, 4096)
    assert not sagebwd_sm90.dv_in_place(torch.bfloat16, 4096, is_causal=True)
    assert not sagebwd_sm90.dv_in_place(torch.bfloat16, 4096, gqa=True)
    assert sagebwd_sm90.DV_IN_PLACE_MAX_QUERIES * 127 * 127 < 2 ** 31


def test_key_words_and_blocks():
    """Each word's bits are its 64 keys (bit 63 included, as two's complement), and the dQ kernel's list
    holds the blocks with a visible key in order, padded with the block count."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 256, generator=g) < 0.3
    mask[0, 64:128] = False
    mask[1] = False
    mask[2, 191] = True  # bit 63 of block 2
    words = sagebwd_sm90.key_words(mask)
    assert words.dtype == torch.int64 and words.shape == (3, 4)
    for bi in range(3):
        for j in range(4):
            want = sum(1 << k for k in range(64) if mask[bi, 64 * j + k])
            assert int(words[bi, j]) & (2 ** 64 - 1) == want
    blocks = sagebwd_sm90.key_blocks(words)
    assert blocks.dtype == torch.int32
    for bi in range(3):
        vis = [j for j in range(4) if mask[bi, 64 * j:64 * j + 64].any()]
        assert blocks[bi].tolist() == vis + [4] * (4 - len(vis))


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_backward_routes_to_the_kernels_with_the_lse_gradient(device, monkeypatch):
    """With ``sm90`` chosen, a call the kernels take gets the row pre-pass with the LSE gradient
    subtracted from delta and its dQ the smoothing shift's term, as the Triton path does."""
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "sm90")
    b, h, s, d = 1, 2, 128, 64
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16).to(device) for _ in range(4))
    st = ref.sagebwd_forward(q, k, v, pv="fp16", scores="fp16")
    dlse = torch.randn(b, h, s, generator=g).to(device)
    k_mean = ref.key_mean(k, None)
    seen = {}

    def fake_backward(do_, state, rows, sm_scale, key_mask, is_causal):
        seen.update(rows=rows, sm_scale=sm_scale, key_mask=key_mask, is_causal=is_causal)
        z = torch.zeros(b, h, s, d, device=device)
        return rows.delta[..., None] + z, z + 1, z + 2

    monkeypatch.setattr(sagebwd_sm90, "unsupported", lambda *a: None)
    monkeypatch.setattr(sagebwd_sm90, "backward", fake_backward)
    dq, dk, dv = sagebwd_triton._backward_impl(do, st, None, False, None, DoVPrecision.FP16, dlse=dlse, k_mean=k_mean,
                                               scores=ScorePrecision.FP16)
    rows = sagebwd_triton.backward_rows(do, st, False)
    dl = ref.lse_grad_rows(dlse, st.lse2)
    assert torch.equal(seen["rows"].delta, rows.delta - dl) and seen["sm_scale"] == 1 / math.sqrt(d)
    assert seen["key_mask"] is None and seen["is_causal"] is False
    want = (rows.delta - dl)[..., None] + ref.lse_shift_dq(dl, k_mean, 1 / math.sqrt(d))
    assert torch.equal(dq, want) and bool((dk == 1).all()) and bool((dv == 2).all())


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_calls_the_kernels_do_not_take_run_the_triton_kernels(device, monkeypatch):
    """``sm90`` on a call at head dim 32 (GQA, a key mask): counted and logged once, and the head dim's
    default Triton kernels compute it (the same gradients as without the variable)."""
    b, h, s, d = 1, 2, 128, 32
    g = torch.Generator().manual_seed(6)
    q, do = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    k, v = (torch.randn(b, 1, s, d, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    mask = torch.ones(b, s, dtype=torch.bool, device=device)
    mask[:, 100:] = False
    st = ref.sagebwd_forward(q, k, v, mask, pv="fp16", scores="fp16")
    call = lambda: sagebwd_triton._backward_impl(do, st, mask, False, None, DoVPrecision.FP16,  # noqa: E731
                                                 scores=ScorePrecision.FP16)
    want = call()
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "sm90")
    monkeypatch.setattr(sagebwd_sm90, "VISIBILITY_GPU_CHECKED", True)  # the reason is the head dim's
    with _fallback.recorded_fallbacks() as seen:
        got = call()
    assert list(seen) == ["sagebwd: the sm90 backward kernels do not take head dim 32 (built: 64, 128)"]
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def _decode16(img: torch.Tensor, shape, dtype) -> torch.Tensor:
    """uint8 images of (B, H, S, D) 16-bit tiles -> the tensor."""
    b, h, s, d = shape
    flat = img.view(dtype).reshape(b, h, s // 64, 64 * d)
    return flat[..., sagebwd_sm90.image16_offsets(d, img.device).reshape(-1)].reshape(b, h, s, d)


def _decode8t(img: torch.Tensor, shape) -> torch.Tensor:
    """uint8 transposed INT8 tile images -> the (B, H, S, D) codes."""
    b, h, s, d = shape
    flat = img.view(torch.int8).reshape(b, h, s // 64, 64 * d)
    tiles = flat[..., sagebwd_sm90.image8t_offsets(d, img.device).reshape(-1)].reshape(b, h, s // 64, d, 64)
    return tiles.transpose(-1, -2).reshape(b, h, s, d)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,vis", [(torch.bfloat16, "none"), (torch.float32, "none"), (torch.float16, "none"),
                                       (torch.bfloat16, "mask"), (torch.bfloat16, "causal"), (torch.float16, "both"),
                                       (torch.bfloat16, "gqa")])
def test_backward_hands_the_kernels_their_operands(device, dtype, vis, monkeypatch):
    """What :func:`sagebwd_sm90.backward` passes to the extension, decoded: every image holds the state's
    operand (dO in the compute dtype, the dO' codes of the row pre-pass), the vectors and K's block
    entries theirs, the mask's words and block list, in the binding's argument order, with the scales,
    causality and the dtype flag (GQA: K / V per KV head, no dV in place); the outputs come back."""
    b, h, sq, skv, d = 2, 2, 128, 256, 64
    hkv = 1 if vis == "gqa" else h
    g = torch.Generator().manual_seed(9)
    q, do = (torch.randn(b, h, sq, d, generator=g).to(dtype).to(device) for _ in range(2))
    k, v = (torch.randn(b, hkv, skv, d, generator=g).to(dtype).to(device) for _ in range(2))
    mask = None
    if vis in ("mask", "both"):
        mask = torch.ones(b, skv, dtype=torch.bool)
        mask[0, 70:] = False  # blocks 1 (partly), 2 and 3 masked
        mask[1, :64] = False  # block 0 masked
        mask = mask.to(device)
    causal = vis in ("causal", "both")
    st = ref.sagebwd_forward(q, k, v, mask, causal, pv="fp16", scores="fp16")
    rows = sagebwd_triton.backward_rows(do, st, False)
    cdt = st.vc.dtype
    scale = 0.3
    calls = []

    class Ext:
        def dkdv(self, k_, v_, q_, do_, qt, dot, vec, dv_scale, words, causal_, dk, dv, bf16, qk_scale, sm_scale):
            assert torch.equal(_decode16(k_, (b, hkv, skv, d), cdt), st.kc)
            assert torch.equal(_decode16(v_, (b, hkv, skv, d), cdt), st.vc)
            assert torch.equal(_decode16(q_, (b, h, sq, d), cdt), st.qc)
            assert torch.equal(_decode16(do_, (b, h, sq, d), cdt), do.to(cdt))
            assert torch.equal(_decode8t(qt, (b, h, sq, d)), st.q8)
            if mask is None:
                assert words.numel() == 0
            else:
                assert torch.equal(words, sagebwd_sm90.key_words(mask))
            assert causal_ is causal
            if cdt == torch.bfloat16 and not causal and hkv == h:  # dV in place: dO' per channel, and its scales
                codes, ch_scale = sagebwd_sm90.channel_codes_reference(do, rows.inv_l / sagebwd_sm90.DS_PRESCALE)
                assert torch.equal(_decode8t(dot, (b, h, sq, d)), codes)
                assert torch.equal(dv_scale, ch_scale * ref.P_SCALE)
            else:
                assert torch.equal(_decode8t(dot, (b, h, sq, d)), rows.dos8t.transpose(-1, -2))
                assert dv_scale.numel() == 0
            assert torch.equal(vec, sagebwd_sm90.query_vectors_reference(st.sq, rows))
            assert dk.shape == dv.shape == (b, hkv, skv, d) and dk.dtype == torch.float32
            assert bf16 == (cdt == torch.bfloat16) and qk_scale == scale * sagebwd_sm90.LOG2E and sm_scale == scale
            dk.fill_(1.0)
            dv.fill_(2.0)
            calls.append("dkdv")

        def dq(self, q_, do_, k_, v_, kt, k_scale, m, inv_l, delta, blocks, causal_, dq, bf16, qk_scale, sm_scale):
            assert torch.equal(_decode16(q_, (b, h, sq, d), cdt), st.qc)
            assert torch.equal(_decode16(do_, (b, h, sq, d), cdt), do.to(cdt))
            assert torch.equal(_decode16(k_, (b, hkv, skv, d), cdt), st.kc)
            assert torch.equal(_decode16(v_, (b, hkv, skv, d), cdt), st.vc)
            assert torch.equal(_decode8t(kt, (b, hkv, skv, d)), st.k8)
            assert k_scale.shape == (b, hkv, skv // 64, sagebwd_sm90.K_SCALE_FLOATS)
            words = None if mask is None else sagebwd_sm90.key_words(mask)
            assert torch.equal(k_scale.view(torch.int32), sagebwd_sm90.key_entries_reference(st.sk, words))
            if mask is None:
                assert blocks.numel() == 0
            else:
                assert blocks.tolist() == [[0, 1, 4, 4], [1, 2, 3, 4]]
            assert causal_ is causal
            assert m is rows.mb and inv_l is rows.inv_l and torch.equal(delta, rows.delta)
            assert dq.shape == (b, h, sq, d) and bf16 == (cdt == torch.bfloat16)
            assert qk_scale == scale * sagebwd_sm90.LOG2E and sm_scale == scale
            dq.fill_(3.0)
            calls.append("dq")

    monkeypatch.setattr(sagebwd_sm90, "_extension", lambda: Ext())
    dq, dk, dv = sagebwd_sm90.backward(do, st, rows, scale, mask, causal)
    assert calls == ["dkdv", "dq"]
    assert bool((dq == 3).all()) and bool((dk == 1).all()) and bool((dv == 2).all())


# ---- sm_90 GPU: the kernels -----------------------------------------------------------------------------
def _visibility(vis: str, q, k, v, do):
    """The inputs of a visibility case: ``pad``: text padding per batch (batch 0 keeps its first 300
    keys, batch 1 keys 100 ... 449; NaN in the masked keys' K and V), ``causal``, ``causal+pad``,
    ``causal-short-q`` (the first 256 queries on every key: top-left alignment); ``gqa``: K and V of
    half the heads, each serving two query heads."""
    if "gqa" in vis:
        k, v = k[:, :k.shape[1] // 2], v[:, :v.shape[1] // 2]
    b, _, s, _ = k.shape
    mask = None
    if "pad" in vis:
        mask = torch.zeros(b, s, dtype=torch.bool, device=k.device)
        mask[0, :300] = True
        mask[-1, 100:450] = True
        k, v = k.clone(), v.clone()
        k[~mask[:, None, :, None].expand_as(k)] = math.nan
        v[~mask[:, None, :, None].expand_as(v)] = math.nan
    if vis == "causal-short-q":
        q, do = q[:, :, :256], do[:, :, :256]
    return q, k, v, do, mask, "causal" in vis


@needs_sm90
@pytest.mark.parametrize("shape,dtype,kind,vis", [
    ((1, 2, 256, 128), torch.bfloat16, "offsets", "none"),
    ((2, 3, 512, 64), torch.float16, "sharp", "none"),
    ((1, 2, 384, 128), torch.bfloat16, "sharp", "none"),
    ((1, 2, 512, 64), torch.bfloat16, "inference", "none"),
    ((1, 1, 640, 128), torch.float16, "tiny", "none"),
    ((1, 2, 256, 64), torch.bfloat16, "huge", "none"),
    ((1, 2, 128, 128), torch.float32, "offsets", "none"),  # float32 inputs: bf16 operands
    ((2, 2, 512, 128), torch.bfloat16, "offsets", "pad"),
    ((2, 2, 512, 64), torch.float16, "sharp", "pad"),
    ((1, 2, 512, 64), torch.bfloat16, "sharp", "causal"),
    ((1, 2, 384, 128), torch.float16, "offsets", "causal"),
    ((2, 2, 512, 128), torch.bfloat16, "inference", "causal+pad"),
    ((1, 2, 512, 64), torch.float16, "offsets", "causal-short-q"),
    ((1, 4, 512, 128), torch.bfloat16, "offsets", "gqa"),
    ((2, 4, 512, 64), torch.bfloat16, "sharp", "gqa+causal+pad"),
    ((1, 6, 256, 128), torch.float16, "huge", "gqa+pad"),
])
def test_sm90_backward_matches_the_reference(shape, dtype, kind, vis, monkeypatch):
    """The kernels' gradients on the Triton forward's state against the reference backward on the same
    state (the same quantized operands: only summation orders and exp2 differ; dV with bf16 operands
    against the in-place reference, dO' per channel) and against the Triton kernels', with key masks
    (masked keys' gradients exactly 0) and causality."""
    b, h, s, d = shape
    q, k, v, do, mask, causal = _visibility(vis, *check_inputs(kind, b, h, s, d, dtype, seed=s + d))
    st = sagebwd_triton._forward_impl(q, k, v, mask, causal, None, PVPrecision.FP16, ScorePrecision.FP16)
    run = lambda: sagebwd_triton._backward_impl(do, st, mask, causal, None, DoVPrecision.FP16,  # noqa: E731
                                                scores=ScorePrecision.FP16)
    monkeypatch.setattr(sagebwd_sm90, "VISIBILITY_GPU_CHECKED", True)  # this is that check
    triton_grads = run()
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "sm90")
    with _fallback.recorded_fallbacks() as seen:
        grads = run()
    assert not seen
    ref_grads = list(ref.sagebwd_backward(do, st, mask, causal, scores="fp16"))
    in_place = sagebwd_sm90.dv_in_place(st.vc.dtype, q.shape[2], causal, gqa=k.shape[1] != q.shape[1])
    if in_place:  # dO' per channel: dV's spec is the in-place reference, and it differs from the Triton kernels'
        ref_grads[2] = sagebwd_sm90.dv_in_place_reference(st, do, 1 / math.sqrt(d), mask)
    for name, got, want, tri in zip("qkv", grads, ref_grads, triton_grads):
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all()), name
        if mask is not None and name != "q":
            assert not got.transpose(1, 2)[~mask].any(), name  # a masked key's gradients are exactly 0
        assert cosine(got, want) > 0.99999, (name, cosine(got, want))
        # two quantizations of dO' differ from each other more than each from float64 (0.9993 / 0.9990 at 16K, H100)
        assert cosine(got, tri) > (0.995 if in_place and name == "v" else 0.99999), (name, cosine(got, tri))


@needs_sm90
def test_sm90_backward_through_autograd_and_a_cuda_graph(monkeypatch):
    """sd.sagebwd's gradients with the kernels equal the Triton kernels' (cos), and a backward captured
    in a CUDA graph replays the eager result bit for bit."""
    import sage_diffusers as sd

    b, h, s, d = 1, 4, 256, 128
    q, k, v, do = check_inputs("offsets", b, h, s, d, torch.bfloat16, seed=1)

    def grads():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        sd.sagebwd(*leaves).backward(do)
        return [x.grad for x in leaves]

    want = grads()
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "sm90")
    got = grads()
    for x, y, bound in zip(got, want, (0.99999, 0.99999, 0.995)):  # dV: dO' per channel (in place)
        assert cosine(x, y) > bound
    st = sagebwd_triton._forward_impl(q, k, v, None, False, None, PVPrecision.FP16, ScorePrecision.FP16)
    run = lambda: sagebwd_triton._backward_impl(do, st, None, False, None, DoVPrecision.FP16,  # noqa: E731
                                                scores=ScorePrecision.FP16)
    eager = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, eager):
        assert torch.equal(x, y)
