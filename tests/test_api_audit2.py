"""Audit of sd.attention against torch SDPA (second round): output memory layout and torch.compile
with symbolic shapes. CPU, small shapes; the low-bit modes run their torch references here.

Each test's docstring names the bug it pins.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers import _shared


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


B, S, H, D = 2, 24, 4, 64


def _bshd(seed, packed=False, dtype=torch.float32):
    """q, k, v as (B, S, H, D) tensors: contiguous, or views of one packed (B, S, 3, H, D) tensor."""
    g = torch.Generator().manual_seed(seed)
    if packed:
        return torch.randn(B, S, 3, H, D, generator=g, dtype=dtype).unbind(2)
    return tuple(torch.randn(B, S, H, D, generator=g, dtype=dtype) for _ in range(3))


def _key_mask(seed):
    km = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > 0.3
    km[:, 0] = True
    return km


def _sdpa_bshd(q, k, v, **kw):
    """torch SDPA on BSHD tensors, as a BSHD caller writes it."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)


@pytest.mark.parametrize("mode", ["sdpa", "int8", "fp4"])
@pytest.mark.parametrize("masks", ["none", "key_mask", "key_mask_causal", "attn_mask_2d", "causal"])
@pytest.mark.parametrize("packed", [False, True])
def test_bshd_output_has_sdpas_memory_layout(mode, masks, packed):
    """Bug: layout="BSHD" calls of the torch references (mode "int8"/"fp4" on CPU) and of the SDPA path
    with a mask returned a BHSD-memory tensor seen as (B, S, H, D): strides unlike torch SDPA's (and
    the GPU kernels', which write into ``empty_like(q)``), so ``out.view(B, S, H * D)`` raised."""
    q, k, v = _bshd(1, packed)
    kw, ref_kw = {}, {}
    km = _key_mask(2)
    if masks.startswith("key_mask"):
        kw["key_mask"] = km
        ref_kw["attn_mask"] = km[:, None, None, :]
    if masks == "attn_mask_2d":
        m = torch.rand(S, S, generator=torch.Generator().manual_seed(3)) > 0.3
        m[:, 0] = True
        kw["attn_mask"] = ref_kw["attn_mask"] = m
    causal = masks.endswith("causal")
    if causal and "attn_mask" in ref_kw:
        ref_kw["attn_mask"] = ref_kw["attn_mask"] & torch.ones(S, S, dtype=torch.bool).tril()
    elif causal:
        ref_kw["is_causal"] = True
    out = sd.attention(q, k, v, layout="BSHD", mode=mode, is_causal=causal, **kw)
    ref = _sdpa_bshd(q, k, v, **ref_kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.stride() == ref.stride() == (S * H * D, H * D, D, 1)
    assert out.view(B, S, H * D).shape == (B, S, H * D)  # raised "view size is not compatible"
    if mode == "sdpa":
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("mode", ["sdpa", "int8", "fp4"])
def test_bhsd_output_layout_is_unchanged(mode):
    """The layout fix keeps BHSD callers' contiguous output (and copies nothing there)."""
    q, k, v = (t.transpose(1, 2).contiguous() for t in _bshd(4))
    out = sd.attention(q, k, v, key_mask=_key_mask(5), is_causal=True, mode=mode)
    assert out.is_contiguous()
    ref = torch.randn(B, H, S, D)
    assert _shared.in_output_layout(ref, q) is ref


def test_bshd_training_output_has_sdpas_layout_and_gradients():
    """Bug: the SageBwd path (mode "int8" with gradients) returned BHSD memory to BSHD callers too; the
    copy into SDPA's layout must keep the graph."""
    q, k, v = (t.requires_grad_() for t in _bshd(6))
    out = sd.attention(q, k, v, layout="BSHD", mode="int8")
    assert out.stride() == _sdpa_bshd(q, k, v).stride()
    out.view(B, S, H * D).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_nonfinite_rows_keep_the_bshd_layout():
    """The per-row-mask SDPA path marks rows that see a NaN key; that pass kept BSHD memory too."""
    q, k, v = _bshd(7)
    k = k.clone()
    k[0, 5, 1, 3] = math.nan
    m = torch.ones(S, S, dtype=torch.bool)
    m[:10, 5] = False  # key 5 hidden from rows 0..9 only
    out = sd.attention(q, k, v, m, layout="BSHD", mode="int8")
    assert out.stride() == (S * H * D, H * D, D, 1)
    assert torch.isfinite(out[0, :10, 1]).all() and torch.isnan(out[0, 10:, 1]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, :, [0, 2, 3]]).all()


@pytest.mark.parametrize("case", ["sdpa", "sdpa-gqa", "sdpa-key-mask", "train-int8"])
def test_torch_compile_with_dynamic_shapes(case):
    """Bug: under torch.compile(dynamic=True) SDPA got ``enable_gqa=hq != hkv``, a SymBool that it refuses
    (TypeError, graph break: fullgraph failed on every "sdpa" call), and SageBwd's scale check ran
    math.isfinite on the SymFloat default scale 1/sqrt(D) (graph break on every "int8" training call)."""
    torch._dynamo.reset()
    mode = "int8" if case == "train-int8" else case.split("-")[0]
    hkv = 2 if case.endswith("gqa") else H

    def fn(q, k, v, km):
        return sd.attention(q, k, v, layout="BSHD", mode=mode, key_mask=km, is_causal=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for s in (16, 24) if mode == "sdpa" else (16,):  # one shape is traced symbolically already
        g = torch.Generator().manual_seed(s)
        q = torch.randn(B, s, H, D, generator=g)
        k, v = (torch.randn(B, s, hkv, D, generator=g) for _ in range(2))
        km = None
        if case.endswith("key-mask"):
            km = torch.rand(B, s, generator=g) > 0.3
            km[:, 0] = True
        if case.startswith("train"):
            q.requires_grad_()
        expect = fn(q, k, v, km)
        out = compiled(q, k, v, km)
        torch.testing.assert_close(out, expect)
        assert out.stride() == expect.stride()
        if q.requires_grad:
            out.sum().backward()
            assert torch.isfinite(q.grad).all()


def test_sagebwd_reference_runs_as_opaque_ops_under_compile():
    """Bug: on torch 2.11, torch.compile(dynamic=True) of a CPU training call with mode="int8" failed
    an internal dynamo assertion (fullgraph or not): inside SageBwd's autograd function it traced the
    torch reference's loops over key tiles and specialised their symbolic lengths. The reference's
    passes are torch ops now, like the Triton kernels': the compiled graph holds the op itself."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(q, k, v):
        return sd.attention(q, k, v, layout="BSHD", mode="int8", is_causal=True)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(2))
    out = torch.compile(fn, fullgraph=True, backend=backend, dynamic=True)(q, k, v)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    code = [str(m.graph) for gm in graphs for m in gm.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)]
    assert any("sagebwd_reference_fwd" in c for c in code), code


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_non_finite_scales_are_still_refused(scale):
    """The scale check's comparisons (traceable with symbolic shapes) refuse what math.isfinite refused."""
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="scale: expected a finite float"):
        sd.attention(q, q, q, scale=scale)
